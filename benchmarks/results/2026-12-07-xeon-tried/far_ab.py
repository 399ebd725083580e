import os, sys, time, torch, random, statistics
sys.path.insert(0, os.getcwd())
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
from models import cpu_kernels
cpu_kernels.load()
r = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=3 << 30)
B = int(os.environ.get("B", 64)); P = int(os.environ.get("PROMPT", 160)); N = 5; ROUNDS = int(os.environ.get("ROUNDS", 8))
VARIANTS = {"far4": ("4", "1"), "far0": ("0", "1"), "none": ("0", "0")}
tables, lasts = [], []
for b in range(B):
    prompt = [100 + (j * 7 + b * 13) % 30000 for j in range(P)]
    t = r.kv.allocate(r.kv.pages_for(P + N * ROUNDS * len(VARIANTS) + 40)); tables.append(t)
    lasts.append(r.step([SeqInput(prompt, t, 0, True)]).token_ids[0])
n0 = 0
def block(name):
    global lasts, n0
    os.environ["XG_FAR"], os.environ["XG_NEAR"] = VARIANTS[name]
    t0 = time.perf_counter()
    for i in range(N):
        seqs = [SeqInput([lasts[b]], tables[b], P + n0, True) for b in range(B)]; n0 += 1
        lasts = r.step(seqs).token_ids
    return (time.perf_counter() - t0) / N * 1e3
for v in VARIANTS: block(v)
res = {v: [] for v in VARIANTS}
for _ in range(ROUNDS):
    for v in random.sample(list(VARIANTS), len(VARIANTS)):
        res[v].append(block(v))
base = res["far4"]
print(f"B={B} P={P}: " + ", ".join(f"{v} {statistics.median(x):.2f} ms (far4/{v} {statistics.median([a / b for a, b in zip(base, x)]):.3f})" for v, x in res.items()))

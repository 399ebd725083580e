import os, sys, time, torch, random, statistics
sys.path.insert(0, os.getcwd())
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
from models import cpu_kernels
cpu_kernels.load()
r = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=2 << 30)
orig = r.model.logits
B = int(os.environ.get("B", 64)); P = 32; N = 10; ROUNDS = int(os.environ.get("ROUNDS", 12))
tables, lasts = [], []
for b in range(B):
    prompt = [100 + (j * 7 + b * 13) % 30000 for j in range(P)]
    t = r.kv.allocate(r.kv.pages_for(P + 2 * N * ROUNDS + 40)); tables.append(t)
    lasts.append(r.step([SeqInput(prompt, t, 0, True)]).token_ids[0])
n0 = 0
def block(widen):
    global lasts, n0
    r.model.logits = (lambda h, fp32=True: orig(h, fp32=True)) if widen else orig
    t0 = time.perf_counter()
    for i in range(N):
        seqs = [SeqInput([lasts[b]], tables[b], P + n0, True) for b in range(B)]; n0 += 1
        lasts = r.step(seqs).token_ids
    return (time.perf_counter() - t0) / N * 1e3
block(False); block(True)
res = {True: [], False: []}
for _ in range(ROUNDS):
    for w in random.sample([True, False], 2):
        res[w].append(block(w))
ratios = [a / b for a, b in zip(res[True], res[False])]
print(f"B={B} dtype={r.model.dtype if hasattr(r.model,'dtype') else ''}: widened {statistics.median(res[True]):.2f} ms, half {statistics.median(res[False]):.2f} ms; per-round widened/half median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")

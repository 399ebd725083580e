"""One side of ab_steps.py: loads the default model's runner from the tree in cwd (its defaults: fp32 here), then
for each stdin line 'R N' runs N decode steps of R rows (sequences of a 128-token prompt, started again
before they pass 378 tokens) and prints the N step times in seconds."""
import os, sys, time, statistics, torch
sys.path.insert(0, os.getcwd())
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
from models import cpu_kernels
cpu_kernels.load()
r = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 31)
P = 128
state = {}
def fresh(B):
    for t in state.get(B, {}).get("tables", []):
        r.kv.free(t) if hasattr(r.kv, "free") else None
    prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
    tables = [r.kv.allocate(r.kv.pages_for(P + 300)) for _ in prompts]
    last = r.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
    state[B] = {"tables": tables, "last": last, "n": 0, "tokens": []}
print("ready", flush=True)
for line in sys.stdin:
    B, N = map(int, line.split())
    if B not in state or state[B]["n"] + N > 250:
        fresh(B)
    st, times = state[B], []
    for _ in range(N):
        batch = [SeqInput([st["last"][i]], st["tables"][i], P + st["n"], True) for i in range(B)]
        t0 = time.perf_counter(); st["last"] = r.step(batch).token_ids; times.append(time.perf_counter() - t0)
        st["n"] += 1
    print(" ".join(f"{t:.6f}" for t in times), flush=True)

"""Time b-row decode steps of the embedded model after prompts of P tokens: python step.py B P STEPS"""
import sys, time, statistics, torch
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
B, P, N = (int(a) for a in sys.argv[1:4])
loaded = load_model(None)
import os; runner = ModelRunner(loaded, dtype=getattr(torch, os.environ["DTYPE"]) if "DTYPE" in os.environ else default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30)
prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
tables = [runner.kv.allocate(runner.kv.pages_for(P + N + 1)) for _ in prompts]
out = runner.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
last, times = out, []
for n in range(N):
    batch = [SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]
    t0 = time.perf_counter(); last = runner.step(batch).token_ids; times.append(time.perf_counter() - t0)
print(f"B={B} P={P}: step ms median {1e3*statistics.median(times):.2f} min {1e3*min(times):.2f} tok/s {B/statistics.median(times):.0f}")

"""bf16 panels (codes=False: the weights as bf16, not block codes), env toggled step by step: python alt_panels.py B P N "A=1" ..."""
import os, sys, time, statistics, functools, torch
import models.runner as mr
mr.CausalLM = functools.partial(mr.CausalLM, codes=False)
from models.loading import load_model
from models.runner import ModelRunner, SeqInput
B, P, N = (int(a) for a in sys.argv[1:4]); modes = sys.argv[4:]
runner = ModelRunner(load_model(None), dtype=torch.bfloat16, kv_budget_bytes=1 << 30)
print(runner.model.invariant_paths if hasattr(runner.model, "invariant_paths") else "", flush=True)
prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
tables = [runner.kv.allocate(runner.kv.pages_for(P + N + 40)) for _ in prompts]
last = runner.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
for n in range(20):
    last = runner.step([SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]).token_ids
times = {m: [] for m in modes}
for n in range(20, 20 + N):
    mode = modes[n % len(modes)]
    for kv in mode.split(","):
        k, v = kv.split("="); os.environ[k] = v
    batch = [SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]
    t0 = time.perf_counter(); last = runner.step(batch).token_ids; times[mode].append(time.perf_counter() - t0)
base = statistics.median(times[modes[0]])
print(f"\nB={B} P={P} bf16 panels")
for m in modes:
    t = statistics.median(times[m]); print(f"  {m}: {1e3*t:.3f} ms  {base/t:.3f}x")

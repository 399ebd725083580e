"""int8 steps with the team's read-ahead (or team rows) toggled step by step: python alt_ra.py B P N ROWS:AHEAD ..."""
import os, sys, time, statistics, torch
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
B, P, N = (int(a) for a in sys.argv[1:4]); modes = sys.argv[4:]
runner = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30, int8_activations=True)
dec = runner.model.decoder
prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
tables = [runner.kv.allocate(runner.kv.pages_for(P + N + 40)) for _ in prompts]
last = runner.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
for n in range(20):
    last = runner.step([SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]).token_ids
times = {m: [] for m in modes}
st0 = open("/proc/stat").readline().split()
for n in range(20, 20 + N):
    mode = modes[n % len(modes)]
    r, a = (int(x) for x in mode.split(":"))
    dec.set_team(r, a)
    batch = [SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]
    t0 = time.perf_counter(); last = runner.step(batch).token_ids; times[mode].append(time.perf_counter() - t0)
st1 = open("/proc/stat").readline().split()
base = statistics.median(times[modes[0]])
print(f"\nB={B} P={P} steal ticks {int(st1[8])-int(st0[8])} of {sum(map(int,st1[1:]))-sum(map(int,st0[1:]))}")
for m in modes:
    t = statistics.median(times[m]); print(f"  team {m}: {1e3*t:.3f} ms  {base/t:.3f}x")

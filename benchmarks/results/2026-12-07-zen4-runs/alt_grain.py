"""int8 product grain toggled step by step (env I8_GRAIN read by each product): python alt_grain.py B P N G1 G2 ..."""
import os, sys, time, statistics, torch
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
B, P, N = (int(a) for a in sys.argv[1:4]); modes = sys.argv[4:]
runner = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30, int8_activations=True)
prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
tables = [runner.kv.allocate(runner.kv.pages_for(P + N + 40)) for _ in prompts]
last = runner.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
for n in range(20):
    last = runner.step([SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]).token_ids
times = {m: [] for m in modes}
st0 = open("/proc/stat").readline().split()
for n in range(20, 20 + N):
    mode = modes[n % len(modes)]
    os.environ["TEAM_RANGES"] = "1" if mode.startswith("r") else "0"
    os.environ["I8_GRAIN"] = mode.lstrip("r")
    batch = [SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]
    t0 = time.perf_counter(); last = runner.step(batch).token_ids; times[mode].append(time.perf_counter() - t0)
st1 = open("/proc/stat").readline().split()
base = statistics.median(times[modes[0]])
print(f"B={B} P={P} steal ticks {int(st1[8])-int(st0[8])} of {sum(map(int,st1[1:]))-sum(map(int,st0[1:]))}", flush=True)
for m in modes:
    t = statistics.median(times[m]); print(f"  grain {m}: {1e3*t:.3f} ms  {base/t:.3f}x of {modes[0]}")

"""b-row decode steps, perf enabled only around them: python stepperf.py B P STEPS (PERF_CTL fifo env)"""
import os, sys, time, statistics, torch
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
from models import cpu_kernels
B, P, N = (int(a) for a in sys.argv[1:4])
if os.environ.get("T1"): torch.set_num_threads(1)
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(os.environ.get("DT", ""), None) or default_dtype(torch.device("cpu"))
loaded = load_model(None)
runner = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=1 << 30, int8_activations=bool(os.environ.get("INT8")))
assert cpu_kernels.load() is not None or True
prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
tables = [runner.kv.allocate(runner.kv.pages_for(P + N + 40)) for _ in prompts]
out = runner.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
last = out
for n in range(20):
    last = runner.step([SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]).token_ids
ctl = os.environ.get("PERF_CTL")
if ctl:
    with open(ctl, "w") as f: f.write("enable\n")
times = []
import cProfile
pr = cProfile.Profile() if os.environ.get("PROF") else None
pr and pr.enable()
for n in range(20, 20 + N):
    batch = [SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]
    t0 = time.perf_counter(); last = runner.step(batch).token_ids; times.append(time.perf_counter() - t0)
if ctl:
    with open(ctl, "w") as f: f.write("disable\n")
if pr:
    pr.disable(); import pstats; pstats.Stats(pr).sort_stats("tottime").print_stats(25)
print(f"B={B} P={P} {dtype}: step ms median {1e3*statistics.median(times):.2f} min {1e3*min(times):.2f} tok/s {B/statistics.median(times):.0f}")

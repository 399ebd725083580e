"""prefill of P tokens with env settings toggled prompt by prompt: python alt_prefill.py P N "A=1" "A=0" ..."""
import os, sys, time, statistics, torch
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
P, N = (int(a) for a in sys.argv[1:3]); modes = sys.argv[3:]
runner = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30, int8_activations=bool(os.environ.get("INT8")))
times = {m: [] for m in modes}
for n in range(N + 2):
    mode = modes[n % len(modes)]
    for kv in mode.split(","):
        k, v = kv.split("="); os.environ[k] = v
    t = runner.kv.allocate(runner.kv.pages_for(P + 1))
    prompt = [100 + (n * 13 + j) % 30000 for j in range(P)]
    t0 = time.perf_counter(); runner.step([SeqInput(prompt, t, 0, True)]); dt = time.perf_counter() - t0
    runner.kv.free(t)
    if n >= len(modes): times[mode].append(dt)
base = statistics.median(times[modes[0]])
print(f"\nprefill {P}")
for m in modes:
    t = statistics.median(times[m]); print(f"  {m}: {1e3*t:.1f} ms  {base/t:.3f}x")

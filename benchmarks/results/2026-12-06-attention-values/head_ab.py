import os, sys, time, torch
sys.path.insert(0, os.getcwd())
from models.loading import load_model
from models.runner import ModelRunner, default_dtype
from models import cpu_kernels
cpu_kernels.load()
r = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 28)
m = r.model
h = torch.randn(1, 576)
big = torch.ones(64 << 20, dtype=torch.int8)
settings = sys.argv[1].split(",")
res = {s: [] for s in settings}
import random
for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 30):
    for s in random.sample(settings, len(settings)):
        os.environ["XG_AHEAD"] = s
        for _ in range(3): m.logits(h)  # (re-reads the env)
        ts = []
        for _ in range(5):
            big.add_(1)
            t0 = time.perf_counter(); m.logits(h); ts.append(time.perf_counter() - t0)
        res[s].append(sorted(ts)[2])
import statistics
base = res[settings[0]]
for s in settings:
    ratios = sorted(b / x for b, x in zip(base, res[s]))
    print(f"XG_AHEAD={s}: median {statistics.median(res[s])*1e3:.3f} ms; speed-up vs {settings[0]}: median {statistics.median(ratios):.3f} (p25 {ratios[len(ratios)//4]:.3f}, p75 {ratios[3*len(ratios)//4]:.3f})")

import json
if len(sys.argv) > 3:
    json.dump({s: {"median_ms": statistics.median(res[s]) * 1e3, "speedup_vs_first": statistics.median(sorted(b / x for b, x in zip(base, res[s])))} for s in settings}, open(sys.argv[3], "w"), indent=1)

"""The decoder's team on and off (and other read-aheads), alternated step by step in one process:

    PYTHONPATH=. python benchmarks/results/2026-12-07-zen4-team/alt.py ROWS PROMPT STEPS   (INT8=1: the int8 mode;
    CONFIGS=off,team: a subset)

Prints each configuration's step time (median, mean, min) over its steps."""
import os, sys, time, statistics, torch
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
B, P, N = (int(a) for a in sys.argv[1:4])
configs = {"off": (0, 0), "team": (16, 2 << 20), "team-noread": (16, 0), "t1M": (16, 1 << 20), "t4M": (16, 4 << 20), "t8M": (16, 8 << 20)}
if os.environ.get("CONFIGS"): configs = {k: configs[k] for k in os.environ["CONFIGS"].split(",")}
dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(os.environ.get("DT", ""), None) or default_dtype(torch.device("cpu"))
loaded = load_model(None)
runner = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=1 << 30, int8_activations=bool(os.environ.get("INT8")))
dec = runner.model.decoder
prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
tables = [runner.kv.allocate(runner.kv.pages_for(P + N + 40)) for _ in prompts]
last = runner.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
for n in range(20):
    last = runner.step([SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]).token_ids
times = {k: [] for k in configs}
names = list(configs)
for n in range(20, 20 + N):
    name = names[n % len(names)]
    dec.set_team(*configs[name])
    batch = [SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]
    t0 = time.perf_counter(); last = runner.step(batch).token_ids; times[name].append(time.perf_counter() - t0)
for k, ts in times.items():
    print(f"B={B} {'int8' if os.environ.get('INT8') else 'exact'} {k:12s} step ms median {1e3*statistics.median(ts):.2f} mean {1e3*statistics.mean(ts):.2f} min {1e3*min(ts):.2f}")

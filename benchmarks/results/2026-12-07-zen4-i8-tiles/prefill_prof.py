"""Prefill of 8 prompts of 128 tokens in one step (a served wave's shape), exact and int8 runners alternated; then
torch.profiler's table of each."""
import sys, time, torch
from models.loading import load_model
from models.runner import ModelRunner, default_dtype
from models.runner import SeqInput
loaded = load_model(None)
dtype = default_dtype(torch.device("cpu"))
runners = {"exact": ModelRunner(loaded, dtype=dtype, kv_budget_bytes=1 << 30),
           "int8": ModelRunner(loaded, dtype=dtype, kv_budget_bytes=1 << 30, int8_activations=True)}
prompts = [list(range(100 + 200 * i, 228 + 200 * i)) for i in range(8)]
def step(r):
    pages = [r.kv.allocate(r.kv.pages_for(128)) for _ in prompts]
    t = time.perf_counter(); r.step([SeqInput(p, pg) for p, pg in zip(prompts, pages)]); dt = time.perf_counter() - t
    for pg in pages: r.kv.free(pg)
    return dt
times = {k: [] for k in runners}
for i in range(6):
    for k, r in runners.items(): times[k].append(step(r))
for k, v in times.items(): v.sort(); print(k, f"{1024 / v[len(v)//2]:.0f} tok/s (median of 6)")
for k, r in runners.items():
    with torch.profiler.profile() as prof:
        for _ in range(3): step(r)
    print(k); print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))

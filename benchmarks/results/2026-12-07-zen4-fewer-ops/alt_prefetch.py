"""The int8 product's software prefetch on and off, step by step in one process: it ran against builds with a temporary
toggle (env I8_PREFETCH, then I8_AHEAD, read by each product), removed once measured (prefetch-steps.txt)."""
import os, sys, time, statistics, torch
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
B, P, N = (int(a) for a in sys.argv[1:4])
runner = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30, int8_activations=True)
m = runner.model
prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
tables = [runner.kv.allocate(runner.kv.pages_for(P + N + 40)) for _ in prompts]
last = runner.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
for n in range(20):
    last = runner.step([SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]).token_ids
head = m.lm_head; hacc = {"on": 0.0, "off": 0.0}; mode = ["on"]
class H:
    def __getattr__(self, k): return getattr(head, k)
    def __call__(self, *a):
        t0 = time.perf_counter(); r = head(*a); hacc[mode[0]] += time.perf_counter() - t0; return r
m.lm_head = H()
times = {"on": [], "off": []}
for n in range(20, 20 + N):
    mode[0] = "on" if n % 2 == 0 else "off"
    os.environ["I8_AHEAD"] = "1" if mode[0] == "on" else "0"
    batch = [SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]
    t0 = time.perf_counter(); last = runner.step(batch).token_ids; times[mode[0]].append(time.perf_counter() - t0)
a, b = statistics.median(times["on"]), statistics.median(times["off"])
k = len(times["on"])
print(f"B={B} P={P} int8 prefetch {1e3*a:.3f} ms (head {1e3*hacc['on']/k:.3f}), without {1e3*b:.3f} ms (head {1e3*hacc['off']/k:.3f}): {b/a:.3f}x (mean {statistics.mean(times['off'])/statistics.mean(times['on']):.3f}x)")

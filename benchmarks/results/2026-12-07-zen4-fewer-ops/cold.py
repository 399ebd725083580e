"""A one-row step with the decoder and the head replaced by their cached outputs (the Python and torch ops of a
step alone, caches warm), then with a 96 MB read where the decoder was (as the weights stream through the caches):
    PYTHONPATH=. python benchmarks/results/2026-12-07-zen4-fewer-ops/cold.py 1 100 1000
"""
import os, sys, time, statistics, torch
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
from models import cpu_kernels, layers
B, P, N = (int(a) for a in sys.argv[1:4])
runner = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30, int8_activations=True)
m = runner.model
prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
tables = [runner.kv.allocate(runner.kv.pages_for(P + N + 40)) for _ in prompts]
last = runner.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
for n in range(20):
    last = runner.step([SeqInput([last[i]], tables[i], P + n, True) for i in range(B)]).token_ids
def run(label):
    global last
    t = 0.0
    for n in range(20, 20 + N):
        batch = [SeqInput([last[i]], tables[i], P + 20 + n % 50, True) for i in range(B)]
        t0 = time.perf_counter(); last = runner.step(batch).token_ids; t += time.perf_counter() - t0
    print(f"{label}: step {1e3*t/N:.3f} ms")
run("real")

orig_dec = layers.cpu_kernels.decoder_forward
cache = {}
def fake_dec(dec, x, h, *a):
    if "h" not in cache: cache["h"] = orig_dec(dec, x, h, *a)
    return cache["h"].clone()
layers.cpu_kernels.decoder_forward = fake_dec
head = m.lm_head
class H:
    def __getattr__(self, k): return getattr(head, k)
    def __call__(self, *a):
        if "l" not in cache: cache["l"] = head(*a)
        return cache["l"].clone()
m.lm_head = H()
run("decoder+head cached (no weight stream)")
big = torch.ones(24 << 20, dtype=torch.float32)
orig2 = fake_dec
def flush_dec(*a):
    big.sum(); return orig2(*a)
layers.cpu_kernels.decoder_forward = flush_dec
t=time.perf_counter()
for _ in range(100): big.sum()
print(f"flush alone {1e3*(time.perf_counter()-t)/100:.3f} ms")
run("cached + 96 MB flush in place of decoder")

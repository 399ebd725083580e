"""direct<1,4> nibble kernel: one layer's weight hot in L2 vs 30 layers streamed; 1 and 2 threads"""
import sys, time, torch
from models.loading import load_model
from models.runner import ModelRunner
from models import cpu_kernels
runner = ModelRunner(load_model(None), dtype=torch.float32, kv_budget_bytes=1 << 28)
layers = runner.model.layers
def t(fn, reps):
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps): fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best
for threads in (1, 2):
    torch.set_num_threads(threads)
    out = []
    for name in ("qkv", "gate_up"):
        lins = [getattr(l, name) for l in layers]
        x = torch.randn(1, lins[0].shape[1])
        one = lins[0]
        w = one.shape[0] * one.shape[1]
        hot = t(lambda: one(x), 200)
        cold = t(lambda: [l(x) for l in lins], 10) / len(lins)
        nb = sum(t_.numel() * t_.element_size() for t_ in one.codes)
        out.append(f"{name} hot {hot*1e6:.1f} us ({w/hot/1e9:.1f} Gw/s, {3.0e9*hot*threads/(w/32):.1f} cyc/32w@3GHz) stream {cold*1e6:.1f} us ({nb/cold/1e9:.1f} GB/s)")
    print(f"threads={threads}: " + " | ".join(out))

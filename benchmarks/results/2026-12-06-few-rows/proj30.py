"""Each projection kind of all 30 layers at M rows, called in sequence: us a call and GB/s. python proj30.py M [threads]"""
import sys, time, torch
from models.loading import load_model
from models.runner import ModelRunner, default_dtype
from models import cpu_kernels
M = int(sys.argv[1]); 
if len(sys.argv) > 2: torch.set_num_threads(int(sys.argv[2]))
runner = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 28)
model = runner.model
layers = model.layers
def nbytes(lin):
    return sum(t.numel() * t.element_size() for t in lin.codes)
res = []
for name in ("qkv", "o", "gate_up", "down"):
    lins = [getattr(l, name) for l in layers]
    x = torch.randn(M, lins[0].shape[1]).to(model.dtype)
    for lin in lins: lin(x)
    best = 1e9
    for rep in range(20):
        t0 = time.perf_counter()
        for lin in lins: lin(x)
        best = min(best, time.perf_counter() - t0)
    b = sum(nbytes(l) for l in lins)
    res.append(f"{name}: {1e6*best/len(lins):.1f} us {b/best/1e9:.1f} GB/s")
lin = model.lm_head
x = torch.randn(M, lin.shape[1]).to(model.dtype)
best = 1e9
for rep in range(10):
    t0 = time.perf_counter(); lin(x); best = min(best, time.perf_counter() - t0)
res.append(f"head: {1e6*best:.0f} us {nbytes(lin)/best/1e9:.1f} GB/s")
print(f"M={M} threads={torch.get_num_threads()}: " + " | ".join(res))

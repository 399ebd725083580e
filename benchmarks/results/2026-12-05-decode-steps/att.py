"""Decode attention alone: B rows, context CTX, LAYERS caches (side by side pages): python att.py B CTX LAYERS REPS"""
import sys, time, statistics, torch
from models import cpu_kernels
assert cpu_kernels.load()
B, CTX, LAYERS, REPS = (int(a) for a in sys.argv[1:5])
H, KVH, D, PS = 9, 3, 64, 16
g = torch.Generator().manual_seed(0)
per = (CTX + PS - 1) // PS
table = torch.arange(B * per, dtype=torch.int32).reshape(B, per)
caches = [(torch.randn(B * per * PS, KVH, D, generator=g).bfloat16(), torch.randn(B * per * PS, KVH, D, generator=g).bfloat16()) for _ in range(LAYERS)]
q = torch.randn(B, H, D, generator=g).bfloat16()
lens = torch.full((B,), CTX, dtype=torch.int32)
def step():
    for k, v in caches: out = cpu_kernels.paged_decode_attention(q, k, v, table, lens, PS, D ** -0.5)
    return out
ref = step()
times = []
for _ in range(REPS):
    t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
print(f"B={B} CTX={CTX} layers={LAYERS}: {1e3*statistics.median(times):.2f} ms (min {1e3*min(times):.2f})")
torch.save(ref, "/tmp/p35/att_ref.pt") if len(sys.argv) > 5 and sys.argv[5] == "save" else None
if len(sys.argv) > 5 and sys.argv[5] == "check":
    print("bitwise equal:", torch.equal(ref, torch.load("/tmp/p35/att_ref.pt")))

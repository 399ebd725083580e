"""Decode attention alone (cpu_kernels.paged_decode_attention over LAYERS caches, 16-slot pages in order), the
caches in 2 MB pages (madvise: hp) or not (4k): python att.py B CTX LAYERS REPS hp|4k"""
import sys, time, statistics, torch, ctypes
from models import cpu_kernels
assert cpu_kernels.load()
B, CTX, LAYERS, REPS = (int(a) for a in sys.argv[1:5]); HP = sys.argv[5] == "hp"
libc = ctypes.CDLL("libc.so.6")
def alloc(shape, dtype):
    t = torch.empty(shape, dtype=dtype)
    if HP:
        a, n = t.data_ptr(), t.numel() * t.element_size()
        lo, hi = (a + (1 << 21) - 1) & ~((1 << 21) - 1), (a + n) & ~((1 << 21) - 1)
        if hi > lo: assert libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 14) == 0
    return t
H, KVH, D, PS = 9, 3, 64, 16
g = torch.Generator().manual_seed(0)
per = (CTX + PS - 1) // PS
table = torch.arange(B * per, dtype=torch.int32).reshape(B, per)
big_k = alloc((LAYERS, B * per * PS, KVH, D), torch.bfloat16); big_v = alloc((LAYERS, B * per * PS, KVH, D), torch.bfloat16)
big_k.copy_(torch.randn(big_k.shape, generator=g)); big_v.copy_(torch.randn(big_v.shape, generator=g))
caches = [(big_k[i], big_v[i]) for i in range(LAYERS)]
q = torch.randn(B, H, D, generator=g).bfloat16()
lens = torch.full((B,), CTX, dtype=torch.int32)
def step():
    for k, v in caches: out = cpu_kernels.paged_decode_attention(q, k, v, table, lens, PS, D ** -0.5)
    return out
step()
times = []
for _ in range(REPS):
    t0 = time.perf_counter(); step(); times.append(time.perf_counter() - t0)
print(f"{sys.argv[5]} B={B} CTX={CTX} layers={LAYERS}: {1e3*statistics.median(times):.2f} ms (min {1e3*min(times):.2f})", open("/proc/meminfo").read().split("AnonHugePages:")[1].split("\n")[0].strip())

import time, torch
from models import cpu_kernels
cpu_kernels.load()
import sys
SCAT = len(sys.argv) > 1
S, KVH, D, H = 8192, 3, 64, 9
torch.manual_seed(0)
k = torch.randn(S, KVH, D); v = torch.randn(S, KVH, D)
for ctx in (128, 330, 600):
    for threads in (1, 2):
        torch.set_num_threads(threads)
        q = torch.randn(1, H, D)
        table = (torch.randperm(S)[:1024] if SCAT else torch.arange(1024)).to(torch.int32)[None]
        seq = torch.zeros(1, dtype=torch.int32); lens = torch.tensor([ctx], dtype=torch.int32)
        f = lambda: cpu_kernels.paged_attention(q, k, v, table, seq, lens, 1, 0.125)
        for _ in range(50): f()
        best = 1e9
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200): f()
            best = min(best, (time.perf_counter() - t0) / 200)
        print(f"ctx {ctx} threads {threads}: {best*1e6:.1f} us")

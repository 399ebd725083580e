import torch, time, sys, os
sys.path.insert(0, ".")
from models import cpu_kernels
cpu_kernels.load()
H, KVH, D, page = 9, 3, 64, 16
torch.set_num_threads(int(os.environ.get("T", 1)))
reps = int(os.environ.get("REPS", 2000))
torch.manual_seed(0)
for L in [int(v) for v in os.environ.get("LENS", "256,1024,2048").split(",")]:
    pages = (L + page - 1) // page
    S = pages * page
    kc, vc = torch.randn(S, KVH, D), torch.randn(S, KVH, D)
    pt = torch.randperm(pages).int().view(1, -1)
    q = torch.randn(1, H, D)
    seq = torch.zeros(1, dtype=torch.int32); lens = torch.tensor([L], dtype=torch.int32)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps // 5): out = cpu_kernels.paged_attention(q, kc, vc, pt, seq, lens, page, 0.125)
        ts.append((time.perf_counter() - t0) / (reps // 5))
    best = min(ts)
    print(f"ctx {L}: {best*1e6:.1f} us a call hot, {best*2.6e9/(L*KVH):.1f} cycles/key/kvhead @2.6GHz; sum {out.double().sum().item():.6f}")

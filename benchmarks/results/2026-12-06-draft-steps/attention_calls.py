import torch, time, sys
sys.path.insert(0, ".")
from models import cpu_kernels
cpu_kernels.load()
import os; CONTIG = os.environ.get("CONTIG") == "1"
H, KVH, D, page = 9, 3, 64, int(sys.argv[1]) if len(sys.argv) > 1 else 16
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
for L in [int(v) for v in os.environ.get("LENS", "16,64,128,256,512,1024,2048").split(",")]:
    pages = (L + page - 1) // page
    S = pages * page * 30
    layers = []
    for i in range(30):  # 30 layers: each its own cache (from memory, as in a step)
        kc, vc = torch.randn(S, KVH, D), torch.randn(S, KVH, D)
        pt = (torch.arange(pages) + (torch.randint(0, 29, (1,)) * pages)).int().view(1, -1) if CONTIG else torch.randperm(pages * 30)[:pages].int().view(1, -1)
        layers.append((kc, vc, pt))
    q = torch.randn(1, H, D)
    seq = torch.zeros(1, dtype=torch.int32); lens = torch.tensor([L], dtype=torch.int32)
    best = 1e9
    for _ in range(10):
        t0 = time.perf_counter()
        for kc, vc, pt in layers:
            cpu_kernels.paged_attention(q, kc, vc, pt, seq, lens, page, 0.125)
        best = min(best, (time.perf_counter() - t0) / 30)
    print(f"page {page} ctx {L}: {best*1e6:.1f} us a call, KV {2*L*KVH*D*4/1024:.0f} KB -> {2*L*KVH*D*4/best/1e9:.1f} GB/s")

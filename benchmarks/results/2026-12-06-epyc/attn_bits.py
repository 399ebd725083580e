"""paged_attention on seeded cases -> saved outputs (compare two builds)"""
import sys, torch
from models import cpu_kernels
cpu_kernels.load()
out = []
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for (H, KVH, D) in ((9, 3, 64), (4, 4, 128), (8, 2, 64)):
        S = 4096
        k = torch.randn(S, KVH, D, generator=g).to(dtype); v = torch.randn(S, KVH, D, generator=g).to(dtype)
        for rows_spec in ([1], [300], [600], [1, 1, 1], [7, 1, 300], [40], [1, 513, 2], [257, 256, 255]):
            # a sequence per entry: its rows are its last `n` positions (n = 1: a decode row), contexts random
            tables, seq_of, lens, q_rows = [], [], [], 0
            for b, n in enumerate(rows_spec):
                ctx = max(n, int(torch.randint(1, 900, (1,), generator=g)))
                tables.append(torch.randperm(S, generator=g)[:1024].to(torch.int32))
                for r in range(n):
                    seq_of.append(b); lens.append(ctx - n + r + 1)
            q = torch.randn(len(lens), H, D, generator=g).to(dtype)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                out.append(cpu_kernels.paged_attention(q, k, v, torch.stack(tables), torch.tensor(seq_of, dtype=torch.int32),
                                                       torch.tensor(lens, dtype=torch.int32), 1, D ** -0.5))
torch.save(out, sys.argv[1])
print(len(out), "cases")

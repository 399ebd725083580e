import torch, sys, hashlib
sys.path.insert(0, ".")
from models import cpu_kernels
cpu_kernels.load()
h = hashlib.sha256(); n = 0
torch.manual_seed(1)
for D in (64, 128, 256):
    for KVH, H in ((1, 1), (1, 2), (2, 6), (3, 9), (2, 8), (1, 5), (2, 14), (1, 7), (4, 16)):
        for page in (1, 16):
            for lens_ in ([1], [7], [300], [2048], [5, 300, 17, 900]):
                B = len(lens_)
                pages = [(l + page - 1) // page for l in lens_]
                P = max(pages); S = sum(pages) * page + page
                kc, vc = torch.randn(S, KVH, D), torch.randn(S, KVH, D)
                perm = torch.randperm(S // page)
                table = torch.zeros(B, P, dtype=torch.int32); o = 0
                for b, p in enumerate(pages): table[b, :p] = perm[o:o + p]; o += p
                # decode rows: one per sequence; plus a prefill chunk of the last sequence's last 5 rows
                rows, lens = [], []
                for b, l in enumerate(lens_): rows.append(b); lens.append(l)
                for t in range(max(1, lens_[-1] - 4), lens_[-1] + 1): rows.append(B - 1); lens.append(t)
                q = torch.randn(len(rows), H, D)
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    out = cpu_kernels.paged_attention(q, kc, vc, table, torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), page, 0.125)
                    h.update(out.numpy().tobytes()); n += 1
print(n, h.hexdigest())

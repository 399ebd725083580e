"""Bitwise check of paged_attention across builds: python attcheck.py save|check"""
import sys, torch
from models import cpu_kernels
assert cpu_kernels.load()
def case(seed, batch, heads, kvh, dim, page, dtype, lens, prefill=False, window=0, softcap=0.0):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    pool = sum(pages) + 3
    order = torch.randperm(pool, generator=g)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[used:used + n].int(); used += n
    k = torch.randn(pool * page, kvh, dim, generator=g).to(dtype)
    v = torch.randn(pool * page, kvh, dim, generator=g).to(dtype)
    if not prefill:
        q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
        rows = torch.arange(len(lens), dtype=torch.int32)
        rl = torch.tensor(lens, dtype=torch.int32)
    else:  # every sequence's last 20 rows (or all) as a prefill chunk
        rs, ls = [], []
        for i, n in enumerate(lens):
            for t in range(max(1, n - 20), n + 1): rs.append(i); ls.append(t)
        q = torch.randn(len(rs), heads, dim, generator=g).to(dtype)
        rows, rl = torch.tensor(rs, dtype=torch.int32), torch.tensor(ls, dtype=torch.int32)
    return cpu_kernels.paged_attention(q, k, v, table, rows, rl, page, dim ** -0.5) if not (window or softcap) else \
        torch.ops.tercet.paged_attention(q, k, v, table, rows, rl, page, dim ** -0.5, window, softcap)
outs = []
import itertools
lens_sets = [[5, 300, 17, 1, 256, 257, 600, 33, 64, 128, 90, 12], [176] * 64, [3, 9] * 10, [700, 20]]
for (heads, kvh, dim), page, dtype, li, prefill, (w, sc) in itertools.product(
        [(9, 3, 64), (8, 2, 128), (4, 1, 256), (8, 8, 64), (8, 2, 48)], [1, 16], [torch.float32, torch.bfloat16, torch.float16],
        range(len(lens_sets)), [False, True], [(0, 0.0), (100, 0.0), (0, 30.0)]):
    if prefill and li == 1: continue
    outs.append(case(len(outs), 0, heads, kvh, dim, page, dtype, lens_sets[li], prefill, w, sc))
print(len(outs), "cases")
if sys.argv[1] == "save": torch.save(outs, "/tmp/attref.pt")
else:
    ref = torch.load("/tmp/attref.pt")
    bad = [i for i, (a, b) in enumerate(zip(outs, ref)) if not torch.equal(a, b)]
    print("bitwise equal:", not bad, "differ:", bad[:20])

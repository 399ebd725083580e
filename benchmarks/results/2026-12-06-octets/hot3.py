"""Kernel A/B (run from the repository root: python hot3.py THREADS ROWS): block_linear over the same Q4_1
weights as nibbles (pack_block_codes) and as octets (octet_codes), alternated, best of 5 x 3; hot: one weight,
cold: as many copies as fill ~40-100 MB."""
import sys, time, torch
sys.path.insert(0, '.')
from models import cpu_kernels
from benchmarks.bench_gemm import q4_1_weight
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
cpu_kernels.load()
g = torch.Generator().manual_seed(0)
GHZ = 2.7
ROWS = int(sys.argv[2])
for name, (n, k), copies in [("qkv-hot", (960, 576), 1), ("gate_up-hot", (3072, 576), 1), ("qkv-cold", (960, 576), 120), ("gate_up-cold", (3072, 576), 40), ("down-cold", (576, 1536), 80)]:
    w = q4_1_weight(n, k, g)
    packs = [cpu_kernels.pack_block_codes(w) for _ in range(copies)]
    octs = [[cpu_kernels.octet_codes(c), s, o] for c, s, o in packs]
    x = torch.randn(ROWS, k)
    res = {}
    for rep in range(3):
        for lay, ps in (("pairs", packs), ("octets", octs)):
            for c, s, o in ps: cpu_kernels.block_linear(x, c, s, o, n)
            best = 1e9
            for _ in range(5):
                t = time.perf_counter()
                for c, s, o in ps: cpu_kernels.block_linear(x, c, s, o, n)
                best = min(best, (time.perf_counter() - t) / copies)
            res[lay] = min(res.get(lay, 1e9), best)
    print(f"rows={ROWS} {name:14s} threads={torch.get_num_threads()} pairs {res['pairs']*1e6:7.1f} us  octets {res['octets']*1e6:7.1f} us  ratio {res['pairs']/res['octets']:.2f}")

# in-process A/B of an experiment switch VAR over VALS (default XG_SLICED=1/0) (experiment build): one-row calls, hot (one layer's cache, 1 thread) and
# cold (30 layers' caches, 2 threads), randomized order each round
import torch, time, sys, os, statistics, random, json
sys.path.insert(0, ".")
from models import cpu_kernels
cpu_kernels.load()
H, KVH, D, page = 9, 3, 64, 16
VAR = os.environ.get('VAR', 'XG_SLICED'); VALS = os.environ.get('VALS', '1,0').split(',')
MODES = os.environ.get('MODES', 'hot,cold').split(',')
LENS = [int(v) for v in os.environ.get('LENS', '256,1024,2048').split(',')]
rounds = int(os.environ.get("ROUNDS", 30))
out = {}
for mode in MODES:
    torch.set_num_threads(1 if mode == "hot" else 2)
    for L in LENS:
        pages = (L + page - 1) // page
        n = 1 if mode == "hot" else 30
        S = pages * page * n
        kc, vc = torch.randn(S, KVH, D), torch.randn(S, KVH, D)
        tables = [torch.randperm(pages * n)[:pages].int().view(1, -1) for _ in range(n)]
        q = torch.randn(1, H, D); seq = torch.zeros(1, dtype=torch.int32); lens = torch.tensor([L], dtype=torch.int32)
        reps = 50 if mode == "hot" else 1
        res = {v: [] for v in VALS}
        for _ in range(rounds):
            for s in random.sample(VALS, len(VALS)):
                os.environ[VAR] = s
                for _ in range(70): cpu_kernels.paged_attention(q, kc, vc, tables[0], seq, lens, page, 0.125)  # (re-reads the env)
                t0 = time.perf_counter()
                for _ in range(reps):
                    for pt in tables: cpu_kernels.paged_attention(q, kc, vc, pt, seq, lens, page, 0.125)
                res[s].append((time.perf_counter() - t0) / (reps * n))
        out[f"{mode}-{L}"] = {v: {"us": statistics.median(res[v]) * 1e6, "speedup_vs_first": statistics.median(sorted(a / b for a, b in zip(res[VALS[0]], res[v])))} for v in VALS}
        print(mode, L, "  ".join(f"{v}: {d['us']:.1f} us {d['speedup_vs_first']:.3f}x" for v, d in out[f"{mode}-{L}"].items()), flush=True)
if len(sys.argv) > 1: json.dump(out, open(sys.argv[1], "w"), indent=1)

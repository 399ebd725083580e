# alternate variants (env XG_OCT / XG_BYTES) in one process: rows -> per-kind best-of times
import os, sys, time, collections, torch, gc, statistics
sys.path.insert(0, os.getcwd())
from models.loading import load_model
from models.runner import ModelRunner, default_dtype
from models.projections import BlockCodeLinear
from models import cpu_kernels
cpu_kernels.load()
r = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 28)
groups = collections.defaultdict(list)
for o in gc.get_objects():
    if isinstance(o, BlockCodeLinear):
        groups[(tuple(o.shape), o.codes[0].dtype)].append(o)
rows = [int(v) for v in sys.argv[1].split(",")]
variants = [dict(kv.split("=") for kv in v.split(":") if kv) for v in sys.argv[2].split(",")]  # e.g. XG_OCT=4:XG_BYTES=2,
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
res = collections.defaultdict(list)
for rnd in range(rounds):
    for vi, var in enumerate(variants if rnd % 2 == 0 else variants[::-1]):
        for k in ("XG_OCT", "XG_BYTES"):
            os.environ.pop(k, None)
        os.environ.update(var)
        for key, mods in groups.items():
            for m in rows:
                x = torch.randn(m, key[0][1])
                best = 1e9
                for _ in range(3):
                    t0 = time.perf_counter()
                    for mod in mods:
                        cpu_kernels.block_linear(x, *mod.codes, mod.out_features, None)
                    best = min(best, time.perf_counter() - t0)
                res[(str(var), key, m)].append(best)
for key in sorted(groups):
    for m in rows:
        vals = [statistics.median(res[(str(v), key, m)]) * 1e3 for v in variants]
        print(key[0], m, " | ".join(f"{v:.3f}" for v in vals), " ratio0/i:", " ".join(f"{vals[0]/x:.3f}" for x in vals[1:]))
for m in rows:
    tot = [sum(statistics.median(res[(str(v), key, m)]) for key in groups) * 1e3 for v in variants]
    print("total", m, " | ".join(f"{t:.3f}" for t in tot), " ratio0/i:", " ".join(f"{tot[0]/x:.3f}" for x in tot[1:]))

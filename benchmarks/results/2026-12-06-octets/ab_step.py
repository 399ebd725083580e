"""(run from the repository root: python ab_step.py B PROMPT BLOCKS) In-process A/B of b-row decode steps: runner A (octets, as built) vs runner B (pairs: octet_codes_preferred off), alternated in blocks."""
import os, sys, time, statistics, torch
sys.path.insert(0, os.getcwd())
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
from models import cpu_kernels
B, P, BLOCKS = (int(a) for a in sys.argv[1:4])
cpu_kernels.load()
loaded = load_model(None)
dtype = default_dtype(torch.device("cpu"))
a = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=1 << 29)
real = cpu_kernels.octet_codes_preferred
cpu_kernels.octet_codes_preferred = lambda: False
b = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=1 << 29)
cpu_kernels.octet_codes_preferred = real
print("A layer codes:", a.model.projections()[0].codes[0].dtype, " B:", b.model.projections()[0].codes[0].dtype)
def setup(r):
    prompts = [[100 + (i * 7 + j) % 30000 for j in range(P)] for i in range(B)]
    tables = [r.kv.allocate(r.kv.pages_for(P + 12 * BLOCKS + 40)) for _ in prompts]
    last = r.step([SeqInput(p, t, 0, True) for p, t in zip(prompts, tables)]).token_ids
    return {"tables": tables, "last": last, "n": 0, "times": [], "tokens": []}
sa, sb = setup(a), setup(b)
for blk in range(BLOCKS):
    for r, st in ((a, sa), (b, sb)) if blk % 2 == 0 else ((b, sb), (a, sa)):
        for _ in range(10):
            batch = [SeqInput([st["last"][i]], st["tables"][i], P + st["n"], True) for i in range(B)]
            t0 = time.perf_counter(); st["last"] = r.step(batch).token_ids; st["times"].append(time.perf_counter() - t0)
            st["tokens"].append(list(st["last"])); st["n"] += 1
ma, mb = statistics.median(sa["times"]), statistics.median(sb["times"])
print(f"B={B}: octets median {1e3*ma:.2f} ms (min {1e3*min(sa['times']):.2f}) | pairs median {1e3*mb:.2f} ms (min {1e3*min(sb['times']):.2f}) | pairs/octets {mb/ma:.3f} | same tokens: {sa['tokens'] == sb['tokens']}")

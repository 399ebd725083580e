import sys, time, torch
from models.loading import load_model
from models.runner import ModelRunner, SeqInput, default_dtype
runner = ModelRunner(load_model(None), dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 30)
out = []
for spec in sys.argv[1].split(","):  # N x L: N prompts of L tokens in one step
    n, l = (int(v) for v in spec.split("x"))
    best = 1e9
    for rep in range(3):
        prompts = [[100 + (i * 31 + j * 7 + rep) % 30000 for j in range(l)] for i in range(n)]
        tables = [runner.kv.allocate(runner.kv.pages_for(l)) for _ in range(n)]
        t0 = time.perf_counter(); runner.step([SeqInput(p, t) for p, t in zip(prompts, tables)]); best = min(best, time.perf_counter() - t0)
        for t in tables: runner.kv.free(t)
    out.append(f"{spec}: {n * l / best:.0f} tok/s")
print("  ".join(out))

"""SmolLM2's four decoder projections of one layer (qkv, o, gate_up, down) at M rows: from the GGUF block codes
(bf16_block_linear, as loaded) and from bf16 panels of the same weights (bf16_linear), best of 5.
    python projections.py 512,1024,2048"""
import sys, time, torch
from models.loading import load_model
from models.runner import ModelRunner, default_dtype
from models.projections import Bf16BlockCodeLinear
from models import cpu_kernels
loaded = load_model(None)
runner = ModelRunner(loaded, dtype=default_dtype(torch.device("cpu")), kv_budget_bytes=1 << 28)
seen, L = set(), []
def walk(o, depth=0):
    if depth > 6 or id(o) in seen: return
    seen.add(id(o))
    if isinstance(o, Bf16BlockCodeLinear): L.append(o); return
    if isinstance(o, (list, tuple)): [walk(v, depth+1) for v in o]; return
    if isinstance(o, dict): [walk(v, depth+1) for v in o.values()]; return
    if hasattr(o, "__dict__"): [walk(v, depth+1) for v in vars(o).values()]
walk(runner)
layer = [l for l in L if l.out_features < 20000][:4]
panels = [cpu_kernels.pack_bf16_weight(l.dense().bfloat16()) for l in layer]
def best(f, reps=5):
    b = 1e9
    for _ in range(reps):
        t0 = time.perf_counter(); f(); b = min(b, time.perf_counter() - t0)
    return b
for m in [int(v) for v in sys.argv[1].split(",")]:
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {l.shape[1] for l in layer}}
    flops = sum(2 * m * l.shape[0] * l.shape[1] for l in layer)
    tc = best(lambda: [cpu_kernels.bf16_block_linear(xs[l.shape[1]], *l.codes, l.out_features) for l in layer])
    tp = best(lambda: [cpu_kernels.bf16_linear(xs[l.shape[1]], p, l.out_features) for l, p in zip(layer, panels)])
    print(f"m={m}: codes {tc*1e3:.2f} ms ({flops/tc/1e12:.2f} TFLOP/s)  panels {tp*1e3:.2f} ms ({flops/tp/1e12:.2f} TFLOP/s)")

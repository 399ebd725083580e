"""One [N, K] bf16 weight at M rows: tercet's bf16_linear (panels, AMX tiles) against torch's F.linear (oneDNN), TFLOP/s,
best of 7; T=threads in the environment.   T=1 python onednn_shape.py 512,1024,2048 3072 576"""
import sys, time, torch
from models import cpu_kernels
cpu_kernels.load()
torch.manual_seed(0); import os; torch.set_num_threads(int(os.environ.get("T", "2")))
n, k = int(sys.argv[2]), int(sys.argv[3])
w = torch.randn(n, k).bfloat16()
p = cpu_kernels.pack_bf16_weight(w)
def best(f, reps=7):
    b = 1e9
    for _ in range(reps):
        t0 = time.perf_counter(); f(); b = min(b, time.perf_counter() - t0)
    return b
out = []
for m in [int(v) for v in sys.argv[1].split(",")]:
    x = torch.randn(m, k).bfloat16()
    f = 2 * m * n * k
    tp = best(lambda: cpu_kernels.bf16_linear(x, p, n))
    to = best(lambda: torch.nn.functional.linear(x, w))
    out.append(f"m={m}: {f/tp/1e12:.2f} / {f/to/1e12:.2f}")
print(f"({n},{k}) ours / oneDNN TFLOP/s: " + "  ".join(out))

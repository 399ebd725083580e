"""Run: flock /tmp/p33/bench.lock .venv/bin/python benchmarks/results/2026-12-05-amx-tiles/amx_proto_bench.py OUT.json

GFLOP/s: tercet's bf16_linear (vdpbf16ps panels, committed gemm_bf16.cpp) vs an AMX prototype reading the
same panels vs F.linear (oneDNN), SmolLM2-135M shapes, 2 threads."""
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load

here = Path(__file__).resolve().parent
csrc = here.parents[2] / "models" / "csrc"
load(name="amxproto_ext", sources=[str(here / "amx_proto.cpp"), str(csrc / "gemm_bf16.cpp")],
     extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"], extra_ldflags=["-fopenmp"], extra_include_paths=[str(csrc)], is_python_module=False, verbose=False,
     build_directory=tempfile.mkdtemp(prefix="amxproto-"))
torch.set_num_threads(2)
shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
res = []
for rows in (16, 64, 256, 512):
    for name, (k, n) in shapes.items():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
        packed = torch.ops.tercet.pack_bf16_weight(w)
        arms = {"vdpbf16ps": lambda: torch.ops.tercet.bf16_linear(x, packed, n, None),
                "amx_proto": lambda: torch.ops.amxproto.amx_linear(x, packed, n),
                "onednn": lambda: F.linear(x, w)}
        ref = x.float() @ w.float().T
        row = {"rows": rows, "shape": name, "k": k, "n": n}
        for arm, fn in arms.items():
            y = fn()
            row[arm + "_maxerr"] = float((y.float() - ref).abs().max())
            for _ in range(3): fn()
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 0.3:
                fn(); reps += 1
            dt = (time.perf_counter() - t0) / reps
            row[arm + "_gflops"] = round(2 * rows * k * n / dt / 1e9, 1)
        res.append(row)
        print(row, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
# a row's bits alone vs in 512 rows (the prototype is row-independent: tiles of 16 rows, fixed k blocks)
g = torch.Generator().manual_seed(1)
x = torch.randn(512, 576, generator=g).to(torch.bfloat16)
w = (torch.randn(1536, 576, generator=g) / 24).to(torch.bfloat16)
p = torch.ops.tercet.pack_bf16_weight(w)
big = torch.ops.amxproto.amx_linear(x, p, 1536)
print("amx_proto rows 0-15 alone == in 512:", torch.equal(big[:16], torch.ops.amxproto.amx_linear(x[:16].contiguous(), p, 1536)),
      "rows 480-511 alone == in 512:", torch.equal(big[480:], torch.ops.amxproto.amx_linear(x[480:].contiguous(), p, 1536)),
      "bf16 outputs differing from vdpbf16ps:", int((big != torch.ops.tercet.bf16_linear(x, p, 1536, None)).sum()), "of", big.numel())

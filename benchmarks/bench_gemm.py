"""fp32 projections: tercet's kernel (cpu_kernels.packed_linear) vs oneDNN prepacked vs F.linear,
and the same kernel over block codes (cpu_kernels.block_linear); bf16 projections: tercet's
AVX512_BF16 kernel (cpu_kernels.bf16_linear) vs oneDNN's bf16 prepacked, where the CPU has it.

    python -m benchmarks.bench_gemm [--smoke] [--json PATH] [--rows 1,8,32,64,2048]

SmolLM2-135M's four projection shapes and its LM head, each row count timed
over as many weights of the shape as fill ~96 MB, in turn (so that, as in a
decode step over a whole model, a weight is read from memory, not from
cache), best of several rounds. The weights are Q4_1 values (float(q) * d + m
per block of 32, d and m fp16, as dequantized from a GGUF), so that the block
codes apply; the fp32 kernels see them as any fp32 weights, the bf16 columns the same weights in
bf16. The baseline is `F.linear` (MKL's sgemm) in the same run, oneDNN's bf16 GEMM for the bf16
kernel; the ratios are what to compare across machines. `--smoke`: small shapes, a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from models import cpu_kernels
from models.projections import fp32_block_codes

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def ratio(a: float, b: float) -> float:
    """a / b to 3 significant digits: a ratio far from 1 (a round stalled by CPU steal) stays > 0, not 0.0."""
    return float(f"{a / b:.3g}")


def best_seconds(call, rounds: int) -> float:
    call()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def q4_1_weight(n: int, k: int, generator) -> torch.Tensor:
    """fp32 [n, k] whose every block of 32 k is float(q) * d + m, q in 0..15, d and m fp16 (GGUF's Q4_1)."""
    q = torch.randint(0, 16, (n, k // 32, 32), generator=generator).float()
    q[..., 0], q[..., 1] = 0, 15  # the block's minimum and maximum, as GGUF's quantizer places them
    d = (torch.rand(n, k // 32, 1, generator=generator) * 0.01 + 1e-4).half().float()
    m = (-8 * d + torch.randn(n, k // 32, 1, generator=generator) * 1e-3).half().float()
    return (q * d + m).reshape(n, k)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--rows", default="1,8,32,64,2048")
    args = parser.parse_args(argv)
    shapes = {"small": (48, 64)} if args.smoke else SHAPES
    rows_list = [1, 7] if args.smoke else [int(r) for r in args.rows.split(",")]
    rounds = 2 if args.smoke else 5
    ours_ok = cpu_kernels.packed_linear_available()
    dnnl_ok = torch.backends.mkldnn.is_available()
    bf16_ok = cpu_kernels.bf16_linear_available()
    results = []
    generator = torch.Generator().manual_seed(0)
    # (the bf16 columns alone repeated by bf16_ok: adjacent literals join first, so unparenthesised the whole
    # header was multiplied by it and vanished on a CPU without bf16 units)
    print(f"{'shape':>8} {'rows':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'tercet ms':>10} "
          f"{'tercet GF/s':>12} {'vs F.linear':>12} {'vs oneDNN':>10} {'codes ms':>9} {'vs tercet':>10}"
          + f"{' bf16 oneDNN ms':>15} {'bf16 ms':>8} {'vs oneDNN':>10}" * bf16_ok,
          file=sys.stderr)
    for name, (n, k) in shapes.items():
        count = 2 if args.smoke else max(1, min(64, 96_000_000 // (4 * n * k)))
        weights = [q4_1_weight(n, k, generator) for _ in range(count)]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in weights] if dnnl_ok else []
        panels = [cpu_kernels.pack_linear_weight(w) for w in weights] if ours_ok else []
        codes = [fp32_block_codes(w) for w in weights] if ours_ok else []  # as the model keeps them
        halves = [w.bfloat16() for w in weights] if bf16_ok else []
        onednn_bf16 = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in halves] if dnnl_ok else []
        panels_bf16 = [cpu_kernels.pack_bf16_weight(w) for w in halves]
        for rows in rows_list:
            if n * k > 10_000_000 and rows > 64:
                continue  # the LM head only sees the rows that sample
            x = torch.randn(rows, k)
            plain = best_seconds(lambda: [F.linear(x, w) for w in weights], rounds) / count
            row = {"shape": name, "n": n, "k": k, "rows": rows, "f_linear_ms": round(plain * 1e3, 4)}
            line = f"{name:>8} {rows:>5} {plain * 1e3:>12.3f}"
            if dnnl_ok:
                packed = best_seconds(lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                               for w in onednn], rounds) / count
                row["onednn_ms"] = round(packed * 1e3, 4)
                line += f" {packed * 1e3:>10.3f}"
            else:
                packed = float("nan")
                line += f" {'-':>10}"
            if ours_ok:
                ours = best_seconds(lambda: [cpu_kernels.packed_linear(x, p, n) for p in panels], rounds) / count
                gflops = 2 * rows * n * k / ours / 1e9
                row |= {"tercet_ms": round(ours * 1e3, 4), "tercet_gflops": round(gflops, 1),
                        "vs_f_linear": ratio(plain, ours), "vs_onednn": ratio(packed, ours)}
                line += f" {ours * 1e3:>10.3f} {gflops:>12.1f} {plain / ours:>12.2f} {packed / ours:>10.2f}"
                coded = best_seconds(lambda: [cpu_kernels.block_linear(x, *c, n) for c in codes], rounds) / count
                row |= {"codes_ms": round(coded * 1e3, 4), "codes_vs_tercet": ratio(ours, coded)}
                line += f" {coded * 1e3:>9.3f} {ours / coded:>10.2f}"
            if bf16_ok:
                xh = x.bfloat16()
                dnnl_bf16 = (best_seconds(lambda: [torch.ops.mkldnn._linear_pointwise(xh, w, None, "none", [], "")
                                                   for w in onednn_bf16], rounds) / count if dnnl_ok else float("nan"))
                ours_bf16 = best_seconds(lambda: [cpu_kernels.bf16_linear(xh, p, n) for p in panels_bf16], rounds) / count
                row |= {"bf16_onednn_ms": round(dnnl_bf16 * 1e3, 4), "bf16_ms": round(ours_bf16 * 1e3, 4),
                        "bf16_gflops": round(2 * rows * n * k / ours_bf16 / 1e9, 1),
                        "bf16_vs_onednn": ratio(dnnl_bf16, ours_bf16)}
                line += f" {dnnl_bf16 * 1e3:>14.3f} {ours_bf16 * 1e3:>8.3f} {dnnl_bf16 / ours_bf16:>10.2f}"
            results.append(row)
            print(line, file=sys.stderr)
    if not ours_ok:
        print("tercet's kernel is not available here (no AVX2 + FMA build); baselines only", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "threads": torch.get_num_threads(), "kernel": ours_ok,
                       "bf16_kernel": bf16_ok}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

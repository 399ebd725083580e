"""The speed of light of a decode step, to set each benchmark's result beside.

Two figures of the machine: its read bandwidth (a sum over a large fp32 tensor on the threads
torch uses) and its GEMM peak (a square matmul, fp32, and bf16 where the CPU has bf16 units; in
fp32 the faster of torch's and tercet's own kernel, `cpu_kernels.packed_linear`: on an AVX2 EPYC
torch's MKL made 57 GFLOP/s there while tercet's kernel ran SmolLM2's projections at 101-130, so a
bound from torch's alone sat below what the runner reached, and a bound must not). Two of the
model *as loaded*: the bytes a decoded token reads (what the projections store, in whatever layout
their class keeps: dense fp32 / bf16, oneDNN's packed layout, tercet's panels, GGUF block codes;
the LM head; one embedding row; K and V of the context) and the FLOPs it costs (2 per weight
multiplied, 4 per query dimension and context position for attention).

A result at batch B decoded tokens per step then has two bounds:

- bandwidth: bandwidth / (weights / B + KV + embedding row) tokens/s, the one that binds at batch 1;
- compute: GEMM peak / FLOPs per token (a prompt's FLOPs spread over the tokens decoded after it),
  the one that binds at large batches;

and `bound_row` gives both, which is lower (binds), and the result as a % of it. Norms, rotary
tables, activations and sampling (< 0.1 % of SmolLM2's bytes) are left out.

    python -m benchmarks.roofline [--smoke] [--model PATH] [--context N] [--dtype D] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
SHOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


# ---- the machine ------------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return set()


def has_bf16_units(flags: set[str] | None = None) -> bool:
    return bool(set(BF16_FLAGS) & (cpu_flags() if flags is None else flags))


def measure_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second of a sum over an fp32 tensor of `nbytes` on torch's threads, best of `repeats`."""
    x = torch.ones(nbytes // 4)  # written once: every page is touched before the timing
    x.sum()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def measure_gemm_peak(dtype: torch.dtype = torch.float32, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a square torch matmul (size^3 multiply-adds, 2 FLOPs each) in `dtype`, best of `repeats`."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=g).to(dtype) for _ in range(2))
    torch.matmul(a, b)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def measure_kernel_gemm_peak(size: int = 2048, repeats: int = 5) -> float | None:
    """FLOP/s of tercet's fp32 kernel (`cpu_kernels.packed_linear`, W prepacked) on the square product of
    `measure_gemm_peak`, best of `repeats`; None where this build or CPU has no such kernel."""
    from models import cpu_kernels

    if not cpu_kernels.packed_linear_available():
        return None
    g = torch.Generator().manual_seed(0)
    a, w = (torch.randn(size, size, generator=g) for _ in range(2))
    packed = cpu_kernels.pack_linear_weight(w)
    cpu_kernels.packed_linear(a, packed, size)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        cpu_kernels.packed_linear(a, packed, size)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


@dataclass(frozen=True)
class Machine:
    bandwidth: float  # bytes/s
    gemm_peak: dict[str, float]  # "fp32" (and "bf16" where the CPU has bf16 units) -> FLOP/s
    threads: int
    flags: list[str]  # the vector flags of SHOWN_FLAGS this CPU has
    bandwidth_bytes: int  # the size the bandwidth was read over
    gemm_size: int
    gemm_by: dict[str, str] = field(default_factory=dict)  # which kernel gave each peak ("torch", "tercet")

    def describe(self) -> str:
        peaks = ", ".join(f"{name} {flops / 1e9:.0f}" + (f" ({self.gemm_by[name]})" if name in self.gemm_by else "")
                          for name, flops in self.gemm_peak.items())
        return (f"machine: read {self.bandwidth / 1e9:.1f} GB/s (sum over {self.bandwidth_bytes >> 20} MB), "
                f"GEMM {self.gemm_size}^3 {peaks} GFLOP/s, {self.threads} threads; "
                f"flags {' '.join(self.flags) or '-'}")


def measure_machine(smoke: bool = False) -> Machine:
    """The machine's figures; `smoke`: small sizes, a fraction of a second (not a measurement)."""
    nbytes, size, repeats = (16 << 20, 256, 2) if smoke else (256 << 20, 2048, 5)
    flags = cpu_flags()
    peaks = {"fp32": measure_gemm_peak(torch.float32, size, repeats)}
    by = {"fp32": "torch"}
    own = measure_kernel_gemm_peak(size, repeats)
    if own is not None and own > peaks["fp32"]:
        peaks["fp32"], by["fp32"] = own, "tercet"
    if has_bf16_units(flags):
        peaks["bf16"], by["bf16"] = measure_gemm_peak(torch.bfloat16, size, repeats), "torch"
    return Machine(measure_bandwidth(nbytes, repeats), peaks, torch.get_num_threads(),
                   [f for f in SHOWN_FLAGS if f in flags], nbytes, size, by)


# ---- the model as loaded -----------------------------------------------------------------------

def tensor_bytes(value) -> int:
    """Bytes of the tensors in `value` (a tensor, or lists, tuples and dicts of them; else 0)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()  # (oneDNN's opaque tensors have no storage to ask)
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def projection_bytes(proj) -> tuple[int, int]:
    """(bytes a decode-sized product reads, bytes held) of one projection, read off the tensors the
    object holds, whatever its class names them: the plain `weight` kept beside another layout
    (PackedLinear's keep_dense, used from hundreds of rows on), and the bf16 `panels` kept beside
    block `codes` (Bf16BlockCodeLinear, used above its few rows), are held but not read."""
    held = {name: tensor_bytes(value) for name, value in vars(proj).items()}
    held = {name: n for name, n in held.items() if n}
    read = sum(held.values())
    if "weight" in held and set(held) - {"weight", "bias"}:
        read -= held["weight"]
    if "codes" in held and "panels" in held:
        read -= held["panels"]
    return read, sum(held.values())


def _storage_name(proj) -> str:
    """The class and the dtype of the first tensor it holds (bias aside): "BlockCodeLinear int8"."""
    stack = [v for name, v in reversed(vars(proj).items()) if name != "bias"]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            return f"{type(proj).__name__} {str(value.dtype).removeprefix('torch.')}"
        if isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
    return type(proj).__name__


@dataclass(frozen=True)
class Costs:
    """What one decoded token costs in the model as loaded (`model_costs`)."""

    dtype: str  # the model's ("float32", "bfloat16")
    compute: str  # the GEMM peak that applies: "bf16" for bf16 products on bf16 units, else "fp32"
    context_tokens: int
    params: int  # weights a token multiplies (a MoE's routed experts on average: top_k of them)
    weight_bytes: int  # read once per step whatever the batch: projections, LM head included
    expert_bytes: int  # a MoE's experts, all of them; a step reads those its rows are routed to
    experts: int
    top_k: int
    embed_bytes: int  # one embedding row per token
    kv_bytes: int  # K and V of the context, every layer (a window caps its layer's)
    flops: int  # per decoded token at the context: 2 per weight + attention
    attention_flops: int  # of which attention (4 per query dimension and position)
    q_size: int
    windows: list[int | None]  # per layer
    held_bytes: int  # everything the projections hold (plain copies beside packed ones too)
    storage: dict[str, dict] = field(default_factory=dict)  # by class and dtype: count, params, bytes

    def weights_read(self, batch: int = 1) -> float:
        """Weight bytes a step of `batch` sequences reads (a MoE's: the experts hit, on average)."""
        if not self.experts:
            return self.weight_bytes
        untouched = (1 - self.top_k / self.experts) ** batch
        return self.weight_bytes + self.expert_bytes * (1 - untouched)

    def bytes_per_token(self, batch: int = 1) -> float:
        return self.weights_read(batch) / batch + self.embed_bytes + self.kv_bytes

    def prefill_flops(self, prompt_tokens: int) -> int:
        """FLOPs of a whole prompt: its weights per token, attention over the triangle."""
        attention = sum(4 * self.q_size * _triangle(prompt_tokens, w) for w in self.windows)
        return prompt_tokens * 2 * self.params + attention

    def describe(self) -> str:
        parts = ", ".join(f"{s['count']} {name} {s['bytes'] / s['params']:.3g} B/weight"
                          for name, s in self.storage.items())
        return (f"model as loaded ({self.dtype}): {self.weight_bytes / 1e6:.1f} MB of projections read per step"
                f"{f' + {self.expert_bytes / 1e6:.1f} MB of experts' if self.experts else ''} ({parts}); "
                f"KV {self.kv_bytes / 1e6:.2f} MB/token at {self.context_tokens} tokens; "
                f"{self.bytes_per_token(1) / 1e6:.1f} MB and {self.flops / 1e9:.3f} GFLOP per token at batch 1")

    def to_json(self) -> dict:
        return {**asdict(self), "bytes_per_token_batch1": self.bytes_per_token(1)}


def _triangle(tokens: int, window: int | None) -> int:
    """Sum over positions 1..tokens of the keys each attends to (all before it, or its window)."""
    if window is None or window >= tokens:
        return tokens * (tokens + 1) // 2
    return window * (window + 1) // 2 + (tokens - window) * window


def model_costs(runner_or_model, context_tokens: int) -> Costs:
    """Bytes and FLOPs per decoded token of a `models.ModelRunner` or `models.layers.CausalLM` as it
    holds its weights, with `context_tokens` of K/V read per token."""
    model = getattr(runner_or_model, "model", runner_or_model)
    kv = getattr(runner_or_model, "kv", None)
    kv_item = (kv.k.element_size() if kv is not None
               else torch.empty((), dtype=model.dtype).element_size())
    storage: dict[str, dict] = {}
    totals = {"params": 0, "weight": 0, "expert": 0, "held": 0}
    experts = top_k = 0

    def count(proj, share: float = 1.0, routed: bool = False) -> None:
        read, held = projection_bytes(proj)
        out, inp = proj.shape
        entry = storage.setdefault(_storage_name(proj), {"count": 0, "params": 0, "bytes": 0})
        entry["count"] += 1
        entry["params"] += out * inp
        entry["bytes"] += read
        totals["params"] += out * inp * share
        totals["expert" if routed else "weight"] += read
        totals["held"] += held

    windows = []
    for layer in model.layers:
        mlp = getattr(layer, "mlp", None)
        routed = {id(p) for p in (mlp.gate_up + mlp.down)} if hasattr(mlp, "top_k") else set()
        if routed:
            experts, top_k = mlp.num_experts, mlp.top_k
        for proj in layer.projections():
            count(proj, top_k / experts if id(proj) in routed else 1.0, id(proj) in routed)
        window = getattr(layer, "window", None)
        windows.append(int(window) if window else None)
    count(model.lm_head)
    embed = model.embed
    attention = sum(4 * model.q_size * min(context_tokens, w or context_tokens) for w in windows)
    kv_bytes = sum(2 * model.kv_size * kv_item * min(context_tokens, w or context_tokens) for w in windows)
    bf16 = model.dtype == torch.bfloat16 and not getattr(model, "upcast", False)
    params = round(totals["params"])
    return Costs(
        dtype=str(model.dtype).removeprefix("torch."), compute="bf16" if bf16 else "fp32",
        context_tokens=context_tokens, params=params, weight_bytes=totals["weight"],
        expert_bytes=totals["expert"], experts=experts, top_k=top_k,
        embed_bytes=embed.shape[-1] * embed.element_size(), kv_bytes=kv_bytes,
        flops=2 * params + attention, attention_flops=attention, q_size=model.q_size, windows=windows,
        held_bytes=totals["held"], storage=storage)


def load_costs(path: str | None, context_tokens: int, tiny: bool = False, dtype: torch.dtype | None = None) -> Costs:
    """`model_costs` of the model at `path` (None: the embedded SmolLM2; `tiny`: the tiny random
    model) as a `ModelRunner` with its defaults holds it (the server's), the runner freed after."""
    from models.loading import load_model, tiny_model
    from models.runner import ModelRunner

    loaded = tiny_model() if tiny else load_model(path)
    runner = ModelRunner(loaded, dtype=dtype, kv_budget_bytes=1 << 20)
    costs = model_costs(runner, context_tokens)
    del runner, loaded
    gc.collect()
    return costs


# ---- a result beside its bounds ---------------------------------------------------------------

def bound_row(tok_s: float, costs: Costs, machine: Machine, batch: int = 1, prompt_tokens: int = 0,
              output_tokens: int = 1) -> dict:
    """`tok_s` decoded tokens/s at `batch` sequences per step beside its bounds: bandwidth /
    bytes per token and GEMM peak / FLOPs per token (each sequence's `prompt_tokens` of prefill
    spread over its `output_tokens`); `binds`: the lower one, `pct_of_bound`: tok_s as % of it."""
    bytes_per_token = costs.bytes_per_token(batch)
    flops_per_token = costs.flops + costs.prefill_flops(prompt_tokens) / max(1, output_tokens)
    peak = machine.gemm_peak.get(costs.compute, machine.gemm_peak["fp32"])
    bandwidth_bound = machine.bandwidth / bytes_per_token
    compute_bound = peak / flops_per_token
    bound = min(bandwidth_bound, compute_bound)
    return {
        "batch": batch, "bytes_per_token": round(bytes_per_token), "flops_per_token": round(flops_per_token),
        "bandwidth_bound_tok_s": round(bandwidth_bound, 1), "compute_bound_tok_s": round(compute_bound, 1),
        "binds": "bandwidth" if bandwidth_bound <= compute_bound else "compute",
        "pct_of_bound": round(100 * tok_s / bound, 1),
        "pct_of_bandwidth_bound": round(100 * tok_s / bandwidth_bound, 1),
        "pct_of_compute_bound": round(100 * tok_s / compute_bound, 1),
    }


BOUND_HEAD = f" {'bw bound':>9} {'gemm bound':>10} {'binds':>5} {'% bound':>7}"


def bound_cells(row: dict) -> str:
    """The table cells of a `bound_row` under BOUND_HEAD."""
    binds = "bw" if row["binds"] == "bandwidth" else "gemm"
    return (f" {row['bandwidth_bound_tok_s']:>9.1f} {row['compute_bound_tok_s']:>10.1f} {binds:>5}"
            f" {row['pct_of_bound']:>6.1f}%")


def report(machine: Machine, costs: Costs) -> dict:
    """The figures a benchmark's JSON keeps under "roofline"."""
    return {"machine": asdict(machine), "costs": costs.to_json()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes and the tiny model, a second")
    parser.add_argument("--model", help="model path (default: the embedded SmolLM2)")
    parser.add_argument("--context", type=int, default=512, help="tokens of K/V read per decoded token")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: what the runner picks on this CPU")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    machine = measure_machine(args.smoke)
    dtype = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    costs = load_costs(args.model, args.context, tiny=args.smoke, dtype=dtype)
    print(machine.describe(), costs.describe(), sep="\n")
    print(f"{'batch':>5} {'bw bound':>9} {'gemm bound':>10}  tok/s")
    for batch in (1, 8, 64):
        row = bound_row(0.0, costs, machine, batch)
        print(f"{batch:>5} {row['bandwidth_bound_tok_s']:>9.1f} {row['compute_bound_tok_s']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report(machine, costs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

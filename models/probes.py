"""Start-up probes: which projection storage pays on this machine, and whether oneDNN's products
are batch-invariant here. Each is timed or checked once per process (lru_cache), on small
weights, in milliseconds; a choice is refused only when clearly worse (`SLOWER`), so a moment of a
busy host does not flip it, and each logs what it decided. The figures behind these choices are
in docs/cpu-performance.md.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

from . import cpu_kernels
from .projections import DENSE_ROWS, Linear

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def packing_pays(dtype: torch.dtype, device: torch.device, shape=(1536, 576), timed: bool = True) -> bool:
    """Whether prepacked weights (`Linear(packed=True)`) serve this machine: on CPU, in bf16 or
    fp32, when the oneDNN op exists, gives `F.linear`'s products at 1 to 200 rows (bf16: its bits,
    both being oneDNN's; fp32: within fp32 rounding, `F.linear` being MKL's sgemm), and is not
    slower over 1, 8 and 64 rows (timed on a weight of `shape`, a few ms; decided once per process).
    Not `timed`: wherever it works (the deterministic mode: a choice that a timing could flip
    between a scheduler and its restart would change a resumed stream's bits)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(shape, generator=generator).to(dtype)
        bias = torch.randn(shape[0], generator=generator).to(dtype)
        linear, biased = Linear(weight, packed=True), Linear(weight, bias, packed=True)
        for rows in (1, 7, 32, 64, 200):
            x = torch.randn(rows, shape[1], generator=generator).to(dtype)
            for ours, theirs in ((linear(x), F.linear(x, weight)), (biased(x), F.linear(x, weight, bias))):
                if not _same_product(ours, theirs):
                    return False
        if not timed:
            return True
        packed, plain = _summed_seconds(linear, lambda x: F.linear(x, weight), shape[1], dtype, generator)
        log.info("oneDNN's prepacked %s weights %s: %.0f us vs %.0f us for F.linear over 1, 8 and 64 rows", dtype,
                 "serve" if packed <= SLOWER * plain else "not used, clearly slower", packed * 1e6, plain * 1e6)
        return packed <= SLOWER * plain
    except RuntimeError:  # a torch built without the op, or a CPU it refuses
        return False


@functools.cache
def cpu_has_fp16() -> bool:
    """Whether this CPU multiplies fp16 natively (AVX512_FP16 or AMX-FP16); elsewhere torch emulates it."""
    return bool({"avx512_fp16", "amx_fp16"} & set(cpu_kernels._cpu_flags().split()))


@functools.lru_cache(maxsize=None)
def kernel_pays(dtype: torch.dtype, device: torch.device, shape=(1536, 576), timed: bool = True) -> bool:
    """Whether tercet's own projection kernel for `dtype` (`Linear(kernel=True)`: fp32 panels,
    cpu_kernels.packed_linear, AVX-512 or AVX2 + FMA; bf16 panels, cpu_kernels.bf16_linear,
    AVX512_BF16) serves this machine: it is built, gives `F.linear`'s products within rounding
    (fp32: of fp32; bf16: of one bf16 rounding of the fp32 product) at 1 to 200 rows, and over 1,
    8 and 64 rows is not clearly slower (`SLOWER`) than what serves otherwise (oneDNN's prepacked
    weights where they pay, else `F.linear`). It is batch-invariant by construction. Not `timed`:
    wherever it builds and gives those products (the deterministic mode: see `packing_pays`)."""
    if device.type != "cpu":
        return False
    built = {torch.float32: cpu_kernels.packed_linear_available, torch.bfloat16: cpu_kernels.bf16_linear_available}
    if dtype not in built or not built[dtype]():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator).to(dtype)
    bias = torch.randn(shape[0], generator=generator).to(dtype)
    ours, other = Linear(weight, kernel=True), Linear(weight, packed=packing_pays(dtype, device, timed=timed))
    for rows in (1, 7, 32, 64, 200):
        x = torch.randn(rows, shape[1], generator=generator).to(dtype)
        if not (_close_product(ours(x), x, weight, None) and _close_product(Linear(weight, bias, kernel=True)(x),
                                                                              x, weight, bias)):
            log.warning("tercet's %s projection kernel gives other products than F.linear here: not used", dtype)
            return False
    if not timed:
        log.info("tercet's %s projection kernel serves (the deterministic mode: wherever it builds)", dtype)
        return True
    mine, theirs = _summed_seconds(ours, other, shape[1], dtype, generator)
    # the kernel serves unless clearly slower: a moment of a busy host must not drop it
    serves = mine <= SLOWER * theirs
    log.info("tercet's %s projection kernel %s: %.0f us vs %.0f us for %s over 1, 8 and 64 rows", dtype,
             "serves" if serves else "not used, clearly slower", mine * 1e6, theirs * 1e6,
             "oneDNN's prepacked weights" if other.packed is not None else "F.linear")
    return serves


# Row counts at which `bf16_code_rows` compares the codes with the panels, in order
CODE_ROWS = (1, 2, 4, 8, 16, 32)


# How much slower than the panels the codes may be and still serve: a tie goes to the codes (a quarter of
# the panels' bytes, and the panels are dropped where the codes serve every product). On an AMX Xeon the
# two were within 4-10 % at 4-32 rows, where noise turned the choice from one start to the next.
CODES_MARGIN = 0.1


def bf16_code_rows(linears) -> int | None:
    """Up to how many rows bf16 block codes serve (`Bf16BlockCodeLinear` with its panels beside):
    the last of CODE_ROWS before the first where a pass over `linears` (the model's own projections:
    their real bytes, as a decode step reads them) from the codes is slower than from the panels
    by more than CODES_MARGIN;
    None where the codes are never slower (they serve every product). Codes and panels give the
    same bits, so noise here moves only the speed. Timed at load, best of 2 passes."""
    generator = torch.Generator().manual_seed(0)
    widths = sorted({lin.shape[1] for lin in linears})
    served = 0
    for rows in CODE_ROWS:
        xs = {k: torch.randn(rows, k, generator=generator).to(torch.bfloat16) for k in widths}
        codes, panels = _best_seconds(
            lambda: [cpu_kernels.bf16_block_linear(xs[lin.shape[1]], *lin.codes, lin.out_features) for lin in linears],
            lambda: [cpu_kernels.bf16_linear(xs[lin.shape[1]], lin.panels, lin.out_features) for lin in linears],
            rounds=2)
        log.info("bf16 block codes at %d rows: %.2f ms vs %.2f ms for the panels, over %d projections", rows,
                 codes * 1e3, panels * 1e3, len(linears))
        if codes > panels * (1 + CODES_MARGIN):
            return served
        served = rows
    return None


def _close_product(ours: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """fp32: `_same_product` with F.linear; bf16: within one bf16 rounding of the fp32 product."""
    if ours.dtype == torch.float32:
        return _same_product(ours, F.linear(x, weight, bias))
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return bool((ours.float() - exact).abs().max() <= 2 ** -7 * exact.abs().max().clamp_min(1.0))


# Rows at which `onednn_invariant` compares products: oneDNN and MKL pick kernels by the number
# of rows (1, a few, register-block multiples, past DENSE_ROWS), so each of those regimes; and the
# rows of each product compared with the same rows multiplied two at a time (first, inner, last)
INVARIANCE_ROWS = (2, 3, 5, 8, 17, 33, 64, 129, 256)
SAMPLED_ROWS = (0, 1, 2, 4, 7, 16, 32, 63, 128, 255, 514)  # 514: past DENSE_ROWS


@functools.lru_cache(maxsize=None)
def onednn_invariant(dtype: torch.dtype, device: torch.device, dense: bool, shape=(1536, 576)) -> bool:
    """Whether oneDNN's prepacked products of a weight of `shape` (`Linear(packed=True)`; with
    `dense`, also `F.linear` on the plain weight from DENSE_ROWS rows on) give every row the bits
    it gets in a two-row product, at 2 to ~500 rows -- checked on this machine, per shape, once per
    process (a few ms for SmolLM2's shapes), since which kernel oneDNN runs depends on the CPU and
    the shape (AMX machines switch kernels past 32 rows).

    One-row products are left out: oneDNN multiplies a single row by another kernel that may round
    differently, so invariant callers pad them to two rows (`Projection.min_rows`)."""
    if not packing_pays(dtype, device, timed=False):
        return False
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(shape, generator=generator).to(dtype)
    linear = Linear(weight, torch.randn(shape[0], generator=generator).to(dtype), packed=True, keep_dense=dense)
    counts = (*INVARIANCE_ROWS, DENSE_ROWS + 3) if dense else INVARIANCE_ROWS
    x = torch.randn(max(counts), shape[1], generator=generator).to(dtype)
    # each sampled row multiplied beside row 0 (a row's bits do not depend on its partner's when invariant)
    alone = {r: linear(x[[0, r] if r else [0, 1]])[1 if r else 0] for r in SAMPLED_ROWS if r < len(x)}
    for rows in counts:
        product = linear(x[:rows])
        if not all(torch.equal(product[r], want) for r, want in alone.items() if r < rows):
            log.info("oneDNN's %s products of a %s weight at %d rows differ from two-row ones%s", dtype,
                     tuple(shape), rows, f" (F.linear past {DENSE_ROWS} rows)" if dense and rows >= DENSE_ROWS else "")
            return False
    return True


def _summed_seconds(first, second, width: int, dtype, generator) -> tuple[float, float]:
    """The best times of two projections at 1, 8 and 64 rows, each summed over the row counts:
    one 0.1 ms product alone is at the mercy of a busy host."""
    total = [0.0, 0.0]
    for rows in (1, 8, 64):
        x = torch.randn(rows, width, generator=generator).to(dtype)
        times = _best_seconds(lambda: first(x), lambda: second(x))
        total = [total[0] + times[0], total[1] + times[1]]
    return total[0], total[1]


def _same_product(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """bf16: the same bits; fp32: the same up to summation order (1e-5 of the largest |value|:
    at K = 576 the two kernels differ by ~1e-6 of it here)."""
    if ours.dtype != torch.float32:
        return torch.equal(ours, theirs)
    return bool((ours - theirs).abs().max() <= 1e-5 * theirs.abs().max().clamp_min(1.0))


@functools.lru_cache(maxsize=None)
def dense_pays(dtype: torch.dtype, device: torch.device, shape: tuple[int, int]) -> bool:
    """Whether, for a prepacked weight of `shape`, keeping the plain one too pays: `F.linear`
    on it at DENSE_ROWS rows beats the 128-row layout by SLOWER (timed once per shape and
    process, ~50 ms)."""
    if not packing_pays(dtype, device, timed=False):
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator).to(dtype)
    x = torch.randn(DENSE_ROWS, shape[1], generator=generator).to(dtype)
    linear = Linear(weight, packed=True)
    packed, plain = _best_seconds(lambda: linear(x), lambda: F.linear(x, weight), rounds=5)
    return packed > SLOWER * plain


# Packed must be this much slower to be refused: where it pays it is 1.2-1.4x faster (AMX), and a
# busy machine's noise (another process taking a core for a moment) must not flip the choice.
SLOWER = 1.15


def _best_seconds(*calls, rounds: int = 9) -> list[float]:
    """The best time of each call, the calls taking turns (noise hits them alike)."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best

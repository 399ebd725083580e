"""A compact Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM).

It reads transformers' state dict and config and runs a flattened ragged
batch: rows are tokens of many sequences, attention goes through the paged
KV cache (`attention.attend`). q/k/v and gate/up projections are fused
into one matmul each. Only inference: call under `torch.inference_mode()`.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

from . import cpu_kernels, invariant
from .attention import AttentionPlan, attend
from .errors import ModelLoadError

log = logging.getLogger(__name__)

class _Weights:
    def __init__(self, state_dict: dict[str, torch.Tensor], dtype, device) -> None:
        self._sd, self._dtype, self._device = state_dict, dtype, device

    def get(self, name: str, required: bool = True) -> torch.Tensor | None:
        tensor = self._sd.get(name)
        if tensor is None:
            if required:
                raise ModelLoadError(f"weight {name!r} missing from the checkpoint")
            return None
        return tensor.to(device=self._device, dtype=self._dtype).contiguous()

    def cat(self, names: list[str], required: bool = True) -> torch.Tensor | None:
        parts = [self.get(name, required) for name in names]
        return None if any(p is None for p in parts) else torch.cat(parts).contiguous()


PACK_ROWS = 128  # the batch size oneDNN lays prepacked weights out for (see Linear)


class Linear:
    """One projection: y = x W^T (+ b), W [out, in].

    On a CPU with bf16 units, `F.linear` in bf16 reorders W into oneDNN's blocked
    layout on every call, which is half its time at decode sizes (measured here,
    W 3072 x 576: 114 us vs 54 us prepacked at 1 row, 217 vs 121 at 64). With
    `packed`, W is reordered once, at load, for `PACK_ROWS`-row products, and the
    plain W is not kept (`dense()` rebuilds it). Up to a few hundred rows the
    bf16 products are bitwise those of `F.linear` (`packing_pays` checks 1-200 rows
    on the machine at start-up); past ~500 rows oneDNN may pick other kernels for
    the two and they round differently. In fp32 `F.linear` is MKL's sgemm, which on
    an AVX2-only AMD EPYC ran at half oneDNN's speed from 8 rows up (W 3072 x 576:
    0.50 vs 0.26 ms at 8 rows, 1.92 vs 1.51 at 64; a SmolLM2 decode step 112 -> 53 ms
    at batch 8, 261 -> 204 at 64): there the packed products equal `F.linear`'s up
    to summation order, and `packing_pays` times them the same way. At 512-2048 rows (serving's prefill chunks, 2048
    by default) which is faster depends on the shape and the day: the AMX machine once
    measured SmolLM2's projections even, later o_proj and down_proj 1.6-1.9x slower
    packed at 512 rows; an AVX512-BF16 machine without AMX measured F.linear faster
    past ~1000 rows. Hence `keep_dense`, chosen per shape by timing (`dense_pays`).

    With `upcast`, a bf16 product computed as fp32 sgemm on exact upcasts: the
    same numbers as a bf16 GEMM (bf16 inputs, fp32 accumulation, bf16 out), but
    on a CPU without bf16 units 3.5x faster from 8 rows up (measured at
    64 x 576 x 3072: 7.4 ms vs 25.8 ms); below 8 rows bf16 is faster. With
    `tile` (the deterministic mode), fixed-shape GEMMs of `tile` rows.

    With `kernel` and `codes`, a W that is exactly GGUF block codes (each row's blocks of 32
    weights float(q) * d + m: a Q4_1 or Q8_0 checkpoint, dequantized at load) is kept as int8
    codes with per-block d and m, 1.25 bytes a weight instead of 4, and the kernel rebuilds the
    fp32 weights as it goes: the products are bitwise those of the fp32 panels (tested), while a
    decode step, which reads every weight once, reads a third of the bytes (the embedded SmolLM2
    at batch 1: 32.8 -> 50.4 tok/s on the AVX2 EPYC; about even with the fp32 panels from 2 rows
    up, bench_gemm). Any other W keeps the fp32 panels.

    With `packed` and `keep_dense`, the plain W is kept too and products of
    `DENSE_ROWS` rows or more (prefill chunks) go through `F.linear` on it: for some
    shapes the 128-row layout is up to 2x slower there (`dense_pays` times it).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False,
                 keep_dense: bool = False, kernel: bool = False, codes: bool = False) -> None:
        self.bias = bias
        self.out_features = weight.shape[0]
        self.shape = tuple(weight.shape)  # [out, in]
        self.panels = None  # tercet's own fp32 kernel's layout (`kernel`), see cpu_kernels.packed_linear
        self.codes = None  # the same kernel's block codes (`codes`), see cpu_kernels.block_linear
        if kernel:
            self.weight, self.packed = None, None
            found = cpu_kernels.pack_block_codes(weight) if codes else []  # [] where W is not exactly codes
            self.codes = found or None
            self.panels = None if self.codes else cpu_kernels.pack_linear_weight(weight)
        elif packed:
            self.weight = weight if keep_dense else None
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
        else:
            self.weight, self.packed = weight, None
        # batch invariance where the path is not invariant by itself (CausalLM(invariant=True)):
        # fixed tiles of `tile` rows, or products of at least `min_rows` rows (oneDNN's one-row
        # kernel rounds otherwise; from two rows on its rows are checked invariant, `onednn_invariant`)
        self.tile: int | None = None
        self.min_rows = 1

    def dense(self) -> torch.Tensor:
        panels = self.panels
        if self.codes is not None:  # w = float(q) * d + m per block of 32 k, as the kernel rebuilds it
            codes, scales, offsets = self.codes
            panels = (codes.float().unflatten(1, (scales.shape[1], -1)) * scales[:, :, None]
                      + offsets[:, :, None]).flatten(1, 2)
        if panels is not None:  # [P, K, 16] -> [P * 16, K], less the padding
            return panels.transpose(1, 2).reshape(-1, panels.shape[1])[: self.out_features].contiguous()
        return self.weight if self.weight is not None else self.packed.to_dense()

    def product(self, x: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        """x W^T without the bias; fp32 when `upcast`."""
        if upcast:
            return F.linear(x.float(), self.dense().float())
        if self.codes is not None:
            return cpu_kernels.block_linear(x, *self.codes, self.out_features)
        if self.panels is not None:
            return cpu_kernels.packed_linear(x, self.panels, self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)

    @property
    def invariant_by_itself(self) -> bool:
        """Whether every row's product has the same bits whatever the number of rows: tercet's kernel
        (one running sum per output over k in order)."""
        return self.panels is not None or self.codes is not None

    def __call__(self, x: torch.Tensor, upcast: bool = False, tile: int | None = None) -> torch.Tensor:
        tile = self.tile if tile is None else tile
        if tile is not None and not self.invariant_by_itself:
            return invariant.tiled_linear(x, self.product, self.bias, tile, upcast and tile >= 8)
        if x.shape[0] < self.min_rows and x.shape[0] > 0:  # padded with zero rows, dropped after
            return self(torch.cat([x, x.new_zeros(self.min_rows - x.shape[0], x.shape[1])]), upcast)[: x.shape[0]]
        if upcast and x.shape[0] >= 8:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.dense().float(), bias).to(x.dtype)
        if self.codes is not None:
            return cpu_kernels.block_linear(x, *self.codes, self.out_features, self.bias)
        if self.panels is not None:
            return cpu_kernels.packed_linear(x, self.panels, self.out_features, self.bias)
        if self.packed is not None and (self.weight is None or x.shape[0] < DENSE_ROWS):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@functools.lru_cache(maxsize=None)
def packing_pays(dtype: torch.dtype, device: torch.device, shape=(1536, 576)) -> bool:
    """Whether prepacked weights (`Linear(packed=True)`) serve this machine: on CPU, in bf16 or
    fp32, when the oneDNN op exists, gives `F.linear`'s products at 1 to 200 rows (bf16: its bits,
    both being oneDNN's; fp32: within fp32 rounding, `F.linear` being MKL's sgemm), and is not
    slower over 1, 8 and 64 rows (timed on a weight of `shape`, a few ms; decided once per process)."""
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
        packed, plain = _summed_seconds(linear, lambda x: F.linear(x, weight), shape[1], dtype, generator)
        log.info("oneDNN's prepacked %s weights %s: %.0f us vs %.0f us for F.linear over 1, 8 and 64 rows", dtype,
                 "serve" if packed <= SLOWER * plain else "not used, clearly slower", packed * 1e6, plain * 1e6)
        return packed <= SLOWER * plain
    except RuntimeError:  # a torch built without the op, or a CPU it refuses
        return False


@functools.lru_cache(maxsize=None)
def kernel_pays(dtype: torch.dtype, device: torch.device, shape=(1536, 576)) -> bool:
    """Whether tercet's own fp32 projection kernel (`Linear(kernel=True)`, cpu_kernels.packed_linear,
    AVX2 + FMA) serves this machine: it is built, gives `F.linear`'s products within fp32
    rounding at 1 to 200 rows, and is faster over 1, 8 and 64 rows than what serves otherwise
    (oneDNN's prepacked weights where they pay, else `F.linear`). On the AVX2-only EPYC it ran
    1.0-2.1x oneDNN's speed at 1-64 rows, 1.05-1.25x at 2048 (benchmarks/bench_gemm.py)."""
    if device.type != "cpu" or dtype != torch.float32 or not cpu_kernels.packed_linear_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=generator)
    bias = torch.randn(shape[0], generator=generator)
    ours, other = Linear(weight, kernel=True), Linear(weight, packed=packing_pays(dtype, device))
    for rows in (1, 7, 32, 64, 200):
        x = torch.randn(rows, shape[1], generator=generator)
        if not (_same_product(ours(x), F.linear(x, weight))
                and _same_product(Linear(weight, bias, kernel=True)(x), F.linear(x, weight, bias))):
            return False
    mine, theirs = _summed_seconds(ours, other, shape[1], dtype, generator)
    # the kernel serves unless clearly slower: a moment of a busy host must not drop it
    serves = mine <= SLOWER * theirs
    log.info("tercet's fp32 projection kernel %s: %.0f us vs %.0f us for %s over 1, 8 and 64 rows",
             "serves" if serves else "not used, clearly slower", mine * 1e6, theirs * 1e6,
             "oneDNN's prepacked weights" if other.packed is not None else "F.linear")
    return serves


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

    One-row products are left out: oneDNN multiplies a single row by another kernel that rounds
    differently (measured on an AVX512-BF16 EPYC, K = 1536: 3 of 40 rows in bf16, all in fp32), so
    invariant callers pad them to two rows (`Linear.min_rows`). On that EPYC bf16 holds with
    `dense`; fp32 holds only without it (MKL's sgemm from 512 rows rounds otherwise)."""
    if not packing_pays(dtype, device):
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


DENSE_ROWS = 512  # from here on a product may go through the plain weight (Linear's keep_dense)
# at most this much memory for those plain copies, per model: SmolLM2-135M's o/down projections
# take 73 MB (a 512-token prefill 1,362 -> 1,638 tok/s, 2048: 1,545 -> 1,622 on the AMX machine);
# a 7B model's would take 3.4 GB, so its first layers get them and the rest stay packed only
DENSE_BUDGET_BYTES = 512 << 20


@functools.lru_cache(maxsize=None)
def dense_pays(dtype: torch.dtype, device: torch.device, shape: tuple[int, int]) -> bool:
    """Whether, for a prepacked weight of `shape`, keeping the plain one too pays: `F.linear`
    on it at DENSE_ROWS rows beats the 128-row layout by SLOWER (timed once per shape and
    process, ~50 ms; measured on the AMX machine at 512 rows: o_proj 0.52 vs 0.86 ms, down_proj
    1.40 vs 2.71, qkv and gate_up even)."""
    if not packing_pays(dtype, device):
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


def _rms_norm(x, weight, eps):
    # as transformers: normalise in float32, scale in the model dtype. F.rms_norm's one fp32 kernel
    # gives the bits of transformers' x * rsqrt(mean(x^2) + eps) (tests/models/test_layers.py) in 1 op, not 5
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Layer:
    def __init__(self, w: _Weights, prefix: str, model: "CausalLM") -> None:
        a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
        self.model = model
        self.input_norm = w.get(f"{prefix}.input_layernorm.weight")
        self.post_norm = w.get(f"{prefix}.post_attention_layernorm.weight")
        pack = model.packed

        def linear(weight, bias=None):
            size = weight.numel() * weight.element_size()
            keep = pack and size <= model.dense_budget and dense_pays(weight.dtype, weight.device,
                                                                      tuple(weight.shape))
            keep = keep and (not model.invariant
                             or onednn_invariant(weight.dtype, weight.device, True, tuple(weight.shape)))
            model.dense_budget -= size if keep else 0
            return Linear(weight, bias, pack, keep_dense=keep, kernel=model.kernel, codes=model.codes)

        self.qkv = linear(w.cat([f"{a}.{p}_proj.weight" for p in "qkv"]),
                          w.cat([f"{a}.{p}_proj.bias" for p in "qkv"], required=False))
        self.o = linear(w.get(f"{a}.o_proj.weight"), w.get(f"{a}.o_proj.bias", required=False))
        self.q_norm = w.get(f"{a}.q_norm.weight", required=False)  # Qwen3
        self.k_norm = w.get(f"{a}.k_norm.weight", required=False)
        self.gate_up = linear(w.cat([f"{m}.gate_proj.weight", f"{m}.up_proj.weight"]))
        self.down = linear(w.get(f"{m}.down_proj.weight"))

    def __call__(self, x, cos, sin, plan, k_cache, v_cache):
        cfg, tile = self.model, plan.row_tile
        h = _rms_norm(x, self.input_norm, cfg.eps)
        qkv = self.qkv(h, cfg.upcast, tile).view(len(x), -1, cfg.head_dim)  # [T, heads + 2 kv_heads, d]
        qk, v = qkv[:, : cfg.num_heads + cfg.num_kv_heads], qkv[:, cfg.num_heads + cfg.num_kv_heads :]
        if self.q_norm is not None:
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            qk = torch.cat([_rms_norm(q, self.q_norm, cfg.eps), _rms_norm(k, self.k_norm, cfg.eps)], dim=1)
        qk = _rotate(qk, cos, sin)  # q and k heads at once: the same elementwise ops as one at a time
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        attn = attend(q, k, v, k_cache, v_cache, plan, cfg.scale)
        x = x + self.o(attn.reshape(len(x), cfg.q_size), cfg.upcast, tile)
        h = _rms_norm(x, self.post_norm, cfg.eps)
        gate, up = self.gate_up(h, cfg.upcast, tile).chunk(2, dim=-1)
        act = F.silu(gate) if tile is None and not cfg.invariant else invariant.silu(gate)
        return x + self.down(act * up, cfg.upcast, tile)


class CausalLM:
    """Weights and forward pass; the KV cache belongs to the caller (the runner)."""

    def __init__(self, config, state_dict, dtype=torch.bfloat16, device="cpu", upcast=False,
                 packed: bool | None = None, kernel: bool | None = None, codes: bool | None = None,
                 invariant: bool = False) -> None:
        """`invariant`: every projection gives a row the same bits whatever the number of rows
        (`_make_invariant`); the runner's deterministic mode, with attention from the C++ kernel."""
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = config.num_hidden_layers
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.dtype, self.device = dtype, torch.device(device)
        self.invariant = invariant
        self.invariant_paths: dict[str, int] = {}  # how many projections are invariant by which path
        self.upcast = upcast and dtype == torch.bfloat16  # see Linear
        # tercet's fp32 projection kernel (see Linear); None: where it pays on this machine
        self.kernel = kernel_pays(dtype, self.device) if kernel is None else kernel
        # else prepacked oneDNN weights (see Linear); None: where they pay on this machine
        self.packed = packing_pays(dtype, self.device) and not self.upcast if packed is None else packed
        self.packed = self.packed and not self.kernel
        # with the kernel, weights that are exactly block codes (a GGUF's Q4_1 / Q8_0, dequantized) are
        # kept so: the same products, a third of the bytes (Linear; batch 1 32.8 -> 50.4 tok/s here)
        self.codes = self.kernel and (codes is None or codes)
        self.dense_budget = DENSE_BUDGET_BYTES  # what plain copies beside packed weights may take (Linear)
        self.inv_freq, self.rope_scale = _rope_parameters(config)
        w = _Weights(state_dict, dtype, self.device)
        self.embed = w.get("model.embed_tokens.weight")
        self.layers = [_Layer(w, f"model.layers.{i}", self) for i in range(self.num_layers)]
        self.norm = w.get("model.norm.weight")
        head = w.get("lm_head.weight", required=False)
        self.lm_head = Linear(self.embed if head is None else head, None, self.packed,  # tied embeddings
                              kernel=self.kernel, codes=self.codes)
        self.inv_freq = self.inv_freq.to(self.device)
        if invariant:
            self._make_invariant()

    def _make_invariant(self) -> None:
        """tercet's kernel is invariant as it is; oneDNN's prepacked products are where this machine
        shows them so from two rows on (`onednn_invariant`: one-row products are padded to two);
        anything else multiplies in fixed tiles of rows (`invariant.tiled_linear`, ~2x slower)."""
        paths = {"tercet's kernel": 0, "oneDNN, one row padded to two": 0, "fixed row tiles": 0}
        for lin in self.projections():
            if lin.invariant_by_itself:
                paths["tercet's kernel"] += 1
            elif (lin.packed is not None and not self.upcast
                  and onednn_invariant(self.dtype, self.device, lin.weight is not None, lin.shape)):
                lin.min_rows = 2
                paths["oneDNN, one row padded to two"] += 1
            else:
                lin.tile = invariant.row_tile(self.dtype)
                paths["fixed row tiles"] += 1
        log.info("batch-invariant projections (%s): %s", self.dtype,
                 ", ".join(f"{n} by {path}" for path, n in paths.items() if n))
        self.invariant_paths = {path: n for path, n in paths.items() if n}

    def projections(self) -> list[Linear]:
        """Every layer's projections, then the LM head."""
        return [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def forward(self, input_ids, positions, plan: AttentionPlan, k_cache, v_cache):
        """Hidden states [T, hidden] after the final norm; K/V of every row stored."""
        x = F.embedding(input_ids, self.embed)
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos = (emb.cos() * self.rope_scale).to(self.dtype)
        sin = (emb.sin() * self.rope_scale).to(self.dtype)
        if plan.cpu_kernel and not self.upcast and self.layers[0].q_norm is None:
            return self._fused_forward(x, cos[:, 0], sin[:, 0], plan, k_cache, v_cache)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, plan, k_cache[i], v_cache[i])
        return _rms_norm(x, self.norm, self.eps)

    def _fused_forward(self, x, cos, sin, plan: AttentionPlan, k_cache, v_cache):
        """`forward` through tercet's fused CPU ops (cpu_kernels): rope + K/V store in one pass,
        each residual add with the norm after it, silu(gate) * up; the same roundings as the
        eager ops (tests/models/test_cpu_kernels.py)."""
        h = _rms_norm(x, self.layers[0].input_norm, self.eps)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(h)
            q, k = cpu_kernels.rope_store(qkv, cos, sin, k_cache[i], v_cache[i], plan.slots,
                                          self.num_heads, self.num_kv_heads)
            v = qkv.view(len(x), -1, self.head_dim)[:, self.num_heads + self.num_kv_heads :]
            attn = attend(q, k, v, k_cache[i], v_cache[i], plan, self.scale, stored=True)
            h = cpu_kernels.add_rms_norm_(x, layer.o(attn.reshape(len(x), self.q_size)), layer.post_norm, self.eps)
            down = layer.down(cpu_kernels.silu_mul(layer.gate_up(h)))
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h = cpu_kernels.add_rms_norm_(x, down, after, self.eps)
        return h

    def logits(self, hidden, row_tile: int | None = None) -> torch.Tensor:
        """fp32 logits of hidden rows; `row_tile` as in AttentionPlan (the deterministic mode)."""
        return self.lm_head(hidden, self.upcast, row_tile).float()


def _rope_parameters(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale, computed by transformers (llama3, yarn...)."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ModelLoadError(f"unsupported rope type {rope_type!r}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scale)

"""A compact Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM).

It reads transformers' state dict and config and runs a flattened ragged
batch: rows are tokens of many sequences, attention goes through the paged
KV cache (`attention.attend`). q/k/v and gate/up projections are fused
into one matmul each. Only inference: call under `torch.inference_mode()`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from . import cpu_kernels, invariant, probes
from .attention import AttentionPlan, attend
from .errors import ModelLoadError
from .projections import Linear

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


# at most this much memory for the plain copies beside prepacked weights (PackedLinear's keep_dense),
# per model: SmolLM2-135M's o/down projections take 73 MB; a 7B model's would take 3.4 GB, so its
# first layers get them and the rest stay packed only
DENSE_BUDGET_BYTES = 512 << 20


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
            keep = pack and size <= model.dense_budget and probes.dense_pays(weight.dtype, weight.device,
                                                                             tuple(weight.shape))
            keep = keep and (not model.invariant
                             or probes.onednn_invariant(weight.dtype, weight.device, True, tuple(weight.shape)))
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
        cfg = self.model
        h = _rms_norm(x, self.input_norm, cfg.eps)
        qkv = self.qkv(h, cfg.upcast).view(len(x), -1, cfg.head_dim)  # [T, heads + 2 kv_heads, d]
        qk, v = qkv[:, : cfg.num_heads + cfg.num_kv_heads], qkv[:, cfg.num_heads + cfg.num_kv_heads :]
        if self.q_norm is not None:
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            qk = torch.cat([_rms_norm(q, self.q_norm, cfg.eps), _rms_norm(k, self.k_norm, cfg.eps)], dim=1)
        qk = _rotate(qk, cos, sin)  # q and k heads at once: the same elementwise ops as one at a time
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        attn = attend(q, k, v, k_cache, v_cache, plan, cfg.scale)
        x = x + self.o(attn.reshape(len(x), cfg.q_size), cfg.upcast)
        h = _rms_norm(x, self.post_norm, cfg.eps)
        gate, up = self.gate_up(h, cfg.upcast).chunk(2, dim=-1)
        act = invariant.silu(gate) if cfg.invariant else F.silu(gate)  # F.silu's tail rounds apart
        return x + self.down(act * up, cfg.upcast)


class CausalLM:
    """Weights and forward pass; the KV cache belongs to the caller (the runner)."""

    def __init__(self, config, state_dict, dtype=torch.bfloat16, device="cpu", upcast=False,
                 packed: bool | None = None, kernel: bool | None = None, codes: bool | None = None,
                 invariant: bool = False, fused: bool = False) -> None:
        """`invariant`: every projection gives a row the same bits whatever the number of rows
        (`_make_invariant`), the runner's deterministic mode; `fused`: the layers' elementwise steps
        through tercet's fused C++ ops (`_fused_forward`)."""
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = config.num_hidden_layers
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.dtype, self.device = dtype, torch.device(device)
        self.invariant, self.fused = invariant, fused
        self.invariant_paths: dict[str, int] = {}  # how many projections are invariant by which path
        self.upcast = upcast and dtype == torch.bfloat16  # see Linear
        # tercet's projection kernel (fp32 or bf16, projections.py); None: where it pays on this machine
        # (in the deterministic mode chosen by what the CPU has, never by a timing that could flip
        # between a scheduler and its restart: the restart must give a resumed stream the same bits)
        timed = not invariant
        self.kernel = (probes.kernel_pays(dtype, self.device, timed=timed) and not self.upcast
                       if kernel is None else kernel)
        # else prepacked oneDNN weights (see Linear); None: where they pay on this machine
        self.packed = (probes.packing_pays(dtype, self.device, timed=timed) and not self.upcast
                       if packed is None else packed)
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
        shows them so from two rows on (`probes.onednn_invariant`: one-row products padded to two);
        anything else multiplies in fixed tiles of rows (`invariant.tiled_linear`, ~2x slower)."""
        paths = {"tercet's kernel": 0, "oneDNN, one row padded to two": 0, "fixed row tiles": 0}
        for lin in self.projections():
            if lin.invariant_by_itself:
                paths["tercet's kernel"] += 1
            elif (lin.packed is not None and not self.upcast
                  and probes.onednn_invariant(self.dtype, self.device, lin.weight is not None, lin.shape)):
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
        if self.fused and not self.upcast and self.layers[0].q_norm is None:
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

    def logits(self, hidden) -> torch.Tensor:
        """fp32 logits of hidden rows."""
        return self.lm_head(hidden, self.upcast).float()


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

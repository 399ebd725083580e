"""One decoder for every dense family (Llama, Mistral, Qwen2/3, SmolLM2/3, Gemma 2/3, Phi-3, Granite, OLMo 2).

It reads transformers' state dict and config and runs a flattened ragged
batch: rows are tokens of many sequences, attention goes through the paged
KV cache (`attention.attend`). q/k/v and gate/up projections are fused
into one matmul each. What a family changes (norms, scalings, windows,
soft-caps, rotary per layer, weight names, its MLP) is declared in
`families.py` and read here once, at load. Only inference: call under
`torch.inference_mode()`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from . import cpu_kernels, families, invariant, probes
from .attention import AttentionPlan, KernelAttention, attend
from .errors import ModelLoadError
from .projections import Bf16BlockCodeLinear, Int8BlockCodeLinear, Linear, UpcastPanelLinear, int8_block_codes
from .rotary import RotaryTable
from .split_attention import tanh_cap

log = logging.getLogger(__name__)


class _Weights:
    def __init__(self, state_dict: dict[str, torch.Tensor], dtype, device) -> None:
        self._sd, self._dtype, self._device = state_dict, dtype, device

    def get(self, name: str, required: bool = True, stored: bool = False) -> torch.Tensor | None:
        """The weight in the model dtype; `stored`: in fp32 where the checkpoint holds it so (a
        projection's weight, whose block codes `Linear` finds before rounding it to the model dtype)."""
        tensor = self._sd.get(name)
        if tensor is None:
            if required:
                raise ModelLoadError(f"weight {name!r} missing from the checkpoint")
            return None
        dtype = torch.float32 if stored and tensor.dtype == torch.float32 else self._dtype
        return tensor.to(device=self._device, dtype=dtype).contiguous()

    def cat(self, names: list[str], required: bool = True, stored: bool = False) -> torch.Tensor | None:
        parts = [self.get(name, required, stored) for name in names]
        return None if any(p is None for p in parts) else torch.cat(parts).contiguous()


# at most this much memory for second copies of weights, per model: the plain W beside prepacked
# weights (PackedLinear's keep_dense: SmolLM2-135M's o/down projections take 73 MB; a 7B model's would
# take 3.4 GB, so its first layers get them and the rest stay packed only) and the bf16 panels beside
# block codes (Bf16BlockCodeLinear: SmolLM2-135M's all take 270 MB; past the budget, codes alone)
DENSE_BUDGET_BYTES = 512 << 20


def _rms_norm(x, weight, eps):
    # as transformers: normalise in float32, scale in the model dtype. F.rms_norm's one fp32 kernel
    # gives the bits of transformers' x * rsqrt(mean(x^2) + eps) (tests/models/test_layers.py) in 1 op, not 5
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class _Norm:
    """An RMSNorm as the family applies its weight (families.Family.norm): "llama" scales in the
    model dtype (`_rms_norm`), "fp32" and "gemma" in fp32 by w and by 1 + w."""

    def __init__(self, weight: torch.Tensor, kind: str, eps: float) -> None:
        self.kind, self.eps = kind, eps
        self.weight = weight if kind == "llama" else weight.float() + (1.0 if kind == "gemma" else 0.0)

    def __call__(self, x):
        if self.kind == "llama":
            return _rms_norm(x, self.weight, self.eps)
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight).to(x.dtype)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotate_partial(x, cos, sin):
    """Rotary over the first cos.shape[-1] dims of each head, the rest as they are (partial_rotary_factor)."""
    if cos.shape[-1] == x.shape[-1]:
        return _rotate(x, cos, sin)
    rot = cos.shape[-1]
    return torch.cat((_rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


def _gelu_tanh(x) -> torch.Tensor:
    """gelu_pytorch_tanh as x * sigmoid(2 y), y = sqrt(2/pi) (x + 0.044715 x^3): the same function
    (0.5 (1 + tanh y) = sigmoid(2 y)) from `exp` and exactly rounded arithmetic, so an element's bits
    do not depend on where it sits (F.gelu and torch.tanh round their scalar tails apart)."""
    x32 = x.float()
    y = (x32 + 0.044715 * x32 * x32 * x32) * (2.0 * math.sqrt(2.0 / math.pi))
    return (x32 / (1.0 + torch.exp(-y))).to(x.dtype)


def _act_mul(name: str, invariant_mode: bool, fused: bool = False):
    """act(gate) * up over [n, 2I] = [gate | up] (families' `act`). In the deterministic mode with
    tercet's kernels (`fused`), silu's through their `silu_mul`, an exp of their own row by row: torch's
    exp runs through MKL's VML, whose first threaded call in a process can round a chunk apart (rotary.py)."""
    if name != "gelu_pytorch_tanh" and invariant_mode and fused:
        return cpu_kernels.silu_mul
    if name == "gelu_pytorch_tanh":
        act = _gelu_tanh
    else:
        act = invariant.silu if invariant_mode else F.silu  # F.silu's tail rounds apart

    def act_mul(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return act(gate) * up
    return act_mul


class _DenseMLP:
    """down(act(gate) * up), gate and up in one product."""

    def __init__(self, gate_up, down, act_mul) -> None:
        self.gate_up, self.down, self.act_mul = gate_up, down, act_mul

    def projections(self) -> list:
        return [self.gate_up, self.down]

    def __call__(self, h, upcast: bool = False):
        return self.down(self.act_mul(self.gate_up(h, upcast)), upcast)


# the norm slots of a layer by the family's layout: (before attention, after it, before the MLP, after it)
_LAYOUTS = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}


class _Layer:
    def __init__(self, w: _Weights, prefix: str, model: "CausalLM", index: int) -> None:
        a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
        family, config = model.family, model.config
        self.model = model
        kind = family.norm

        def norm(name):
            return None if name is None else _Norm(w.get(f"{prefix}.{name}.weight"), kind, model.eps)

        self.attn_pre, self.attn_post, self.mlp_pre, self.mlp_post = map(norm, _LAYOUTS[family.layout])
        # Llama's two norms by the names the fused path reads
        self.input_norm = self.attn_pre.weight if self.attn_pre is not None else None
        self.post_norm = self.mlp_pre.weight if self.mlp_pre is not None else None
        pack = model.packed

        def linear(weight, bias=None):
            if (lin := model.int8_code_linear(weight, bias)) is not None:
                return lin
            if model.upcast_panels:
                return UpcastPanelLinear(weight, bias, model.dtype)
            if model.codes and model.dtype == torch.bfloat16:
                return model.bf16_code_linear(weight, bias)
            size = weight.numel() * weight.element_size()
            keep = pack and size <= model.dense_budget and probes.dense_pays(weight.dtype, weight.device,
                                                                             tuple(weight.shape))
            keep = keep and (not model.invariant
                             or probes.onednn_invariant(weight.dtype, weight.device, True, tuple(weight.shape)))
            model.dense_budget -= size if keep else 0
            return Linear(weight, bias, pack, keep_dense=keep, kernel=model.kernel, codes=model.codes,
                          dtype=model.dtype)

        stored = model.codes or model.int8_activations  # the weights as stored: Linear looks for block codes in them
        self.qkv = linear(w.cat([f"{a}.{p}_proj.weight" for p in "qkv"], stored=stored),
                          w.cat([f"{a}.{p}_proj.bias" for p in "qkv"], required=False))
        self.o = linear(w.get(f"{a}.o_proj.weight", stored=stored), w.get(f"{a}.o_proj.bias", required=False))
        self.qk_norm = family.qk_norm
        self.q_norm = self.k_norm = None
        if family.qk_norm is not None:
            self.q_norm, self.k_norm = (_Norm(w.get(f"{a}.{p}_norm.weight"), kind, model.eps) for p in "qk")
        self.rope = family.rope(config, index)  # a key of the model's rotary tables, None: no rotary
        self.window = family.window(config, index)
        self.softcap = family.attention_softcap(config) if family.attention_softcap else None
        self.residual_scale = family.residual_scale(config) if family.residual_scale else None
        act = _act_mul(families.activation_of(config), model.invariant, model.fused)
        mlp = family.mlp(w.get, m, config, index, linear, act) if family.mlp is not None else None
        if mlp is None:
            mlp = _DenseMLP(linear(w.cat([f"{m}.gate_proj.weight", f"{m}.up_proj.weight"], stored=stored)),
                            linear(w.get(f"{m}.down_proj.weight", stored=stored)), act)
        self.mlp = mlp

    @property
    def gate_up(self):  # the dense MLP's (the fused path's)
        return self.mlp.gate_up

    @property
    def down(self):
        return self.mlp.down

    def projections(self) -> list:
        return [self.qkv, self.o, *self.mlp.projections()]

    def __call__(self, x, ropes, plan, k_cache, v_cache):
        cfg = self.model
        h = x if self.attn_pre is None else self.attn_pre(x)
        qkv = self.qkv(h, cfg.upcast)
        if self.qk_norm == "all":  # OLMo 2: the whole projected q and k
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        qkv = qkv.view(len(x), -1, cfg.head_dim)  # [T, heads + 2 kv_heads, d]
        qk, v = qkv[:, : cfg.num_heads + cfg.num_kv_heads], qkv[:, cfg.num_heads + cfg.num_kv_heads :]
        if self.qk_norm == "head":
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if self.rope is not None:
            cos, sin = ropes[self.rope]
            qk = _rotate_partial(qk, cos, sin)  # q and k heads at once: the same elementwise ops as one at a time
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        attn = attend(q, k, v, k_cache, v_cache, plan, cfg.scale, window=self.window, softcap=self.softcap)
        x = x + self._block_out(self.o(attn.reshape(len(x), cfg.q_size), cfg.upcast), self.attn_post)
        h = x if self.mlp_pre is None else self.mlp_pre(x)
        return x + self._block_out(self.mlp(h, cfg.upcast), self.mlp_post)

    def _block_out(self, out, post_norm):
        if post_norm is not None:
            out = post_norm(out)
        return out if self.residual_scale is None else out * self.residual_scale


class CausalLM:
    """Weights and forward pass; the KV cache belongs to the caller (the runner)."""

    def __init__(self, config, state_dict, dtype=torch.bfloat16, device="cpu", upcast=False,
                 packed: bool | None = None, kernel: bool | None = None, codes: bool | None = None,
                 invariant: bool = False, fused: bool = False, int8_activations: bool = False) -> None:
        """`invariant`: every projection gives a row the same bits whatever the number of rows
        (`_make_invariant`), the runner's deterministic mode; `fused`: the layers' elementwise steps
        through tercet's fused C++ ops (`_fused_forward`); `int8_activations`: projections whose weights are
        Q4_1 or Q8_0 block codes multiply int8 activations (`Int8BlockCodeLinear`: not the exact path's outputs)."""
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = config.num_hidden_layers
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.config = config
        self.family = family = families.family_of(config)
        self.scale = family.attention_scale(config) if family.attention_scale else self.head_dim**-0.5
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
        # bf16 on a CPU without bf16 units (fp16 without fp16 units: torch emulates those products too):
        # tercet's fp32 kernel over the weights' exact upcasts (projections.UpcastPanelLinear), where it
        # builds and gives F.linear's products; unless a caller chose the projections' path
        half = dtype == torch.float16 and self.device.type == "cpu" and not probes.cpu_has_fp16()
        self.upcast_panels = ((self.upcast or half) and kernel is None and packed is None
                              and probes.kernel_pays(torch.float32, self.device, timed=False))
        if self.upcast or half:
            name, units = ("bf16", "AVX512_BF16 or AMX") if self.upcast else ("fp16", "AVX512_FP16 or AMX-FP16")
            log.warning("%s on a CPU without %s units (no %s): each product runs in fp32 on the %s weights%s; "
                        "float32 (the default on this CPU) is as fast or faster, and more precise", name, name, units,
                        name, ", through tercet's fp32 kernel" if self.upcast_panels else "")
        # with the kernel, weights that are exactly block codes (a GGUF's Q4_1 / Q8_0, dequantized) are
        # kept so: the same products, a third of the bytes (Linear; batch 1 32.8 -> 50.4 tok/s here)
        self.codes = self.kernel and (codes is None or codes)
        # the opt-in int8 mode: its projections are GGUF block codes times int8 activations (csrc/gemm_i8.cpp);
        # the weights are read as stored to find their codes; those that are not such codes keep the path above
        self.int8_activations = int8_activations
        self.int8_projections = 0  # how many serve so
        self.dense_budget = DENSE_BUDGET_BYTES  # what second copies of weights may take (Linear)
        if family.weights is not None:
            state_dict = family.weights(state_dict, config)
        w = _Weights(state_dict, dtype, self.device)
        self.embed = w.get("model.embed_tokens.weight")
        self.embed_scale = family.embed_scale(config) if family.embed_scale else None
        self.layers = [_Layer(w, f"model.layers.{i}", self, i) for i in range(self.num_layers)]
        # the rotary tables the layers name: inverse frequencies and cos/sin scale, and their rows per position
        self.ropes = {key: _rope_parameters(config, key) for key in {layer.rope for layer in self.layers} - {None}}
        self.rotary = {key: RotaryTable(inv_freq, scale, dtype, self.device)
                       for key, (inv_freq, scale) in self.ropes.items()}
        self.final_norm = _Norm(w.get("model.norm.weight"), family.norm, self.eps)
        self.norm = self.final_norm.weight
        self.logit_softcap = family.logit_softcap(config) if family.logit_softcap else None
        self.logit_divisor = family.logit_divisor(config) if family.logit_divisor else None
        # Llama's layers exactly, with silu: what tercet's fused CPU ops implement
        self.llama_layers = (family.llama_layer and families.activation_of(config) == "silu"
                             and all(inv.shape[0] * 2 == self.head_dim for inv, _ in self.ropes.values())
                             and all(layer.rope == "default" for layer in self.layers))
        self.windowed = [i for i, layer in enumerate(self.layers) if layer.window or layer.softcap]
        self._fallback_logged = False  # (`_log_fallback`)
        stored = self.codes or int8_activations
        head = w.get("lm_head.weight", required=False, stored=stored)
        if head is None and stored:  # tied embeddings: the head's codes in the stored embedding
            head = w.get("model.embed_tokens.weight", stored=True)
        head = self.embed if head is None else head  # (tied embeddings)
        self.lm_head = self.int8_code_linear(head)
        if self.lm_head is None:
            self.lm_head = (UpcastPanelLinear(head, None, dtype) if self.upcast_panels
                            else self.bf16_code_linear(head) if self.codes and dtype == torch.bfloat16
                            else Linear(head, None, self.packed, kernel=self.kernel, codes=self.codes, dtype=dtype))
        self._share_code_rows()
        if invariant:
            self._make_invariant()
        self.decoder = self._make_decoder()

    def int8_code_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8BlockCodeLinear | None:
        """W as block codes times int8 activations where the int8 mode is on and W is exactly codes that
        `Int8BlockCodeLinear` takes; else None (the caller's path serves)."""
        if not self.int8_activations:
            return None
        found = int8_block_codes(weight)
        if not found:
            return None
        self.int8_projections += 1
        return Int8BlockCodeLinear(found, weight.shape[0], None if bias is None else bias.to(self.dtype))

    def bf16_code_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        """A bf16 projection of W as stored: block codes where W is exactly such codes, their bf16
        panels kept beside them while `dense_budget` lasts (products of many rows: `_share_code_rows`),
        else bf16 panels."""
        keep = weight.numel() * 2 <= self.dense_budget
        lin = Linear(weight, bias, keep_dense=keep, kernel=True, codes=True, dtype=self.dtype)
        if isinstance(lin, Bf16BlockCodeLinear) and lin.panels is not None:
            self.dense_budget -= lin.panels.numel() * lin.panels.element_size()
        return lin

    def _share_code_rows(self) -> None:
        """bf16 block codes with their panels beside them: the codes serve products of up to the
        rows where they are not slower on this machine (`probes.bf16_code_rows`, timed on these
        projections), the panels more; codes never slower: the panels are dropped. The same bits
        either way, so the timing may choose (in the deterministic mode too)."""
        coded = [lin for lin in self.projections() if isinstance(lin, Bf16BlockCodeLinear) and lin.panels is not None]
        if not coded:
            return
        rows = probes.bf16_code_rows(coded)
        for lin in coded:
            lin.serve_codes_up_to(rows)
        log.info("bf16 block codes serve %s (%d projections)", "every product" if rows is None else
                 f"products of up to {rows} rows, their bf16 panels more", len(coded))

    def _make_invariant(self) -> None:
        """tercet's kernel is invariant as it is; oneDNN's prepacked products are where this machine
        shows them so from two rows on (`probes.onednn_invariant`: one-row products padded to two);
        anything else multiplies in fixed tiles of rows (`invariant.tiled_linear`, ~2x slower)."""
        paths = {"tercet's int8 kernel": 0, "tercet's kernel": 0, "oneDNN, one row padded to two": 0,
                 "fixed row tiles": 0}
        for lin in self.projections():
            if isinstance(lin, Int8BlockCodeLinear):
                paths["tercet's int8 kernel"] += 1
            elif lin.invariant_by_itself:
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

    def _make_decoder(self):
        """The layers as one C++ call (`cpu_kernels.decoder`) where `_fused_forward` serves and every
        projection is one the decoder holds (`decoder_form`); None: the Python loop serves."""
        if not (self.fused and not self.upcast and self.llama_layers and cpu_kernels.load()):
            return None
        forms = [lin.decoder_form() for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(form is None for form in forms) or any(lin.min_rows != 1 for lin in self.projections()):
            return None
        decoder = cpu_kernels.decoder(self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale)
        for i, layer in enumerate(self.layers):
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            decoder.add_layer(layer.post_norm, after, layer.window or 0)
            for lin, (kind, tensors, code_rows) in zip((layer.qkv, layer.o, layer.gate_up, layer.down), forms[4 * i:]):
                decoder.add_projection(kind, lin.out_features, code_rows, tensors, lin.bias)
        return decoder

    def projections(self) -> list[Linear]:
        """Every layer's projections, then the LM head."""
        return [lin for layer in self.layers for lin in layer.projections()] + [self.lm_head]

    def forward(self, input_ids, positions, plan: AttentionPlan, k_cache, v_cache):
        """Hidden states [T, hidden] after the final norm; K/V of every row stored."""
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:  # in the model dtype, as transformers
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        # rows of tables computed once per position, never by torch's threaded cos/sin (rotary.py)
        ropes = {key: table.at(positions) for key, table in self.rotary.items()}
        if self.windowed and not plan.windows:
            self._log_fallback(plan)
        if self.fused and not self.upcast and self.llama_layers:
            cos, sin = ropes["default"]
            if self.decoder is not None and isinstance(plan.backend, KernelAttention):
                b = plan.backend  # the layers in one C++ call: the bits of `_fused_forward`
                h = _rms_norm(x, self.layers[0].input_norm, self.eps)
                return cpu_kernels.decoder_forward(self.decoder, x, h, cos[:, 0], sin[:, 0], k_cache, v_cache,
                                                   plan.slots, b.page_table, b.row_seq, b.row_lens, b.page_size)
            return self._fused_forward(x, cos[:, 0], sin[:, 0], plan, k_cache, v_cache)
        for i, layer in enumerate(self.layers):
            x = layer(x, ropes, plan, k_cache[i], v_cache[i])
        return self.final_norm(x)

    def _log_fallback(self, plan: AttentionPlan) -> None:
        if not self._fallback_logged:
            self._fallback_logged = True
            log.info("layers %s (a sliding window or an attention soft-cap) attend through the torch split-KV "
                     "path: the %s backend has neither", self.windowed, type(plan.backend).__name__)

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
            attn = attend(q, k, v, k_cache[i], v_cache[i], plan, self.scale, stored=True, window=layer.window)
            h = cpu_kernels.add_rms_norm_(x, layer.o(attn.reshape(len(x), self.q_size)), layer.post_norm, self.eps)
            down = layer.down(cpu_kernels.silu_mul(layer.gate_up(h)))
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h = cpu_kernels.add_rms_norm_(x, down, after, self.eps)
        return h

    def logits(self, hidden, fp32: bool = True) -> torch.Tensor:
        """fp32 logits of hidden rows (the family's final divisor and soft-cap applied in fp32); not `fp32`:
        in the head's own dtype where the family has neither (the same values: fp32 holds every bf16 and
        fp16 exactly; the runner's sampling reads them so, without a pass that widens every logit)."""
        logits = self.lm_head(hidden, self.upcast)
        if not fp32 and self.logit_divisor is None and self.logit_softcap is None:
            return logits
        logits = logits.float()
        if self.logit_divisor is not None:
            logits = logits / self.logit_divisor
        if self.logit_softcap is not None:
            logits = tanh_cap(logits, self.logit_softcap)
        return logits


def _rope_parameters(config, key: str = "default") -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale of the rotary table `key` ("default": the config's one,
    else a layer type's, `rope_parameters[key]`), computed by transformers (llama3, yarn...)."""
    params = getattr(config, "rope_parameters", None) or {}
    layer_type = None if key == "default" else key
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        dim = int(head_dim * factor)
        exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
        return 1.0 / (theta**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ModelLoadError(f"unsupported rope type {rope_type!r}")
    extra = {} if layer_type is None else {"layer_type": layer_type}
    # (longrope: its short factors, as transformers up to original_max_position_embeddings: families.context_limit)
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **extra)
    return inv_freq.float(), float(scale)

"""What each model family changes in the one decoder (`layers.py`), declared, one record per model_type.

The decoder is Llama's: embeddings, then per layer x + attn(norm(x)) and x + mlp(norm(x)), a final
norm and an LM head. A `Family` names what a model_type does differently, and nothing else:

- `norm`: how an RMSNorm applies its weight: "llama" (w * norm(x), rounded to the model dtype first),
  "fp32" (norm(x) * w in fp32, OLMo 2), "gemma" (norm(x) * (1 + w) in fp32);
- `layout`: where the norms sit: "pre" (Llama), "sandwich" (Gemma: a norm before and after both
  attention and MLP), "post" (OLMo 2: after each, none before);
- `qk_norm`: None, "head" (each q/k head normed, Qwen3, Gemma 3) or "all" (the whole projected q and k,
  OLMo 2);
- scalars read from the config (None: no change): `embed_scale` (the embeddings times it),
  `residual_scale` (each block's output times it before its residual add), `attention_scale`
  (replaces 1/sqrt(head_dim)), `attention_softcap` and `logit_softcap` (cap * tanh(x / cap) on the
  attention scores, the final logits), `logit_divisor` (the logits divided by it);
- per layer: `rope(config, layer)` names the rotary table the layer uses (None: no rotary, SmolLM3's
  NoPE layers; Gemma 3's local layers have their own), `window(config, layer)` its sliding window
  (None: every key);
- `weights(state_dict, config)`: the checkpoint's names mapped to the decoder's (Phi-3's fused
  projections split);
- `mlp`: a layer's MLP when it is not the dense gated one (the MoE families): a factory
  `mlp(get, prefix, config, layer, linear, act)` returning an object with `__call__(h, upcast)` and
  `projections()`, or None for the layers that stay dense. `get(name)` is a weight in the model
  dtype, `prefix` is `model.layers.{layer}.mlp`, `linear(W)` a projection, `act(gate_up)` is
  act(gate) * up over [n, 2I] = [gate | up].

The activation is the config's (`hidden_activation` or `hidden_act`: silu or gelu_pytorch_tanh).
`check(config)` refuses, naming the field, what the decoder does not implement. A LongRoPE table
(Phi-3's "su" scaling) is served with its short factors up to `original_max_position_embeddings`
(`context_limit`): past that length transformers switches the whole sequence to its long factors,
which keys already in a paged cache cannot follow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from . import moe
from .errors import ModelLoadError

Scalar = Callable[[object], "float | None"]  # config -> a scalar, None where the family leaves it alone
PerLayer = Callable[[object, int], "str | int | None"]  # (config, layer index) -> a layer's setting
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def attr(name: str) -> Scalar:
    """The config's field `name` (None where it has none)."""
    return lambda config: getattr(config, name, None)


def sqrt_hidden(config) -> float:
    return math.sqrt(config.hidden_size)


def query_pre_attn(config) -> float:
    return config.query_pre_attn_scalar**-0.5


def default_rope(config, layer: int) -> str | None:
    """Every layer the config's one rotary table."""
    return "default"


def rope_by_layer_type(config, layer: int) -> str | None:
    """Gemma 3: a table per layer type (`rope_parameters[layer_type]`: the local layers' theta is
    `rope_local_base_freq`)."""
    return config.layer_types[layer]


def rope_unless_nope(config, layer: int) -> str | None:
    """SmolLM3: no rotary on the layers `no_rope_layers` marks 0 (from `no_rope_layer_interval`)."""
    return "default" if config.no_rope_layers[layer] else None


def sliding_window(config, layer: int) -> int | None:
    """The layer's window: `sliding_window` on the layers `layer_types` calls sliding, or on every
    layer where the config has no layer types (Mistral, Phi-3); None where it cannot bind (no
    window, or one at least the model's position limit)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None or (types is not None and types[layer] != "sliding_attention"):
        return None
    limit = getattr(config, "max_position_embeddings", None)
    return None if limit is not None and window >= limit else int(window)


def split_phi3(state_dict: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Phi-3's `qkv_proj` and `gate_up_proj` as Llama's q/k/v and gate/up projections."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith(".self_attn.qkv_proj.weight"):
            stem = name[: -len("qkv_proj.weight")]
            for part, piece in zip("qkv", tensor.split([q, kv, kv])):
                out[f"{stem}{part}_proj.weight"] = piece
        elif name.endswith(".mlp.gate_up_proj.weight"):
            stem = name[: -len("gate_up_proj.weight")]
            out[f"{stem}gate_proj.weight"], out[f"{stem}up_proj.weight"] = tensor.chunk(2)
        else:
            out[name] = tensor
    return out


@dataclass(frozen=True)
class Family:
    """One model_type's differences from Llama's decoder (the module docstring)."""

    norm: str = "llama"
    layout: str = "pre"
    qk_norm: str | None = None
    embed_scale: Scalar | None = None
    residual_scale: Scalar | None = None
    attention_scale: Scalar | None = None
    attention_softcap: Scalar | None = None
    logit_softcap: Scalar | None = None
    logit_divisor: Scalar | None = None
    rope: PerLayer = default_rope
    window: PerLayer = sliding_window
    weights: Callable[[dict, object], dict] | None = None
    mlp: Callable | None = None

    @property
    def llama_layer(self) -> bool:
        """Whether its layers are Llama's exactly (the weights may be named otherwise): what
        tercet's fused CPU ops implement (`CausalLM._fused_forward`)."""
        return replace(self, weights=None, window=sliding_window) == LLAMA


LLAMA = Family()
GEMMA2 = Family(norm="gemma", layout="sandwich", embed_scale=sqrt_hidden, attention_scale=query_pre_attn,
                attention_softcap=attr("attn_logit_softcapping"), logit_softcap=attr("final_logit_softcapping"))

FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": Family(qk_norm="head"),
    "gemma2": GEMMA2,
    "gemma3_text": replace(GEMMA2, qk_norm="head", rope=rope_by_layer_type),
    "phi3": Family(weights=split_phi3),
    "granite": Family(embed_scale=attr("embedding_multiplier"), residual_scale=attr("residual_multiplier"),
                      attention_scale=attr("attention_multiplier"), logit_divisor=attr("logits_scaling")),
    "olmo2": Family(norm="fp32", layout="post", qk_norm="all"),
    "smollm3": Family(rope=rope_unless_nope),
    # the MoE families (moe.py; checkpoints' per-expert weights fused by loading.py)
    "qwen3_moe": Family(qk_norm="head", mlp=moe.qwen3_moe_mlp),
    "mixtral": Family(mlp=moe.mixtral_mlp),
}


def family_of(config) -> Family:
    """The declared family of `config` (`check` it first for a clear error); a config without a
    model_type is Llama's."""
    return FAMILIES[getattr(config, "model_type", "llama")]


def activation_of(config) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"


def check(config, label) -> None:
    """ModelLoadError naming the field where `config` asks for what the decoder does not do."""
    if config.model_type not in FAMILIES:
        raise ModelLoadError(f"{label}: unsupported architecture {config.model_type!r} "
                             f"(supported: {', '.join(sorted(FAMILIES))})")
    act = activation_of(config)
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"{label}: hidden_act {act!r} is not supported (one of {', '.join(ACTIVATIONS)})")
    for table in _rope_tables(config):
        if table.get("rope_type") == "dynamic":
            raise ModelLoadError(f"{label}: rope_parameters.rope_type 'dynamic' is not supported "
                                 "(its frequencies change with the sequence's length)")


def _rope_tables(config) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or {}
    tables = params.values() if family_of(config).rope is rope_by_layer_type else [params]
    return [table or {} for table in tables]


def context_limit(config) -> int | None:
    """The longest sequence the model serves as transformers computes it: `max_position_embeddings`,
    or a LongRoPE table's `original_max_position_embeddings` (its short factors) where smaller."""
    limit = getattr(config, "max_position_embeddings", None)
    for table in _rope_tables(config):
        if table.get("rope_type") == "longrope":
            original = table.get("original_max_position_embeddings") or limit
            limit = original if limit is None else min(limit, original)
    return limit

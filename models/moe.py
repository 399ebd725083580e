"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral) that keeps rows batch-invariant.

Routing as transformers does it (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`): the router's logits
in the model dtype, a softmax over all experts in fp32, the top k of it, renormalised over the k
(`normalize`: Mixtral always, Qwen3-MoE with `norm_topk_prob`); Qwen3-MoE rounds the weights to
the model dtype, Mixtral keeps them fp32.

Each expert runs once per step over every row routed to it: the rows gathered (one fresh tensor
per expert), one gate/up product, silu(gate) * up, one down product, the results put back by
(row, rank). Two things keep a row's bits independent of the rest of the batch (the runner's
deterministic mode):

- every product is a `projections.Projection`, made invariant by the model like its dense ones
  (tercet's kernel by itself, oneDNN from two rows on, else fixed tiles: `CausalLM`'s
  `_make_invariant` over `projections()`), so an expert gives a row the same bits whether one row
  or a hundred went to it;
- a row's k expert outputs are summed in fp32 in the order of its top k (rank 0 first), never in
  an order that depends on which experts the other rows chose; the sum is rounded to the model
  dtype once.

Checkpoints keep experts one module each (`experts.{e}.gate_proj`, Mixtral's `w1/w3/w2` under
`block_sparse_moe`); transformers holds them fused, `experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I]. `fuse_experts` turns the first into the second, the names this
module reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .errors import ModelLoadError

if TYPE_CHECKING:  # (projections imports loading through cpu_kernels; loading imports this module)
    from .projections import Projection

Activation = Callable[[torch.Tensor], torch.Tensor]  # [n, 2I] = [gate | up] -> [n, I]


class SparseMoE:
    """One layer's experts: `moe(h, upcast)` -> [T, H] for hidden rows h [T, H]."""

    def __init__(self, router: Projection, gate_up: list[Projection], down: list[Projection], top_k: int,
                 normalize: bool, round_weights: bool, act: Activation) -> None:
        """`router` W [E, H]; per expert `gate_up` W [2I, H] (gate rows first) and `down` W [H, I];
        `normalize`: the k weights over their sum; `round_weights`: the weights in the model
        dtype (Qwen3-MoE) rather than fp32 (Mixtral); `act` silu(gate) * up."""
        if len(gate_up) != router.out_features or len(down) != len(gate_up):
            raise ValueError(f"{router.out_features} router outputs for {len(gate_up)} and {len(down)} experts")
        self.router, self.gate_up, self.down = router, gate_up, down
        self.top_k, self.normalize, self.round_weights, self.act = top_k, normalize, round_weights, act

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def projections(self) -> list[Projection]:
        """The router, then every expert's gate/up and down."""
        return [self.router, *self.gate_up, *self.down]

    def route(self, h: torch.Tensor, upcast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts [T, k] (best first) and their weights [T, k] (fp32)."""
        logits = self.router(h, upcast)
        probs = torch.softmax(logits.float(), dim=-1)  # row by row: a row's bits are its own
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / _sum_columns(weights)[:, None]
        if self.round_weights:
            weights = weights.to(logits.dtype).float()
        return experts, weights

    def __call__(self, h: torch.Tensor, upcast: bool = False) -> torch.Tensor:
        experts, weights = self.route(h, upcast)
        k = self.top_k
        flat = experts.flatten()  # entry i: row i // k, rank i % k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = h.new_empty(len(flat), h.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count:
                entries = order[start : start + count]
                rows = h.index_select(0, entries // k)
                out[entries] = self.down[expert](self.act(self.gate_up[expert](rows, upcast)), upcast)
                start += count
        out = out.view(len(h), k, h.shape[1])
        total = out[:, 0].float() * weights[:, :1]
        for rank in range(1, k):  # in the row's own order, whatever the batch
            total = total + out[:, rank].float() * weights[:, rank : rank + 1]
        return total.to(h.dtype)


def _sum_columns(x: torch.Tensor) -> torch.Tensor:
    """x[:, 0] + x[:, 1] + ... left to right: one order for every row."""
    total = x[:, 0]
    for column in range(1, x.shape[1]):
        total = total + x[:, column]
    return total


def num_experts(config) -> int:
    """Experts per MoE layer (Qwen3-MoE's `num_experts` is an alias of `num_local_experts`)."""
    return getattr(config, "num_local_experts", None) or config.num_experts


def is_sparse(config, layer: int) -> bool:
    """Whether `layer` has experts: Qwen3-MoE's dense layers are `mlp_only_layers` and those
    off its `decoder_sparse_step`; Mixtral's are all sparse."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer not in (getattr(config, "mlp_only_layers", None) or ())
            and num_experts(config) > 0 and (layer + 1) % step == 0)


def sparse_moe(get: Callable[[str], torch.Tensor], prefix: str, config, linear: Callable[[torch.Tensor], Projection],
               act: Activation, normalize: bool, round_weights: bool) -> SparseMoE:
    """The experts of the MLP at `prefix` (`model.layers.{i}.mlp`) from transformers' fused names;
    `get(name)` a weight in the model dtype, `linear(W)` its projection."""
    gate_up, down = get(f"{prefix}.experts.gate_up_proj"), get(f"{prefix}.experts.down_proj")
    return SparseMoE(linear(get(f"{prefix}.gate.weight")), [linear(w.contiguous()) for w in gate_up.unbind()],
                     [linear(w.contiguous()) for w in down.unbind()], config.num_experts_per_tok, normalize,
                     round_weights, act)


def qwen3_moe_mlp(get, prefix: str, config, layer: int, linear, act) -> SparseMoE | None:
    """Qwen3-MoE's MLP of `layer` (families.py's `mlp` hook): experts where `is_sparse`, weights
    renormalised over the top k with `norm_topk_prob` and rounded to the model dtype; None: dense."""
    if not is_sparse(config, layer):
        return None
    return sparse_moe(get, prefix, config, linear, act, normalize=config.norm_topk_prob, round_weights=True)


def mixtral_mlp(get, prefix: str, config, layer: int, linear, act) -> SparseMoE:
    """Mixtral's MLP (every layer): the top k's weights renormalised, kept in fp32."""
    return sparse_moe(get, prefix, config, linear, act, normalize=True, round_weights=False)


# one expert's weight as checkpoints keep it: Qwen3-MoE's names, and Mixtral's under block_sparse_moe
_EXPERT = re.compile(r"^(?P<layer>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                     r"(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def fuse_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` with per-expert weights fused as transformers holds them in memory
    (`{layer}.mlp.experts.gate_up_proj` [E, 2I, H], `.down_proj` [E, H, I]) and Mixtral's
    `block_sparse_moe` called `mlp`; a state dict without such weights comes back as it is."""
    found: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        match = _EXPERT.match(name)
        if match is None:
            fused[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        parts = found.setdefault(match["layer"], {"gate": {}, "up": {}, "down": {}})
        parts[_PART[match["part"]]][int(match["e"])] = tensor
    for layer, parts in found.items():
        count = len(parts["down"])
        if any(sorted(part) != list(range(count)) for part in parts.values()):
            raise ModelLoadError(f"{layer}: experts' gate, up and down weights do not match one for one")
        fused[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate"][e], parts["up"][e]]) for e in range(count)])
        fused[f"{layer}.mlp.experts.down_proj"] = torch.stack([parts["down"][e] for e in range(count)])
    return fused

"""Batch-invariant attention: split-KV over absolute positions (the torch path).

A query at position p attends keys 0..p in splits of `split` keys at fixed
absolute positions [j*split, (j+1)*split). Every split has the same shape
(keys past p are masked, never dropped), and the splits are folded in the
order j = 0, 1, 2, ... (online softmax). So what a query gets depends only on its own
sequence's K/V and position, not on whether it is a decode row or a row of
a prefill chunk, how long that chunk is, what else is in the step, or
whether its prefix was computed now or taken from the cache (K/V are
always read back from the cache, after the step's own are stored).

Why each piece is invariant on CPU (measured with torch 2.13, see the
tests): the two products are batched GEMMs of one fixed shape, split x
head_dim x COL_TILE and head_dim x split x COL_TILE: a group's query columns
are padded to whole tiles of COL_TILE and every tile is one item of the
batch. A column's result then depends only on its own query and keys:
the items are independent, and within a tile MKL gives every column
position the same bits. (Letting N be the number of query columns held on
a Xeon, but on an AMD EPYC, with the same torch and MKL, a column's scores
changed with N: 2, 3, 4 and 8 columns agreed, 6, 12 and 16+ did not.)
Softmax statistics reduce over one contiguous split row; `exp`
is vectorised without a scalar tail; max, masking and the fold's
multiply-adds are exact per element. A split wholly masked for a query
(a decode row shorter than its group's longest) leaves it exactly as it was.

A `SplitGroup` is a set of sequences with the same number of new tokens:
all decode rows form one group, each prefill chunk another. batch.py
builds the groups once per step (`split_group`, into attention.SplitAttention);
every layer shares them. This is the deterministic mode's attention where
tercet's C++ kernel cannot be built (the kernel does the same per query).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kv_cache import pages_for

DEFAULT_SPLIT = 64  # keys per split; the triton kernel's BLOCK_N
COL_TILE = 8  # query columns per GEMM item (the module docstring)


@dataclass
class SplitGroup:
    """Sequences with `num_queries` new tokens each, their rows consecutive in the step."""

    start: int  # first row of the group in the flattened step
    num_seqs: int  # B
    num_queries: int  # n new tokens per sequence (1 for decode rows)
    kv_rows: torch.Tensor  # [B, J * split] cache row of each key position (masked ones: row 0)
    valid: torch.Tensor  # [B, J, n, split] bool: key position <= query position
    max_cached: int  # the largest num_cached: queries below j * split - max_cached see no split j
    query_pos: torch.Tensor | None = None  # [B, n] each query's absolute position (sliding windows)

    @property
    def end(self) -> int:
        return self.start + self.num_seqs * self.num_queries


def split_group(start: int, tables: Sequence[Sequence[int]], num_cached: Sequence[int],
                num_queries: int, page_size: int, split: int, device) -> SplitGroup:
    """The plan of sequences whose `num_queries` new tokens follow `num_cached[i]` cached ones."""
    lengths = torch.tensor([c + num_queries for c in num_cached])
    num_splits = -(-int(lengths.max()) // split)
    key_pos = torch.arange(num_splits * split)
    tables = [t[: pages_for(c + num_queries, page_size)] for t, c in zip(tables, num_cached)]
    widest = max(len(t) for t in tables)
    table = torch.tensor([[*t, *([0] * (widest - len(t)))] for t in tables], dtype=torch.long)
    page_index = (key_pos // page_size).clamp(max=widest - 1).expand(len(tables), -1)
    rows = table.gather(1, page_index) * page_size + key_pos % page_size
    rows = rows.masked_fill(key_pos[None, :] >= lengths[:, None], 0)
    query_pos = torch.tensor(num_cached)[:, None] + torch.arange(num_queries)  # [B, n]
    valid = key_pos.view(num_splits, 1, split)[None] <= query_pos[:, None, :, None]
    return SplitGroup(start, len(tables), num_queries, rows.to(device), valid.to(device), max(num_cached),
                      query_pos.to(device))


def split_kv_attention(q, k_cache, v_cache, group: SplitGroup, scale: float, window: int | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    """q [B * n, heads, d] (sequence-major) of one group -> [B * n, heads, d], in fp32 inside.

    Split by split, each query column folds in the splits it sees, in order
    (online softmax); a split no query of the group sees is skipped, one that
    only some see is wholly masked for the others, which leaves them exactly
    as they were. `window`: a query sees only its last `window` keys (the
    splits before them wholly masked for it, so it starts at its first split
    with a key as it would have at split 0); `softcap`: each score s becomes
    softcap * tanh(s / softcap) (`tanh_cap`) before the mask.
    """
    batch, n = group.num_seqs, group.num_queries
    num_splits, split = group.valid.shape[1], group.valid.shape[-1]
    valid = group.valid
    if window is not None:  # key position > query position - window
        key_pos = torch.arange(num_splits * split, device=q.device).view(num_splits, 1, split)
        valid = valid & (key_pos[None] > group.query_pos[:, None, :, None] - window)
    heads, d = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    g = heads // kv_heads
    cols = n * g
    # query columns (query, head in group) per kv head: [B, kv_heads, d, n * g]
    qt = (q.float() * scale).view(batch, n, kv_heads, g, d).permute(0, 2, 4, 1, 3).reshape(batch, kv_heads, d, cols)
    keys = k_cache.index_select(0, group.kv_rows.reshape(-1)).view(batch, num_splits, split, kv_heads, d)
    values = v_cache.index_select(0, group.kv_rows.reshape(-1)).view(batch, num_splits, split, kv_heads, d)
    best = torch.full((batch, kv_heads, cols), float("-inf"), device=q.device)
    total = torch.zeros(batch, kv_heads, cols, device=q.device)
    acc = torch.zeros(batch, kv_heads, d, cols, device=q.device)
    for j in range(num_splits):
        first = max(0, j * split - group.max_cached)  # queries before it see none of split j
        lo = first * g
        if window is not None and not bool(valid[:, j, first:].any()):
            continue  # behind every query's window
        part_max, part_sum, part_out = _split(
            qt[..., lo:], keys[:, j], values[:, j], valid[:, j, first:], kv_heads, g, softcap
        )
        new_best = torch.maximum(best[..., lo:], part_max)
        keep = (best[..., lo:] - new_best).exp()
        take = (part_max - new_best).exp()  # 0 where the split is wholly masked
        if window is not None:  # a query that has seen no key yet (-inf - -inf): nothing to keep or take
            keep = keep.masked_fill(best[..., lo:] == float("-inf"), 0.0)
            take = take.masked_fill(part_max == float("-inf"), 0.0)
        total[..., lo:] = total[..., lo:] * keep + take * part_sum
        acc[..., lo:] = acc[..., lo:] * keep[:, :, None, :] + take[:, :, None, :] * part_out
        best[..., lo:] = new_best
    out = (acc / total[:, :, None, :]).view(batch, kv_heads, d, n, g)
    return out.permute(0, 3, 1, 4, 2).reshape(batch * n, heads, d).to(q.dtype)


def tanh_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) with tanh as 2 / (1 + exp(-2 x / cap)) - 1: `exp` and exactly rounded
    arithmetic, so an element's bits do not depend on where it sits (torch.tanh rounds a scalar
    tail apart, as F.silu does: invariant.py); in fp32, in x's dtype."""
    x32 = x.float()
    return ((2.0 / (1.0 + torch.exp(x32 * (-2.0 / cap))) - 1.0) * cap).to(x.dtype)


def _split(qt, keys, values, valid, kv_heads: int, g: int, softcap: float | None = None):
    """One split for query columns qt [B, kv_heads, d, m] and keys/values [B, split, kv_heads, d]:
    per column its max score, sum of exp(score - max) and exp-weighted values [B, kv_heads, d, m]."""
    batch, _, d, m = qt.shape
    split = keys.shape[1]
    tiles = -(-m // COL_TILE)
    width = tiles * COL_TILE
    items = batch * kv_heads
    if width != m:  # padded with zero queries, every key valid for them (dropped at the end)
        qt = torch.cat([qt, qt.new_zeros(batch, kv_heads, d, width - m)], dim=-1)
    # [items * tiles, d, COL_TILE]: one GEMM item per tile of query columns
    q_tiles = qt.reshape(items, d, tiles, COL_TILE).permute(0, 2, 1, 3).reshape(items * tiles, d, COL_TILE)
    k = torch.empty(batch, kv_heads, tiles, split, d, device=qt.device).copy_(
        keys.permute(0, 2, 1, 3)[:, :, None].expand(batch, kv_heads, tiles, split, d))
    vt = torch.empty(batch, kv_heads, tiles, d, split, device=qt.device).copy_(
        values.permute(0, 2, 3, 1)[:, :, None].expand(batch, kv_heads, tiles, d, split))
    scores = torch.bmm(k.view(items * tiles, split, d), q_tiles)  # [items * tiles, split, COL_TILE]
    scores = scores.view(batch, kv_heads, tiles, split, COL_TILE).permute(0, 1, 2, 4, 3)
    # .contiguous(): with one tile the reshape is a transposed view, and MKL rounds a product
    # differently by its operands' memory layout: every call gets the same layouts
    scores = scores.reshape(batch, kv_heads, width, split).contiguous()
    if softcap is not None:
        scores = tanh_cap(scores, softcap)
    mask = valid[:, None, :, None, :].expand(batch, kv_heads, valid.shape[1], g, split)
    mask = mask.reshape(batch, kv_heads, m, split)
    if width != m:
        mask = torch.cat([mask, mask.new_ones(batch, kv_heads, width - m, split)], dim=-2)
    scores.masked_fill_(~mask, float("-inf"))
    part_max = scores.amax(dim=-1, keepdim=True)  # -inf where the split is wholly masked
    weights = (scores - part_max.masked_fill(part_max == float("-inf"), 0.0)).exp_()
    part_sum = weights.sum(dim=-1)
    w_tiles = weights.view(items * tiles, COL_TILE, split).transpose(1, 2).contiguous()  # [.., split, COL_TILE]
    part_out = torch.bmm(vt.view(items * tiles, d, split), w_tiles)  # [items * tiles, d, COL_TILE]
    part_out = part_out.view(batch, kv_heads, tiles, d, COL_TILE).permute(0, 1, 3, 2, 4)
    part_out = part_out.reshape(batch, kv_heads, d, width)
    return part_max[..., 0][..., :m], part_sum[..., :m], part_out[..., :m]

"""Attention over the paged KV cache: the step's plan, one class per backend, and the torch paths.

The runner lays a step out as [decode tokens..., prefill chunks...] and builds one
`AttentionPlan` per step, shared by every layer; its backend is chosen once per runner:

- `KernelAttention` (CPU, the deterministic mode): every row through tercet's C++ kernel;
- `KernelDecodeAttention` (CPU, mode off): decode rows through the C++ kernel, prefill chunks SDPA;
- `SplitAttention` (CPU without the C++ kernels, deterministic): split-KV torch code for every row;
- `TorchAttention` (CPU without the kernels, mode off): decode rows bucketed through SDPA;
- `TritonAttention` (CUDA): the triton paged kernel, or its split-KV kernel for every row.

Layers with a sliding window or an attention soft-cap (families.py) pass them to `attend`: the
C++ kernel takes both (`KernelAttention`); every other backend sends those layers through the
plan's `fallback`, the split-KV torch code (`SplitAttention`), batch-invariant too.

The torch functions here are also the references the C++ and triton kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_kernels
from .kv_cache import pages_for
from .split_attention import SplitGroup, split_kv_attention


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flattened step
    end: int
    context_slots: torch.Tensor | None  # [cached + new] cache rows; None when nothing is cached
    mask: torch.Tensor | None  # [1, 1, new, cached + new] bool, with context_slots


@dataclass
class DecodeBucket:
    """Decode rows of similar context length, padded only to the longest of them (torch path)."""

    rows: torch.Tensor  # [n] the bucket's rows in the step
    kv_rows: torch.Tensor  # [n * kv_heads * L] row of the cache viewed as [slots * kv_heads, d]
    mask: torch.Tensor | None  # [n, 1, 1, L] bool; None when all n rows attend L keys


@dataclass
class AttentionPlan:
    """A step's attention, shared by every layer: where each new token's K/V go, and the backend
    (one of the classes below, chosen by the runner once) with its own layout of the step."""

    slots: torch.Tensor  # [T] cache row of each new token
    backend: "TorchAttention | KernelDecodeAttention | KernelAttention | SplitAttention | TritonAttention"
    fallback: "SplitAttention | None" = None  # for windowed / soft-capped layers where the backend has neither

    @property
    def windows(self) -> bool:
        """Whether the backend itself takes a layer's sliding window and soft-cap."""
        return isinstance(self.backend, (KernelAttention, SplitAttention))

    @property
    def triton(self) -> bool:
        """Whether the backend runs triton kernels (its K/V store too)."""
        return isinstance(self.backend, TritonAttention)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k, v, slots) -> None:
    """Write new K/V rows [T, kv_heads, head_dim] of one layer into cache rows `slots`."""
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def decode_gather_plan(page_table, context_lens, page_size: int):
    """Cache rows [B, L] each decode row reads, and the [B, 1, 1, L] validity mask."""
    longest = int(context_lens.max())
    positions = torch.arange(longest, device=page_table.device)
    pages = page_table.long().gather(1, (positions // page_size).expand(len(page_table), -1))
    rows = pages * page_size + positions % page_size
    valid = positions[None, :] < context_lens[:, None]
    return rows.masked_fill(~valid, 0), valid[:, None, None, :]


# A bucket costs about as much as this many more padded (row, key) pairs (~0.1 us each here):
# its own gathers and SDPA call, smaller and less parallel. Measured with SmolLM2's shapes on
# 2 cores, 32 and 64 rows over 128-400 tokens: 1024-2048 (2-3 buckets) fastest; 256 (5
# buckets) no faster than one.
BUCKET_COST = 2048


def decode_buckets(page_table, context_lens, page_size: int, kv_heads: int) -> list[DecodeBucket]:
    """Decode rows grouped by context length, each group padded to its own longest.

    Padding every row to the step's longest context wastes a third of the
    attention work when contexts spread over 128-400 tokens; a group more
    pays when the padding it saves outweighs `BUCKET_COST`.
    """
    order = torch.argsort(context_lens, descending=True, stable=True)
    lens = context_lens[order].tolist()
    heads = torch.arange(kv_heads, device=page_table.device)[:, None]
    buckets = []
    for start, end in _split_by_length(lens, 0, len(lens)):
        rows = order[start:end]
        longest = lens[start]
        cache_rows, valid = decode_gather_plan(page_table[rows, : pages_for(longest, page_size)],
                                               context_lens[rows], page_size)
        # head-major (row, kv head, position) indices: one index_select gives [n, kv_heads, L, d]
        # contiguous, what SDPA reads fastest, for the cost of a row-major gather
        kv_rows = (cache_rows[:, None, :] * kv_heads + heads).reshape(-1)
        mask = None if lens[end - 1] == longest else valid
        buckets.append(DecodeBucket(rows, kv_rows, mask))
    return buckets


def _split_by_length(lens: list[int], start: int, end: int) -> list[tuple[int, int]]:
    """Split the rows [start, end) of descending `lens` where it saves the most padding, while that pays."""
    best, at = BUCKET_COST, None
    for i in range(start + 1, end):
        saved = (lens[start] - lens[i]) * (end - i)  # rows from i on pad to lens[i], not lens[start]
        if saved > best:
            best, at = saved, i
    if at is None:
        return [(start, end)]
    return _split_by_length(lens, start, at) + _split_by_length(lens, at, end)


def bucketed_decode_attention(q, k_cache, v_cache, buckets: list[DecodeBucket], scale, compute_dtype=None):
    """`paged_decode_attention` per bucket, with the GQA heads folded into the query length."""
    dtype = compute_dtype or q.dtype
    num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    keys_of, values_of = k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)
    out = torch.empty_like(q)
    for bucket in buckets:
        n = len(bucket.rows)
        shape = (n, num_kv_heads, -1, head_dim)
        keys = keys_of.index_select(0, bucket.kv_rows).view(shape)
        values = values_of.index_select(0, bucket.kv_rows).view(shape)
        # query head h reads kv head h // group, as enable_gqa does; one SDPA "query" per head of
        # the group reads the kv head once, not once per query head (with the head-major gather
        # 1.3x faster at 64 rows x 140 keys; little gain at 400 keys, where SDPA's per-key work rules)
        queries = q.index_select(0, bucket.rows).view(n, num_kv_heads, group, head_dim)
        part = F.scaled_dot_product_attention(
            queries.to(dtype), keys.to(dtype), values.to(dtype), attn_mask=bucket.mask, scale=scale,
        )
        out.index_copy_(0, bucket.rows, part.reshape(n, -1, head_dim).to(q.dtype))
    return out


def paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, page_size, scale):
    """Reference: q [B, heads, d] against each row's pages -> [B, heads, d]."""
    rows, valid = decode_gather_plan(page_table, context_lens, page_size)
    return gathered_decode_attention(q, k_cache, v_cache, rows, valid, scale)


def gathered_decode_attention(q, k_cache, v_cache, rows, valid, scale):
    """Every row padded to the longest context (the CPU path before `bucketed_decode_attention`)."""
    flat = rows.reshape(-1)  # index_select copies whole rows: far faster than k_cache[rows]
    keys = k_cache.index_select(0, flat).view(*rows.shape, *k_cache.shape[1:]).transpose(1, 2)
    values = v_cache.index_select(0, flat).view(*rows.shape, *v_cache.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=valid, scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]


def prefill_attention(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale, compute_dtype=None):
    """One chunk: q/k/v [n, heads, d] of its new tokens -> [n, heads, d]."""
    dtype, out_dtype = compute_dtype or q.dtype, q.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if chunk.context_slots is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True,
        )
    else:
        keys = k_cache.index_select(0, chunk.context_slots).transpose(0, 1)[None].to(dtype)
        values = v_cache.index_select(0, chunk.context_slots).transpose(0, 1)[None].to(dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, attn_mask=chunk.mask, scale=scale,
            enable_gqa=True,
        )
    return out[0].transpose(0, 1).to(out_dtype)


def attend(q, k, v, k_cache, v_cache, plan: AttentionPlan, scale, stored: bool = False,
           window: int | None = None, softcap: float | None = None):
    """Store this layer's new K/V (unless `stored`: done already), then attend every row;
    q/k/v are [T, heads, d]. `window`: each row attends only its last `window` keys;
    `softcap`: scores capped as softcap * tanh(s / softcap)."""
    if not stored and plan.triton:
        from . import triton_attention

        triton_attention.store_kv(k_cache, v_cache, k, v, plan.slots)
    elif not stored:
        store_kv(k_cache, v_cache, k, v, plan.slots)
    if window is None and softcap is None:
        return plan.backend.attend(q, k, v, k_cache, v_cache, scale)
    if plan.windows:
        return plan.backend.attend(q, k, v, k_cache, v_cache, scale, window=window, softcap=softcap)
    if plan.fallback is None:
        raise ValueError("a windowed or soft-capped layer needs a plan built with windowed=True (batch.build_batch)")
    return plan.fallback.attend(q, k, v, k_cache, v_cache, scale, window=window, softcap=softcap)


def _prefill_chunks(out, q, k, v, k_cache, v_cache, chunks: list[PrefillChunk], scale, compute_dtype):
    for chunk in chunks:
        part = slice(chunk.start, chunk.end)
        out[part] = prefill_attention(q[part], k[part], v[part], k_cache, v_cache, chunk, scale, compute_dtype)
    return out


@dataclass
class TorchAttention:
    """Decode rows in buckets of similar length through SDPA (`bucketed_decode_attention`), each
    prefill chunk through SDPA over its cached prefix and itself: where nothing faster builds."""

    num_decode: int  # rows [0, num_decode) are single decode tokens
    buckets: list[DecodeBucket]
    prefills: list[PrefillChunk]
    compute_dtype: torch.dtype | None = None  # attend in this dtype (fp32 where bf16 is slow)

    def attend(self, q, k, v, k_cache, v_cache, scale):
        out, n = torch.empty_like(q), self.num_decode
        if n:
            out[:n] = bucketed_decode_attention(q[:n], k_cache, v_cache, self.buckets, scale, self.compute_dtype)
        return _prefill_chunks(out, q, k, v, k_cache, v_cache, self.prefills, scale, self.compute_dtype)


@dataclass
class KernelDecodeAttention:
    """Decode rows through tercet's C++ kernel (no gathered copy), prefill chunks through SDPA: the
    fast path outside the deterministic mode."""

    num_decode: int
    page_table: torch.Tensor  # [num_decode, max_pages] int32 (padded with 0)
    context_lens: torch.Tensor  # [num_decode] int32, keys each decode row attends (incl. its own)
    page_size: int
    prefills: list[PrefillChunk]
    compute_dtype: torch.dtype | None = None

    def attend(self, q, k, v, k_cache, v_cache, scale):
        out, n = torch.empty_like(q), self.num_decode
        if n:
            out[:n] = cpu_kernels.paged_decode_attention(
                q[:n], k_cache, v_cache, self.page_table, self.context_lens, self.page_size, scale)
        return _prefill_chunks(out, q, k, v, k_cache, v_cache, self.prefills, scale, self.compute_dtype)


@dataclass
class KernelAttention:
    """Every row, decode or prefill, through tercet's C++ kernel (`cpu_kernels.paged_attention`):
    a row's bits depend only on its query, position and keys (the deterministic mode)."""

    page_table: torch.Tensor  # [B, max_pages] int32, one row per sequence
    row_seq: torch.Tensor  # [T] int32, each row's row of page_table
    row_lens: torch.Tensor  # [T] int32, keys each row attends (its position + 1)
    page_size: int

    def attend(self, q, k, v, k_cache, v_cache, scale, window=None, softcap=None):
        return cpu_kernels.paged_attention(q, k_cache, v_cache, self.page_table, self.row_seq, self.row_lens,
                                           self.page_size, scale, window, softcap)


@dataclass
class SplitAttention:
    """The deterministic mode without the C++ kernels: decode and prefill rows through the same
    split-KV torch code (`split_attention.py`), one group per prefill chunk and one for the decode rows."""

    groups: list[SplitGroup]

    def attend(self, q, k, v, k_cache, v_cache, scale, window=None, softcap=None):
        out = torch.empty_like(q)
        for group in self.groups:
            part = slice(group.start, group.end)
            out[part] = split_kv_attention(q[part], k_cache, v_cache, group, scale, window, softcap)
        return out


@dataclass
class TritonAttention:
    """CUDA: decode rows through the triton paged kernel, prefill chunks through SDPA; with `split`
    (the deterministic mode) every row through the triton split-KV kernel, each with its own table
    row (`row_table`, `row_pos`)."""

    num_decode: int
    page_table: torch.Tensor
    context_lens: torch.Tensor
    page_size: int
    prefills: list[PrefillChunk]
    split: int | None = None
    row_table: torch.Tensor | None = None  # [T, pages] int32, each row's page table (split)
    row_pos: torch.Tensor | None = None  # [T] int32, each row's absolute position (split)

    def attend(self, q, k, v, k_cache, v_cache, scale):
        from . import triton_attention

        if self.split is not None:
            return triton_attention.split_kv_attention(
                q, k_cache, v_cache, self.row_table, self.row_pos, self.page_size, scale, self.split)
        out, n = torch.empty_like(q), self.num_decode
        if n:
            out[:n] = triton_attention.paged_decode_attention(
                q[:n], k_cache, v_cache, self.page_table, self.context_lens, self.page_size, scale)
        return _prefill_chunks(out, q, k, v, k_cache, v_cache, self.prefills, scale, None)

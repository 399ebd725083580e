"""Attention over the paged KV cache: the torch path and its plan.

The runner lays a step out as [decode tokens..., prefill chunks...] and
builds one `AttentionPlan` per step, shared by every layer. Decode rows
attend through the page table (a triton kernel on CUDA; on CPU tercet's
C++ kernel, `cpu_kernels.paged_decode_attention`, or where it cannot be
built `bucketed_decode_attention`, which gives `paged_decode_attention`'s
results faster than the reference); each prefill chunk attends to its cached prefix plus
itself. These torch functions are also the references the triton kernels
are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_kernels
from .kv_cache import pages_for
from .split_attention import SplitPlan, split_kv_attention


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
    slots: torch.Tensor  # [T] cache row of each new token
    num_decode: int  # rows [0, num_decode) are single decode tokens
    page_table: torch.Tensor  # [num_decode, max_pages] int32 (padded with 0)
    context_lens: torch.Tensor  # [num_decode] int32, tokens to attend to incl. the new one
    page_size: int
    decode_buckets: list[DecodeBucket] | None  # torch path, default mode
    prefills: list[PrefillChunk]
    use_triton: bool
    cpu_kernel: bool = False  # decode rows through cpu_kernels.paged_attention (no gather)
    prefill_kernel: bool = False  # prefill rows too (the same code: a row's bits do not depend on the batch)
    row_seq: torch.Tensor | None = None  # with prefill_kernel: [T] int32, each row's row of page_table
    row_lens: torch.Tensor | None = None  # [T] int32, keys each row attends (its position + 1)
    compute_dtype: torch.dtype | None = None  # torch path: attend in this dtype (fp32 where bf16 is slow)
    split: SplitPlan | None = None  # the deterministic mode: split-KV attention for every row
    row_tile: int | None = None  # the deterministic mode: rows per GEMM call (layers.py)


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


def attend(q, k, v, k_cache, v_cache, plan: AttentionPlan, scale, stored: bool = False):
    """Store this layer's new K/V (unless `stored`: done already), then attend every row;
    q/k/v are [T, heads, d]."""
    if plan.use_triton:
        from . import triton_attention

        if not stored:
            triton_attention.store_kv(k_cache, v_cache, k, v, plan.slots)
    elif not stored:
        store_kv(k_cache, v_cache, k, v, plan.slots)
    if plan.split is not None:
        return _attend_split(q, k_cache, v_cache, plan, scale)
    if plan.prefill_kernel and plan.row_seq is not None:  # every row, decode and prefill, by one kernel
        return cpu_kernels.paged_attention(
            q, k_cache, v_cache, plan.page_table, plan.row_seq, plan.row_lens, plan.page_size, scale
        )
    out = torch.empty_like(q)
    n = plan.num_decode
    if n:
        if plan.use_triton:
            out[:n] = triton_attention.paged_decode_attention(
                q[:n], k_cache, v_cache, plan.page_table, plan.context_lens, plan.page_size, scale
            )
        elif plan.cpu_kernel:
            out[:n] = cpu_kernels.paged_decode_attention(
                q[:n], k_cache, v_cache, plan.page_table, plan.context_lens, plan.page_size, scale
            )
        else:
            out[:n] = bucketed_decode_attention(
                q[:n], k_cache, v_cache, plan.decode_buckets, scale, plan.compute_dtype
            )
    for chunk in plan.prefills:
        part = slice(chunk.start, chunk.end)
        out[part] = prefill_attention(
            q[part], k[part], v[part], k_cache, v_cache, chunk, scale, plan.compute_dtype
        )
    return out


def _attend_split(q, k_cache, v_cache, plan: AttentionPlan, scale):
    """The deterministic mode: decode rows and prefill rows through the same split-KV code."""
    split = plan.split
    if plan.use_triton:
        from . import triton_attention

        return triton_attention.split_kv_attention(
            q, k_cache, v_cache, split.row_table, split.row_pos, plan.page_size, scale, split.split
        )
    out = torch.empty_like(q)
    for group in split.groups:
        part = slice(group.start, group.end)
        out[part] = split_kv_attention(q[part], k_cache, v_cache, group, scale)
    return out

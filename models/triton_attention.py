"""Triton kernels for the hot paths on GPU, beside their torch references.

`store_kv` mirrors `attention.store_kv`; `paged_decode_attention` mirrors
`attention.paged_decode_attention` (same arguments, same result);
`split_kv_attention` mirrors `split_attention.split_kv_attention` (the
deterministic mode). Imported only when the runner's device is CUDA; tests
run them on CPU under `TRITON_INTERPRET=1`.

The paged kernel is batch-invariant by construction: one program per
(row, head) walks that row's keys in blocks of BLOCK_N at fixed absolute
positions [0, BLOCK_N), [BLOCK_N, 2 BLOCK_N), ... (the last one masked past
the row's position), reduces each block with the same tree and folds the
blocks in order. Nothing in a program depends on the other rows or on the
grid. `split_kv_attention` runs it for prefill rows too, each with its own
position, so a prefill row and a decode row at the same position run the
same program on the same keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, row_size, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    for start in range(0, row_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < row_size
        tl.store(k_cache_ptr + slot * row_size + offs, tl.load(k_ptr + token * row_size + offs, mask=mask), mask=mask)
        tl.store(v_cache_ptr + slot * row_size + offs, tl.load(v_ptr + token * row_size + offs, mask=mask), mask=mask)


def store_kv(k_cache, v_cache, k, v, slots) -> None:
    """k/v [T, kv_heads, d] into rows `slots` of k_cache/v_cache [S, kv_heads, d]."""
    k, v = k.contiguous(), v.contiguous()
    row_size = k.shape[1] * k.shape[2]
    block = min(1024, triton.next_power_of_2(row_size))
    _store_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slots, row_size, BLOCK=block)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, lens_ptr, out_ptr,
    scale, table_stride, page_size, num_heads, num_kv_heads, head_dim,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (num_heads // num_kv_heads)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    q = tl.load(q_ptr + (seq * num_heads + head) * head_dim + dims, mask=dmask, other=0.0).to(tl.float32)
    context_len = tl.load(lens_ptr + seq)
    best = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, context_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < context_len
        page = tl.load(table_ptr + seq * table_stride + pos // page_size, mask=valid, other=0)
        rows = page.to(tl.int64) * page_size + pos % page_size
        offsets = (rows[:, None] * num_kv_heads + kv_head) * head_dim + dims[None, :]
        both = valid[:, None] & dmask[None, :]
        keys = tl.load(k_cache_ptr + offsets, mask=both, other=0.0).to(tl.float32)
        scores = tl.sum(keys * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        weights = tl.exp(scores - new_best)
        rescale = tl.exp(best - new_best)
        values = tl.load(v_cache_ptr + offsets, mask=both, other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum(weights[:, None] * values, axis=0)
        total = total * rescale + tl.sum(weights, axis=0)
        best = new_best
    out = acc / total
    tl.store(out_ptr + (seq * num_heads + head) * head_dim + dims, out.to(out_ptr.dtype.element_ty), mask=dmask)


def paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, page_size, scale, block_n=32):
    """q [B, heads, d] attends to its pages of k_cache/v_cache [S, kv_heads, d] -> [B, heads, d]."""
    q = q.contiguous()
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    page_table = page_table.contiguous()
    _paged_decode_kernel[(batch, num_heads)](
        q, k_cache, v_cache, page_table, context_lens, out,
        scale, page_table.stride(0), page_size, num_heads, k_cache.shape[1], head_dim,
        BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


def split_kv_attention(q, k_cache, v_cache, row_table, row_pos, page_size, scale, split):
    """Every row of q [T, heads, d], decode or prefill, attends keys 0..row_pos[i] of its page
    table row_table[i], in splits of `split` (a power of two) -> [T, heads, d]."""
    return paged_decode_attention(q, k_cache, v_cache, row_table, row_pos + 1, page_size, scale, split)

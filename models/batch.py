"""Lay a step's sequences out as one flattened ragged batch (no padding).

Rows are [decode tokens..., prefill chunks...]; `build_batch` returns the
token ids, their positions, the `AttentionPlan` shared by every layer (laid
out for the runner's attention backend, attention.py) and, per sequence,
the row whose hidden state predicts its next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .attention import (
    AttentionPlan,
    KernelAttention,
    KernelDecodeAttention,
    PrefillChunk,
    SplitAttention,
    TorchAttention,
    TritonAttention,
    decode_buckets,
)
from .errors import InvalidBatch
from .kv_cache import pages_for
from .split_attention import DEFAULT_SPLIT, SplitGroup, split_group


class _Seq(Protocol):
    token_ids: Sequence[int]
    page_table: Sequence[int]
    num_cached: int


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    plan: AttentionPlan
    last_rows: list[int]  # per sequence (in batch order), its last row


BACKENDS = ("kernel", "kernel-decode", "split", "torch", "triton", "triton-split")


def build_batch(
    seqs: Sequence[_Seq], page_size: int, device, backend: str, *, kv_heads: int,
    split: int | None = None, compute_dtype: torch.dtype | None = None, windowed: bool = False,
) -> Batch:
    """`seqs` must list single-token (decode) sequences first; `backend` names the attention
    backend (attention.py) to lay the step out for: "kernel", "kernel-decode", "split" and
    "triton-split" need `split` only for the torch and triton split-KV paths; `kv_heads` is the
    model's (the torch decode path's gather indices); `compute_dtype` as in TorchAttention; `windowed`:
    the model has layers with a sliding window or an attention soft-cap, so a backend without them
    gets the split-KV torch path as the plan's fallback for those layers."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} (one of {', '.join(BACKENDS)})")
    for s in seqs:
        _check(s, page_size)
    num_decode = sum(1 for s in seqs if len(s.token_ids) == 1)
    decode, prefill = seqs[:num_decode], seqs[num_decode:]
    ids = [s.token_ids[0] for s in decode]
    positions = [s.num_cached for s in decode]
    table, context_lens, decode_slots = _decode_tables(decode, page_size)
    slot_parts, chunks, row = [decode_slots], [], num_decode
    slots_only = backend != "torch" and backend != "kernel-decode" and backend != "triton"  # no SDPA plan
    for s in prefill:
        chunk, slots = _prefill_chunk(s, row, page_size, device, slots_only)
        chunks.append(chunk)
        slot_parts.append(slots)
        ids.extend(s.token_ids)
        positions.extend(range(s.num_cached, s.num_cached + len(s.token_ids)))
        row = chunk.end
    if backend == "kernel":
        if prefill:
            table, row_seq, row_lens = _row_tables(decode, prefill, positions, page_size)
        else:  # decode rows only: row i reads table row i
            row_seq, row_lens = torch.arange(num_decode, dtype=torch.int32), context_lens
        attention = KernelAttention(table.to(device), row_seq.to(device), row_lens.to(device), page_size)
    elif backend == "kernel-decode":
        attention = KernelDecodeAttention(num_decode, table.to(device), context_lens.to(device), page_size,
                                          chunks, compute_dtype)
    elif backend == "torch":
        table, context_lens = table.to(device), context_lens.to(device)
        buckets = decode_buckets(table, context_lens, page_size, kv_heads) if decode else []
        attention = TorchAttention(num_decode, buckets, chunks, compute_dtype)
    elif backend == "split":
        attention = SplitAttention(_split_groups(decode, prefill, chunks, page_size, split, device))
    else:
        attention = TritonAttention(num_decode, table.to(device), context_lens.to(device), page_size, chunks)
        if backend == "triton-split":
            attention.split = split
            attention.row_table, attention.row_pos = _triton_rows(decode, prefill, positions, page_size, device)
    plan = AttentionPlan((torch.cat(slot_parts) if len(slot_parts) > 1 else slot_parts[0]).to(device), attention)
    if windowed and not plan.windows:
        groups = _split_groups(decode, prefill, chunks, page_size, split or DEFAULT_SPLIT, device)
        plan.fallback = SplitAttention(groups)
    last_rows = list(range(num_decode)) + [c.end - 1 for c in chunks]
    return Batch(
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        plan, last_rows,
    )


def _check(s: _Seq, page_size: int) -> None:
    if not s.token_ids:
        raise InvalidBatch("a SeqInput has no new tokens")
    if s.num_cached < 0:
        raise InvalidBatch(f"num_cached must be >= 0, got {s.num_cached}")
    if len(s.page_table) < pages_for(s.num_cached + len(s.token_ids), page_size):
        raise InvalidBatch(
            f"page table of {len(s.page_table)} pages cannot hold "
            f"{s.num_cached}+{len(s.token_ids)} tokens (page_size {page_size})"
        )


def _decode_tables(decode: Sequence[_Seq], page_size: int):
    """Padded page table [B, P] int32, context lengths [B] int32, new-token slots [B]."""
    if not decode:
        empty = torch.zeros(0, dtype=torch.int32)
        return empty.view(0, 1), empty, empty.long()
    widths = [pages_for(s.num_cached + 1, page_size) for s in decode]
    widest = max(widths)
    table = torch.tensor(
        [[*s.page_table[:w], *([0] * (widest - w))] for s, w in zip(decode, widths)], dtype=torch.int32
    )
    # in Python, not as ~10 tensor ops: each of those costs ~10-20 us in a decode step, where the weights
    # streamed through the caches just before have evicted the code and data they touch
    lens = torch.tensor([s.num_cached + 1 for s in decode], dtype=torch.int32)
    slots = torch.tensor([s.page_table[s.num_cached // page_size] * page_size + s.num_cached % page_size
                          for s in decode], dtype=torch.long)
    return table, lens, slots


def _row_tables(decode: Sequence[_Seq], prefill: Sequence[_Seq], positions: list[int], page_size: int):
    """For the C++ kernel over every row: a page-table row per sequence [B, P] int32 (decode ones
    first, so decode row i reads row i), each row's sequence [T] and length (its position + 1) [T]."""
    seqs = [*decode, *prefill]
    widths = [pages_for(s.num_cached + len(s.token_ids), page_size) for s in seqs]
    widest = max(widths)
    table = torch.tensor([[*s.page_table[:w], *([0] * (widest - w))] for s, w in zip(seqs, widths)],
                         dtype=torch.int32)
    row_seq = [*range(len(decode)), *(len(decode) + i for i, s in enumerate(prefill) for _ in s.token_ids)]
    return (table, torch.tensor(row_seq, dtype=torch.int32),
            torch.tensor(positions, dtype=torch.int32) + 1)


def _prefill_chunk(s: _Seq, row: int, page_size: int, device, slots_only: bool = False):
    """The chunk's torch attention plan (unless `slots_only`) and its new tokens' cache rows."""
    n, cached = len(s.token_ids), s.num_cached
    pages = torch.tensor(s.page_table[: pages_for(cached + n, page_size)], dtype=torch.long)
    context = torch.arange(cached if slots_only else 0, cached + n)
    context_slots = pages[context // page_size] * page_size + context % page_size
    if slots_only:
        return PrefillChunk(row, row + n, None, None), context_slots
    if not cached:
        return PrefillChunk(row, row + n, None, None), context_slots
    mask = context[None, :] <= (cached + torch.arange(n))[:, None]  # causal, offset by the prefix
    chunk = PrefillChunk(row, row + n, context_slots.to(device), mask[None, None].to(device))
    return chunk, context_slots[cached:]


def _triton_rows(decode, prefill, positions, page_size, device):
    """The triton split-KV kernel's per-row page tables [T, pages] int32 and positions [T] int32."""
    owners = [*decode, *(s for s in prefill for _ in s.token_ids)]
    widths = [pages_for(s.num_cached + len(s.token_ids), page_size) for s in owners]
    widest = max(widths)
    table = [[*s.page_table[:w], *([0] * (widest - w))] for s, w in zip(owners, widths)]
    return (torch.tensor(table, dtype=torch.int32, device=device),
            torch.tensor(positions, dtype=torch.int32, device=device))


def _split_groups(decode, prefill, chunks, page_size, split, device) -> list[SplitGroup]:
    """One group for all decode rows, one per prefill chunk."""
    groups = []
    if decode:
        groups.append(split_group(0, [s.page_table for s in decode], [s.num_cached for s in decode],
                                  1, page_size, split, device))
    for s, chunk in zip(prefill, chunks):
        groups.append(split_group(chunk.start, [s.page_table], [s.num_cached], len(s.token_ids),
                                  page_size, split, device))
    return groups

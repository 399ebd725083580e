"""The CPU decode path (models.attention): bucketed, head-folded attention gives the reference's results."""

import pytest
import torch

from models.attention import BUCKET_COST, bucketed_decode_attention, decode_buckets, paged_decode_attention
from models.kv_cache import pages_for

# one row far longer than the rest, a run of equal ones, a one-token context
CONTEXTS = [400, 3, 130, 130, 130, 1, 17, 260, 129, 131, 64, 390]


def _paged_cache(page_size, kv_heads, head_dim, dtype, generator):
    """A shuffled page table for CONTEXTS over a random cache."""
    widths = [pages_for(n, page_size) for n in CONTEXTS]
    num_pages = sum(widths) + 3
    pages = torch.randperm(num_pages, generator=generator).tolist()
    table = torch.zeros(len(CONTEXTS), max(widths), dtype=torch.int32)
    for i, w in enumerate(widths):
        table[i, :w] = torch.tensor(pages[:w])
        pages = pages[w:]
    shape = (num_pages * page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    return table, torch.tensor(CONTEXTS, dtype=torch.int32), k_cache, v_cache


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_bucketed_decode_attention_matches_the_reference(page_size, heads, kv_heads, dtype, tolerance):
    generator = torch.Generator().manual_seed(page_size + heads)
    table, lens, k_cache, v_cache = _paged_cache(page_size, kv_heads, 64, dtype, generator)
    q = (torch.randn(len(CONTEXTS), heads, 64, generator=generator) * 3).to(dtype)  # peaked softmax
    buckets = decode_buckets(table, lens, page_size, kv_heads)
    assert len(buckets) > 1  # the short rows do not pad to 400
    want = paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), table, lens, page_size, 0.125)
    got = bucketed_decode_attention(q, k_cache, v_cache, buckets, 0.125)
    assert got.dtype == dtype
    assert (got.double() - want).abs().max().item() < tolerance
    if dtype == torch.bfloat16:  # the upcast mode (a CPU without bf16 units)
        got = bucketed_decode_attention(q, k_cache, v_cache, buckets, 0.125, torch.float32)
        assert got.dtype == dtype and (got.double() - want).abs().max().item() < tolerance


def test_decode_buckets_cover_every_row_once_and_mask_only_ragged_ones():
    table, lens, _, _ = _paged_cache(4, 3, 8, torch.float32, torch.Generator().manual_seed(0))
    buckets = decode_buckets(table, lens, 4, 3)
    assert sorted(r for b in buckets for r in b.rows.tolist()) == list(range(len(CONTEXTS)))
    for b in buckets:
        rows_lens = lens[b.rows]
        assert len(b.kv_rows) == len(b.rows) * 3 * int(rows_lens.max())
        assert (b.mask is None) == bool((rows_lens == rows_lens.max()).all())


def test_rows_are_split_only_where_the_saved_padding_pays():
    table = torch.arange(64, dtype=torch.int32)[:, None].repeat(1, 400)
    close = torch.tensor([400 - i for i in range(64)], dtype=torch.int32)  # 63 keys apart at most
    assert len(decode_buckets(table, close, 1, 3)) == 1
    spread = torch.tensor([400] * 8 + [100] * 56, dtype=torch.int32)
    assert 300 * 56 > BUCKET_COST
    buckets = decode_buckets(table, spread, 1, 3)
    assert [b.rows.tolist() for b in buckets] == [list(range(8)), list(range(8, 64))]
    assert all(b.mask is None for b in buckets)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_decode_batch_stores_each_row_in_its_pages_slot_and_reads_its_context(page_size):
    """A decode step's tables (built in Python, not tensor ops): row i's new token goes to the slot of
    position num_cached in its pages (the last of a page and the first of the next too), it reads
    num_cached + 1 keys, and its table row holds its pages, padded with zeros."""
    from models.batch import build_batch
    from models.runner import SeqInput

    g = torch.Generator().manual_seed(page_size)
    cached = [0, page_size - 1, page_size, 5 * page_size + 3, 40]
    pages = torch.randperm(200, generator=g).tolist()
    seqs, at = [], 0
    for n in cached:
        width = pages_for(n + 1, page_size) + 1  # (a page past the one written: never read)
        seqs.append(SeqInput([7], pages[at : at + width], num_cached=n))
        at += width
    batch = build_batch(seqs, page_size, "cpu", "kernel", kv_heads=3)
    want = [s.page_table[n // page_size] * page_size + n % page_size for s, n in zip(seqs, cached)]
    assert batch.plan.slots.dtype == torch.long and batch.plan.slots.tolist() == want
    attention = batch.plan.backend
    assert attention.row_lens.dtype == torch.int32 and attention.row_lens.tolist() == [n + 1 for n in cached]
    assert attention.row_seq.tolist() == list(range(len(seqs)))
    for i, (s, n) in enumerate(zip(seqs, cached)):
        width = pages_for(n + 1, page_size)
        assert attention.page_table[i, :width].tolist() == list(s.page_table[:width])
        assert not attention.page_table[i, width:].any()
    assert batch.positions.tolist() == cached and batch.input_ids.tolist() == [7] * len(seqs)

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

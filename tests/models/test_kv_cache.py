import pytest
import torch

from models.errors import OutOfPages
from models.kv_cache import KVCache


def pool(page_size=1, budget=None):
    per_token = 2 * 2 * 2 * 8 * 4  # layers * kv heads * head_dim * fp32, K and V
    return KVCache(
        num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
        page_size=page_size, budget_bytes=budget if budget is not None else per_token * page_size * 10,
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_budget_sizes_the_pool(page_size):
    cache = pool(page_size)
    assert cache.num_pages == cache.num_free == 10
    assert cache.k.shape == (2, 10 * page_size, 2, 8)
    assert cache.pages_for(page_size + 1) == 2


def test_freeing_returns_every_page():
    cache = pool()
    a, b = cache.allocate(3), cache.allocate(7)
    assert cache.num_free == 0 and len(set(a) | set(b)) == 10
    cache.free(a)
    cache.free(b)
    assert cache.num_free == 10
    assert sorted(cache.allocate(10)) == list(range(10))


def test_allocating_past_the_budget_fails_and_changes_nothing():
    cache = pool()
    held = cache.allocate(8)
    with pytest.raises(OutOfPages, match="3 pages wanted, 2 free") as info:
        cache.allocate(3)
    assert (info.value.wanted, info.value.free) == (3, 2)
    assert cache.num_free == 2
    cache.free(held)
    assert cache.num_free == 10


def test_double_free_is_refused_and_changes_nothing():
    cache = pool()
    pages = cache.allocate(2)
    cache.free(pages[:1])
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(pages)  # pages[1] is fine, pages[0] already free
    assert cache.num_free == 9
    cache.free(pages[1:])
    assert cache.num_free == 10


def test_budget_too_small_for_one_page():
    with pytest.raises(ValueError, match="holds no page"):
        pool(page_size=16, budget=100)

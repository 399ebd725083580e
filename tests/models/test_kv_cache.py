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


def test_pages_come_side_by_side_where_the_pool_allows():
    cache = pool()
    a, b, c = cache.allocate(3), cache.allocate(2), cache.allocate(3)
    assert (a, b, c) == ([0, 1, 2], [3, 4], [5, 6, 7])
    cache.free(b)
    cache.free([0])
    assert cache.allocate(2) == [3, 4]  # the lowest run that holds 2, not the lowest pages 0 and 3
    cache.free([3, 4])
    assert cache.allocate(3) == [0, 3, 4]  # no 3 free side by side: the lowest free pages
    cache.free([7])
    assert cache.allocate(1, after=6) == [7]  # growing in place
    cache.free([1])
    assert cache.allocate(1, after=7) == [8]
    assert cache.allocate(1, after=7) == [1]  # page 8 is taken now: the lowest free page instead
    with pytest.raises(OutOfPages):
        cache.allocate(2, after=8)
    assert cache.allocate(1, after=8) == [9]
    assert cache.num_free == 0


def test_a_page_twice_in_one_free_is_refused_and_changes_nothing():
    cache = pool()
    pages = cache.allocate(3)
    with pytest.raises(ValueError, match="page 1 is not allocated"):
        cache.free([0, 1, 1])
    with pytest.raises(ValueError, match="page 10 is not allocated"):
        cache.free([2, 10])
    assert cache.num_free == 7
    cache.free(pages)
    assert cache.num_free == 10


def test_runs_are_found_across_search_windows(monkeypatch):
    monkeypatch.setattr("models.kv_cache.RUN_SEARCH_PAGES", 8)
    cache = pool(budget=2 * 2 * 2 * 8 * 4 * 100)  # 100 pages, searched 8 at a time, 8 stretches
    held = cache.allocate(100)
    cache.free([p for p in held if p % 4 == 0])  # no two free pages side by side
    cache.free([7])  # 7 and 8: a run across the edge of the first stretch
    assert cache.allocate(2) == [7, 8]
    cache.free([81])  # 80 and 81: beyond the 8 stretches from the lowest free page, not looked for
    assert cache.allocate(2) == [0, 4]  # so the lowest free pages


def test_a_full_pool_hands_out_only_what_was_freed():
    cache = pool()
    held = cache.allocate(10)
    cache.free([held[7]])
    assert cache.allocate(1) == [7]
    cache.free([9, 8])
    assert cache.allocate(2) == [8, 9]
    with pytest.raises(OutOfPages):
        cache.allocate(1)


@pytest.mark.parametrize("seed", range(5))
def test_random_allocations_never_hand_out_a_page_twice(seed, monkeypatch):
    import random

    monkeypatch.setattr("models.kv_cache.RUN_SEARCH_PAGES", 4)
    rng = random.Random(seed)
    cache = pool(budget=2 * 2 * 2 * 8 * 4 * 64)
    held: list[list[int]] = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            cache.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 9)
            after = rng.choice([None, rng.randrange(64)])
            in_use = {p for h in held for p in h}
            if n > 64 - len(in_use):
                with pytest.raises(OutOfPages):
                    cache.allocate(n, after=after)
                continue
            pages = cache.allocate(n, after=after)
            assert len(pages) == n and not in_use & set(pages) and all(0 <= p < 64 for p in pages)
            held.append(pages)
        assert cache.num_free == 64 - sum(map(len, held))

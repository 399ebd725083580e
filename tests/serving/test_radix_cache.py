import random

import pytest

from serving.managers.radix_cache import RadixCache, RadixCacheLocked


class FakePool:
    """The KV pool's page bookkeeping, strict: a double free or a foreign page fails the test.

    `holds[page]` is the whole token prefix whose K/V the page would hold, so a
    test can check that a match hands out pages computed for exactly its prefix.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_list = list(range(num_pages - 1, -1, -1))
        self.in_use: set[int] = set()
        self.holds: dict[int, tuple[int, ...]] = {}
        self.freed_log: list[int] = []

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_list)
        pages = [self.free_list.pop() for _ in range(n)]
        self.in_use.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            assert page in self.in_use, f"page {page} freed twice or never allocated"
            self.in_use.remove(page)
            self.holds.pop(page, None)
            self.free_list.append(page)
        self.freed_log += pages

    def compute(self, tokens, pages, start_page: int) -> None:
        """Fill `pages[start_page:]` as a forward pass over `tokens` would."""
        for i in range(start_page, len(pages)):
            self.holds[pages[i]] = tuple(tokens[: (i + 1) * self.page_size])

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


def toks(symbols: str, page_size: int) -> list[int]:
    """One page of distinct tokens per symbol, so page-level stories read the same for any size."""
    return [ord(s) * 16 + j for s in symbols for j in range(page_size)]


@pytest.fixture(params=[1, 4], ids=["page1", "page4"])
def page_size(request):
    return request.param


@pytest.fixture
def pool(page_size):
    return FakePool(64, page_size)


@pytest.fixture
def cache(pool, page_size):
    return RadixCache(pool.free, page_size=page_size)


def run(pool, cache, symbols: str, *, lock=False):
    """A request for `symbols` that computes and finishes: match, compute the rest, insert."""
    tokens = toks(symbols, pool.page_size)
    match = cache.match_prefix(tokens)
    own = pool.allocate(len(symbols) - len(match.pages))
    pages = match.pages + own
    pool.compute(tokens, pages, len(match.pages))
    inserted = cache.insert(tokens, pages)
    if lock:
        cache.lock(inserted.handle)
    return pages, inserted


def test_empty_cache_matches_nothing(cache, page_size):
    match = cache.match_prefix(toks("abc", page_size))
    assert (match.num_tokens, match.pages) == (0, [])
    cache.lock(match.handle)  # the root: locking it pins nothing
    assert cache.protected_pages == 0
    cache.unlock(match.handle)


def test_match_returns_the_shared_prefix_pages(pool, cache, page_size):
    pages, inserted = run(pool, cache, "abcd")
    assert inserted.num_cached == 0 and cache.cached_pages == 4
    match = cache.match_prefix(toks("abcxy", page_size))
    assert match.num_tokens == 3 * page_size
    assert match.pages == pages[:3]


def test_never_matches_the_whole_prompt(pool, cache, page_size):
    pages, _ = run(pool, cache, "abcd")
    match = cache.match_prefix(toks("abcd", page_size))
    assert match.pages == pages[:3]  # the last page holds the token still to compute
    assert cache.match_prefix(toks("abcde", page_size)).pages == pages


def test_insert_splits_edges_and_frees_duplicate_pages(pool, cache, page_size):
    first, _ = run(pool, cache, "abcd")
    tokens = toks("abxy", page_size)
    mine = pool.allocate(4)  # computed without the cache: "ab" duplicates the tree's pages
    pool.compute(tokens, mine, 0)
    inserted = cache.insert(tokens, mine)
    assert inserted.num_cached == 2 * page_size
    assert pool.freed_log == mine[:2]  # the tree keeps its own copy
    assert cache.cached_pages == 6
    assert cache.pages_of(inserted.handle) == first[:2] + mine[2:]
    assert cache.match_prefix(toks("abcdz", page_size)).pages == first
    assert cache.match_prefix(toks("abxyz", page_size)).pages == first[:2] + mine[2:]


def test_pages_lent_by_a_match_are_shared_not_freed(pool, cache, page_size):
    first, _ = run(pool, cache, "abc")
    second, inserted = run(pool, cache, "abcdef")
    assert second[:3] == first and inserted.num_cached == 3 * page_size
    assert pool.freed_log == [] and cache.cached_pages == 6


def test_match_inside_an_edge_splits_it_so_the_lock_covers_only_the_match(pool, cache, page_size):
    run(pool, cache, "abcdef")
    match = cache.match_prefix(toks("abcz", page_size))
    assert match.num_tokens == 3 * page_size
    cache.lock(match.handle)
    assert cache.protected_pages == 3 and cache.evictable_pages == 3
    assert cache.evict(100) == 3
    assert cache.match_prefix(toks("abcdefg", page_size)).num_tokens == 3 * page_size
    cache.unlock(match.handle)


def test_lock_protects_the_path_from_eviction(pool, cache, page_size):
    _, inserted = run(pool, cache, "abc", lock=True)
    run(pool, cache, "abd")
    assert (cache.cached_pages, cache.protected_pages, cache.evictable_pages) == (4, 3, 1)
    assert cache.evict(100) == 1  # only "d"; "ab" + "c" are on the locked path
    cache.unlock(inserted.handle)
    assert (cache.protected_pages, cache.evictable_pages) == (0, 3)
    assert cache.evict(100) == 3
    assert cache.cached_pages == 0 and pool.in_use == set()


def test_locks_are_counted(pool, cache, page_size):
    _, inserted = run(pool, cache, "ab")
    cache.lock(inserted.handle)
    cache.lock(inserted.handle)
    cache.unlock(inserted.handle)
    assert cache.evict(10) == 0
    cache.unlock(inserted.handle)
    with pytest.raises(ValueError, match="without a matching lock"):
        cache.unlock(inserted.handle)
    assert cache.evict(10) == 2


def test_evicts_least_recently_used_leaves_first(pool, cache, page_size):
    a, _ = run(pool, cache, "a")
    b, _ = run(pool, cache, "b")
    c, _ = run(pool, cache, "c")
    cache.match_prefix(toks("ax", page_size))  # touches "a"
    assert cache.evict(1) == 1 and pool.freed_log == b
    assert cache.evict(1) == 1 and pool.freed_log == b + c
    assert cache.evict(1) == 1 and pool.freed_log == b + c + a


def test_prefix_len_does_not_touch_lru_time(pool, cache, page_size):
    a, _ = run(pool, cache, "aa")
    run(pool, cache, "bb")
    assert cache.prefix_len(toks("aaa", page_size)) == 2 * page_size
    assert cache.prefix_len(toks("abb", page_size)) == page_size
    assert cache.evict(1) == 2 and pool.freed_log == a


def test_prefix_len_agrees_with_match(pool, cache, page_size):
    run(pool, cache, "abcd")
    run(pool, cache, "abxy")
    for symbols in ["", "a", "ab", "abc", "abcq", "abxyz", "q", "abcdefg"]:
        tokens = toks(symbols, page_size)
        assert cache.prefix_len(tokens) == cache.match_prefix(tokens).num_tokens


def test_evict_cascades_to_parents_that_become_leaves(pool, cache, page_size):
    run(pool, cache, "abc")
    run(pool, cache, "abd")
    assert cache.evict(2) == 2  # "c" and "d"; "ab" is left
    assert cache.cached_pages == 2
    assert cache.evict(3) == 2  # "ab" became a leaf and goes too
    assert cache.cached_pages == 0 and pool.in_use == set()


def test_evict_frees_whole_edges(pool, cache, page_size):
    run(pool, cache, "abcd")
    assert cache.evict(1) == 4
    assert cache.evict(1) == 0
    assert cache.evict(0) == 0


def test_reset_refuses_while_locked_then_frees_everything(pool, cache, page_size):
    _, inserted = run(pool, cache, "abc", lock=True)
    run(pool, cache, "xy")
    with pytest.raises(RadixCacheLocked, match="3 cached pages are locked"):
        cache.reset()
    assert cache.cached_pages == 5
    cache.unlock(inserted.handle)
    assert cache.reset() == 5
    assert cache.cached_pages == cache.protected_pages == 0 and pool.in_use == set()
    with pytest.raises(ValueError, match="evicted or reset"):
        cache.lock(inserted.handle)
    assert cache.match_prefix(toks("abcd", page_size)).num_tokens == 0


def test_evicted_handle_is_refused(pool, cache, page_size):
    _, inserted = run(pool, cache, "ab")
    cache.evict(10)
    with pytest.raises(ValueError, match="evicted or reset"):
        cache.lock(inserted.handle)


def test_insert_takes_whole_pages_only(pool, cache, page_size):
    tokens = toks("abc", page_size) + [7] * (page_size - 1)  # a partial fourth page, if any
    pages = pool.allocate(pool.pages_for(len(tokens)))
    inserted = cache.insert(tokens, pages)
    assert inserted.num_cached == 0 and cache.cached_pages == 3
    assert cache.pages_of(inserted.handle) == pages[:3]  # the partial page stays the caller's
    with pytest.raises(ValueError, match="need 3 pages"):
        cache.insert(toks("abc", page_size), pages[:2])


def test_chunked_prefill_inserts_and_relocks(pool, cache, page_size):
    tokens = toks("abcdef", page_size)
    pages = pool.allocate(3)
    pool.compute(tokens, pages, 0)
    chunk = cache.insert(tokens[: 3 * page_size], pages)
    cache.lock(chunk.handle)
    rest = pool.allocate(3)
    pool.compute(tokens, cache.pages_of(chunk.handle) + rest, 3)
    done = cache.insert(tokens, cache.pages_of(chunk.handle) + rest)
    cache.unlock(chunk.handle)
    assert done.num_cached == 3 * page_size and pool.freed_log == []
    assert cache.cached_pages == 6 and cache.protected_pages == 0


def test_page_size_4_shares_only_whole_pages():
    pool = FakePool(16, 4)
    cache = RadixCache(pool.free, page_size=4)
    pages = pool.allocate(2)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], pages)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 9, 9]).pages == pages[:1]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).pages == pages[:1]  # 8 is left to compute
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]).pages == pages
    other = pool.allocate(2)
    inserted = cache.insert([1, 2, 3, 4, 5, 6, 7, 0], other)  # differs inside the second page
    assert inserted.num_cached == 4 and pool.freed_log == other[:1]
    assert cache.cached_pages == 3
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 0, 1]).pages == [pages[0], other[1]]


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_never_leak_nor_double_free(page_size, seed):
    """2,000 random operations against a reference; the pool fails on any double free."""
    rng = random.Random(seed)
    pool = FakePool(48, page_size)
    cache = RadixCache(pool.free, page_size=page_size)
    running = []  # [tokens, page table, handle of the locked prefix, pages the request owns]
    inserted = set()  # whole-page prefixes inserted since the last reset (an upper bound)
    present = set()  # ... and not possibly evicted since (a lower bound, with locked paths)

    def whole(tokens):
        return tuple(tokens[: len(tokens) // page_size * page_size])

    def common(a, b):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n - n % page_size

    def bounds(tokens):
        usable = tokens[: (len(tokens) - 1) // page_size * page_size]
        locked = {whole(req[0][: len(cache.pages_of(req[2])) * page_size]) for req in running}
        low = max((common(usable, seq) for seq in present | locked), default=0)
        high = max((common(usable, seq) for seq in inserted), default=0)
        return low, high

    def start_request():
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 6 * page_size))]
        low, high = bounds(tokens)
        expected = cache.prefix_len(tokens)
        match = cache.match_prefix(tokens)
        assert match.num_tokens == expected and low <= expected <= high
        assert len(match.pages) * page_size == match.num_tokens < len(tokens)
        for i, page in enumerate(match.pages):  # a true prefix, in pages computed for it
            assert pool.holds[page] == tuple(tokens[: (i + 1) * page_size])
        cache.lock(match.handle)
        need = pool.pages_for(len(tokens)) - len(match.pages)
        if need > len(pool.free_list):
            cache.evict(need - len(pool.free_list))
            present.clear()
        if need > len(pool.free_list):
            cache.unlock(match.handle)
            return
        own = pool.allocate(need)
        pool.compute(tokens, match.pages + own, len(match.pages))
        running.append([tokens, match.pages + own, match.handle, own])

    def insert(req, upto):
        tokens, pages, handle, own = req
        result = cache.insert(tokens[:upto], pages)
        taken = len(tokens[:upto]) // page_size
        req[3] = [p for p in own if p not in pages[:taken]]  # the tree took (or freed) the rest
        inserted.add(whole(tokens[:upto]))
        present.add(whole(tokens[:upto]))
        return result

    def finish_request():
        req = running.pop(rng.randrange(len(running)))
        insert(req, len(req[0]))
        pool.free(req[3])  # the partial last page, if any
        cache.unlock(req[2])

    def chunk_boundary():
        req = rng.choice(running)
        done = len(cache.pages_of(req[2])) * page_size  # chunks only move forward
        result = insert(req, rng.randint(max(done, 1), len(req[0])))
        cache.lock(result.handle)
        cache.unlock(req[2])
        table = cache.pages_of(result.handle)
        req[1][: len(table)] = table
        req[2] = result.handle

    for _ in range(2000):
        op = rng.random()
        if op < 0.35:
            start_request()
        elif op < 0.6 and running:
            finish_request()
        elif op < 0.75 and running:
            chunk_boundary()
        elif op < 0.95:
            cache.evict(rng.randint(1, 8))
            present.clear()
        elif cache.protected_pages:
            with pytest.raises(RadixCacheLocked):
                cache.reset()
        else:
            cache.reset()  # running requests, if any, hold only pages of their own
            inserted.clear()
            present.clear()
        # Every page is the pool's, the tree's, or exactly one running request's.
        owned_by_requests = [p for req in running for p in req[3]]
        assert len(owned_by_requests) == len(set(owned_by_requests))
        assert len(pool.in_use) == cache.cached_pages + len(owned_by_requests)
        assert cache.cached_pages == cache.evictable_pages + cache.protected_pages
        assert cache.evictable_pages >= 0 and cache.protected_pages >= 0
        for req in running:
            assert all(pool.holds[p] == tuple(req[0][: (i + 1) * page_size])
                       for i, p in enumerate(req[1][: len(req[0]) // page_size]))

    while running:
        finish_request()
    assert cache.protected_pages == 0
    cache.reset()
    assert pool.in_use == set() and sorted(pool.free_list) == list(range(48))

"""The paged KV-cache pool: one owner of the K/V tensors and of their pages.

A page holds `page_size` consecutive token slots of every layer; slot `s`
of page `p` is row `p * page_size + s` of each layer's K and V tensor.
The Scheduler allocates pages per request (or takes them from its radix
cache), hands the page table to `ModelRunner.step`, and frees them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from .errors import OutOfPages

DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024
RUN_SEARCH_PAGES = 4096  # KVCache.allocate looks for a run of free pages in stretches of this many


def pages_for(num_tokens: int, page_size: int) -> int:
    """How many pages of `page_size` tokens hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        page_size: int = 1,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * itemsize
        self.num_pages = budget_bytes // (self.bytes_per_token * page_size)
        if self.num_pages < 1:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds no page of {page_size} tokens "
                f"({self.bytes_per_token} bytes per token)"
            )
        shape = (num_layers, self.num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = np.ones(self.num_pages, dtype=np.bool_)  # True: the page is free
        self._num_free = self.num_pages
        self._low = 0  # the lowest free page (num_pages when none is)

    @property
    def num_free(self) -> int:
        return self._num_free

    def pages_for(self, num_tokens: int) -> int:
        """How many pages hold `num_tokens` tokens."""
        return pages_for(num_tokens, self.page_size)

    def allocate(self, n: int, *, after: int | None = None) -> list[int]:
        """`n` free pages, or `OutOfPages` with the pool left unchanged.

        The pages come side by side where the pool allows: right after page `after` (a
        sequence growing in place), else the lowest run of `n` free pages (looked for near
        the bottom of the pool only, so the cost stays bounded in a big pool), else the
        lowest `n` free pages. Decode attention reads each sequence's pages in order, and
        rows adjacent in memory read 1.2-1.5x faster than scattered ones (CPU, page size 1).
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._num_free:
            raise OutOfPages(n, self._num_free)
        if n == 0:
            return []
        if after is not None and 0 <= after and after + 1 + n <= self.num_pages \
                and self._free[after + 1 : after + 1 + n].all():
            start = after + 1
        else:
            start = self._first_run(n)
        if start is not None:
            pages = np.arange(start, start + n)
        else:
            pages = np.flatnonzero(self._free[self._low :])[:n] + self._low
        self._free[pages] = False
        self._num_free -= n
        if not self._num_free:
            self._low = self.num_pages
        elif not self._free[self._low]:
            self._low += int(np.argmax(self._free[self._low :]))  # stops at the first free page
        return pages.tolist()

    def _first_run(self, n: int, windows: int = 8) -> int | None:
        """The first page of the lowest run of `n` free pages among the first `windows`
        stretches of RUN_SEARCH_PAGES pages from the lowest free page, or None."""
        if n == 1:
            return self._low
        width = max(RUN_SEARCH_PAGES, 4 * n)
        for pos in range(self._low, min(self.num_pages, self._low + windows * width), width):
            free = np.flatnonzero(self._free[pos : pos + width + n])  # + n: a run may cross the edge
            if len(free) < n:
                continue
            ends = free[n - 1 :] - free[: len(free) - n + 1]  # first to n-th free page: n - 1 if side by side
            fits = np.flatnonzero(ends == n - 1)
            if len(fits) and free[fits[0]] < width:
                return pos + int(free[fits[0]])
        return None

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool; freeing a page that is not in use (or twice) is a ValueError,
        and leaves the pool as it was."""
        pages = list(pages)
        if not pages:
            return
        index = np.asarray(pages, dtype=np.int64)
        bad = (index < 0) | (index >= self.num_pages)
        if not bad.any():
            bad = self._free[index]
            if not bad.any() and len(set(pages)) < len(pages):  # a page twice in one call
                _, first = np.unique(index, return_index=True)
                bad = np.ones(len(index), dtype=np.bool_)
                bad[first] = False
        if bad.any():
            raise ValueError(f"page {pages[int(np.argmax(bad))]} is not allocated")
        self._free[index] = True
        self._num_free += len(index)
        self._low = min(self._low, int(index.min()))

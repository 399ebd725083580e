"""The paged KV-cache pool: one owner of the K/V tensors and of their pages.

A page holds `page_size` consecutive token slots of every layer; slot `s`
of page `p` is row `p * page_size + s` of each layer's K and V tensor.
The Scheduler allocates pages per request (or takes them from its radix
cache), hands the page table to `ModelRunner.step`, and frees them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .errors import OutOfPages

DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024


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
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._in_use = bytearray(self.num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """How many pages hold `num_tokens` tokens."""
        return pages_for(num_tokens, self.page_size)

    def allocate(self, n: int) -> list[int]:
        """`n` free pages, or `OutOfPages` with the pool left unchanged."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for page in pages:
            self._in_use[page] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool; freeing a page that is not in use is a ValueError."""
        pages = list(pages)
        for i, page in enumerate(pages):
            if not (0 <= page < self.num_pages) or not self._in_use[page]:
                for done in pages[:i]:  # leave the pool as it was
                    self._in_use[done] = 1
                raise ValueError(f"page {page} is not allocated")
            self._in_use[page] = 0
        self._free.extend(reversed(pages))

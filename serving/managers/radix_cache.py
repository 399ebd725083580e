"""The prefix (radix) cache: a radix tree over token ids whose edges hold KV pages.

Requests that share a prompt prefix share its KV pages. Each edge of the tree
holds a run of tokens (a multiple of `page_size`) and the page ids holding
their K/V, one page per `page_size` tokens; only whole pages are ever shared.
The tree holds page ids, never tensors, and gives pages back to the pool only
through the `free_pages` callback it is built with.

Who owns which page:

- `match_prefix(prompt)` lends the tree's pages for the longest cached prefix
  of `prompt[:-1]` (at least one token is left to compute, for its logits).
  The pages stay the tree's; `lock(match.handle)` keeps them from eviction
  while the request uses them, `unlock` once it is done.
- `insert(tokens, pages)` hands the tree `pages[:len(tokens) // page_size]`
  (`pages[i]` holds tokens `[i * page_size, (i + 1) * page_size)`); any pages
  after those (a partial last page) stay the caller's. Each page handed over
  is either kept by the tree or, where the tree already holds those tokens in
  another page, freed through `free_pages` at once. A request that goes on
  computing after `insert` (chunked prefill) must then read its page table
  back with `pages_of(handle)`, lock the new handle before unlocking the old
  one, and only ever insert a longer prefix than its locked one.
- `evict(n)` and `reset()` free the tree's unlocked pages through `free_pages`.

Handles are tree nodes: opaque to callers, valid until the node is evicted or
the tree is reset; a locked node is neither. Eviction is LRU over leaves, by a
logical clock ticked once per `match_prefix` / `insert`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import NamedTuple


class RadixCacheLocked(RuntimeError):
    """`reset()` was called while some request still holds a lock on cached pages."""


class _Node:
    __slots__ = ("parent", "key", "pages", "children", "lock_ref", "last_access")

    def __init__(self, parent: _Node | None, key: tuple[int, ...], pages: list[int]) -> None:
        self.parent = parent
        self.key = key  # the edge's tokens, a multiple of page_size
        self.pages = pages  # len(key) // page_size page ids
        self.children: dict[object, _Node] = {}  # first token (page_size 1) or first page's tokens
        self.lock_ref = 0
        self.last_access = 0

    def __repr__(self) -> str:
        return f"<node {len(self.key)} tokens, {len(self.children)} children, lock {self.lock_ref}>"


class Match(NamedTuple):
    num_tokens: int  # a multiple of page_size, < len(prompt)
    pages: list[int]  # the tree's pages holding those tokens, one per page
    handle: _Node  # lock/unlock this while the pages are in use


class Inserted(NamedTuple):
    num_cached: int  # tokens the tree held before this insert (their pages were shared or freed)
    handle: _Node  # the node ending at the inserted tokens; lock it to keep them


class RadixCache:
    def __init__(self, free_pages: Callable[[list[int]], None], *, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._free_pages = free_pages
        self._root = _Node(None, (), [])
        self._clock = 0
        self.cached_pages = 0
        self.protected_pages = 0

    @property
    def evictable_pages(self) -> int:
        return self.cached_pages - self.protected_pages

    # -- lookups -----------------------------------------------------------

    def match_prefix(self, prompt: Sequence[int]) -> Match:
        """The longest cached prefix of `prompt[:-1]`, in whole pages; touches its LRU time.

        A match ending inside an edge splits it, so the handle ends exactly at
        the match. The pages are lent, not given: lock the handle before use.
        """
        key = self._usable(prompt)
        self._clock += 1
        node, pos, pages = self._root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._common(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            pages += child.pages
            node, pos = child, pos + n
        return Match(pos, pages, node)

    def prefix_len(self, prompt: Sequence[int]) -> int:
        """What `match_prefix(prompt).num_tokens` would be, without touching the tree (for lpm)."""
        key = self._usable(prompt)
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            n = self._common(child.key, key, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def pages_of(self, handle: _Node) -> list[int]:
        """The tree's pages from the root to `handle`: a page table for its tokens."""
        runs = []
        while handle.parent is not None:
            runs.append(handle.pages)
            handle = handle.parent
        return [page for run in reversed(runs) for page in run]

    # -- locks -------------------------------------------------------------

    def lock(self, handle: _Node) -> None:
        """Keep the path from the root to `handle` from eviction until `unlock(handle)`."""
        self._check_live(handle)
        node = handle
        while node is not self._root:
            if node.lock_ref == 0:
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: _Node) -> None:
        self._check_live(handle)
        node = handle
        while node is not self._root:
            if node.lock_ref == 0:
                raise ValueError(f"unlock of {handle!r} without a matching lock")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_pages -= len(node.pages)
            node = node.parent

    # -- insert, evict, reset ---------------------------------------------

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> Inserted:
        """Add the whole pages of `tokens`; the tree takes `pages[:len(tokens) // page_size]`.

        Where the tree already holds a page of these tokens, the caller's page
        is shared (the same id) or a duplicate, which is freed through
        `free_pages` here. Returns how many tokens were cached already, and the
        handle ending at the inserted tokens.
        """
        size = self.page_size
        num_pages = len(tokens) // size
        if len(pages) < num_pages:
            raise ValueError(f"{len(tokens)} tokens need {num_pages} pages, got {len(pages)}")
        key = tuple(tokens[: num_pages * size])
        self._clock += 1
        node, pos, duplicates = self._root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                child = _Node(node, key[pos:], list(pages[pos // size : num_pages]))
                child.last_access = self._clock
                node.children[self._child_key(key, pos)] = child
                self.cached_pages += len(child.pages)
                return self._inserted(pos, child, duplicates)
            n = self._common(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            first = pos // size
            for i, theirs in enumerate(child.pages):
                if pages[first + i] != theirs:
                    duplicates.append(pages[first + i])
            node, pos = child, pos + n
        return self._inserted(pos, node, duplicates)

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` unlocked pages, least recently used leaves first.

        Frees whole edges, so may free more; frees fewer only when no more are
        evictable. Returns the number of pages freed.
        """
        if num_pages <= 0:
            return 0
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._unlocked_leaves()]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            leaf.parent = None  # a stale handle now fails loudly
            freed += leaf.pages
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.cached_pages -= len(freed)
        if freed:
            self._free_pages(freed)
        return len(freed)

    def reset(self) -> int:
        """Free every cached page and empty the tree; returns the number of pages freed."""
        if self.protected_pages:
            raise RadixCacheLocked(
                f"cannot reset the radix cache: {self.protected_pages} cached pages are "
                "locked by running requests; finish or abort them first"
            )
        freed: list[int] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            freed += node.pages
            node.parent = None
            stack.extend(node.children.values())
        self._root.children = {}
        self.cached_pages = 0
        if freed:
            self._free_pages(freed)
        return len(freed)

    # -- internals ---------------------------------------------------------

    def _usable(self, prompt: Sequence[int]) -> tuple[int, ...]:
        """The part of `prompt` a match may cover: whole pages, leaving the last token."""
        end = (len(prompt) - 1) // self.page_size * self.page_size
        return tuple(prompt[:end]) if end > 0 else ()

    def _child_key(self, key: tuple[int, ...], pos: int) -> object:
        if self.page_size == 1:
            return key[pos]
        return key[pos : pos + self.page_size]

    def _common(self, edge: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """How many leading tokens `edge` shares with `key[pos:]`, rounded down to whole pages."""
        n = min(len(edge), len(key) - pos)
        if edge[:n] != key[pos : pos + n]:
            n = next(i for i in range(n) if edge[i] != key[pos + i])
        return n - n % self.page_size

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after `n` tokens; returns the new node holding the first part."""
        parent, split_page = child.parent, n // self.page_size
        head = _Node(parent, child.key[:n], child.pages[:split_page])
        head.lock_ref = child.lock_ref
        head.last_access = child.last_access
        parent.children[self._child_key(child.key, 0)] = head
        child.key, child.pages, child.parent = child.key[n:], child.pages[split_page:], head
        head.children[self._child_key(child.key, 0)] = child
        return head

    def _inserted(self, num_cached: int, node: _Node, duplicates: list[int]) -> Inserted:
        if duplicates:
            self._free_pages(duplicates)
        return Inserted(num_cached, node)

    def _unlocked_leaves(self) -> list[_Node]:
        leaves, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def _check_live(self, handle: _Node) -> None:
        if handle.parent is None and handle is not self._root:
            raise ValueError(f"{handle!r} was evicted or reset; match again")

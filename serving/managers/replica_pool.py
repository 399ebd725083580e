"""The replicas a tokenizer manager sends requests to: one owner for the set.

A ``ReplicaPool`` holds, per replica, where its scheduler and detokenizer are,
whether it takes requests, where its scheduler journals its steps, and what
finished there; the ``Router`` that picks the replica of each new request; and
the questions asked of every replica at once (``call_all``). A server without
replicas is a pool of one. The tokenizer manager owns the pool: it routes,
releases and resumes through it; the runtime changes it only through its
methods (``set_up``, ``set_down``, ``set_addresses``, ``set_loading``); HTTP reads
``figures()``.

Replicas started elsewhere (``process: remote``: a pod, a Ray node) are
watched by the runtime's supervisors (``serving.runtime.replicas``), as the
local ones are: the pool hears what they saw through the same methods.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from actors import CallError, Context

from .journal import journal_path
from .router import Router

__all__ = ["Replica", "ReplicaPool"]

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """One replica as the front end knows it."""

    scheduler: str
    detokenizer: str | None
    journal: str | None  # where its scheduler journals its steps (None: it does not; see journal.py)
    remote: bool = False  # started elsewhere (watched by heartbeats)
    up: bool = True  # taking requests
    loading: bool = False  # (remote) it answers that it is loading its model: down until it serves
    prompt_tokens: int = 0  # of the requests that finished there
    cached_tokens: int = 0  # ...of those, served from its prefix cache


class ReplicaPool:
    def __init__(self, addresses: Sequence[Mapping[str, str | None]], *, router: Router | None = None,
                 serving: Collection[int] | None = None, journals: Sequence[str | None] | None = None,
                 remote: Collection[int] = (), remote_timeout: float = 10.0) -> None:
        """``addresses``: each replica's ``scheduler`` (and ``detokenizer``) address; ``serving``: those
        up now (default: all); ``journals``: each scheduler's step journal (default: where a scheduler at
        that address writes it); ``remote``: those started elsewhere."""
        if journals is None:
            journals = [journal_path(a["scheduler"]) for a in addresses]  # type: ignore[arg-type]
        self.replicas = [
            Replica(str(a["scheduler"]), a.get("detokenizer"), journal, remote=i in remote,
                    up=serving is None or i in serving)
            for i, (a, journal) in enumerate(zip(addresses, journals, strict=True))
        ]
        self.router = router or Router(len(self.replicas))
        assert self.router.replicas == len(self.replicas)
        self.remote_timeout = remote_timeout  # (how long a remote replica is waited for an answer)
        self.ctx: Context | None = None
        self._any_up = trio.Event()
        if self.serving():
            self._any_up.set()
        self._closed = False  # the runtime gave up: nothing waits for a replica any more

    @classmethod
    def of(cls, scheduler: str | Sequence[str], detokenizer: str | Sequence[str] | None = None,
           **options: Any) -> ReplicaPool:
        """A pool of the replicas at these addresses (one, or a list each)."""
        schedulers = [scheduler] if isinstance(scheduler, str) else list(scheduler)
        detokenizers = [detokenizer] if isinstance(detokenizer, str) else list(detokenizer or [None] * len(schedulers))
        return cls([{"scheduler": s, "detokenizer": d} for s, d in zip(schedulers, detokenizers, strict=True)],
                   **options)

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

    @property
    def remote(self) -> set[int]:
        return {i for i, r in enumerate(self.replicas) if r.remote}

    # -- up and down -------------------------------------------------------------------------

    @property
    def up(self) -> list[bool]:
        return [r.up for r in self.replicas]

    def serving(self) -> list[int]:
        """The replicas taking requests."""
        return [i for i, r in enumerate(self.replicas) if r.up]

    async def wait_any_up(self) -> bool:
        """Wait until a replica takes requests; False if the pool was closed meanwhile."""
        while not self.serving() and not self._closed:
            await self._any_up.wait()
        return not self._closed

    def set_up(self, index: int) -> None:
        self.replicas[index].up = True
        self._any_up.set()

    def set_down(self, index: int, *, cache_lost: bool) -> None:
        """``index`` takes no requests (``cache_lost``: its scheduler restarts: forget what was routed there)."""
        self.replicas[index].up = False
        if not self.serving() and self._any_up.is_set():
            self._any_up = trio.Event()
        if cache_lost:
            self.router.forget(index)

    def close(self) -> None:
        """The runtime gave up: whatever waits for a replica wakes."""
        self._closed = True
        self._any_up.set()

    def set_addresses(self, index: int, scheduler: str, detokenizer: str | None) -> None:
        """``index`` runs (again) at these addresses (a Ray actor started elsewhere)."""
        replica = self.replicas[index]
        replica.scheduler, replica.detokenizer = scheduler, detokenizer

    def set_loading(self, index: int, loading: bool) -> None:
        """Remote replica ``index`` answers that it is loading its model (it is down until it serves), or not."""
        self.replicas[index].loading = loading

    # -- routing -----------------------------------------------------------------------------

    def asked(self) -> int:
        """The replica a question goes to: the first up (the first, when none is)."""
        return next((i for i, r in enumerate(self.replicas) if r.up), 0)

    def route(self, tokens: Sequence[int]) -> int:
        """The replica (up) of a request with these tokens; counted as in flight there until ``release``."""
        return self.router.choose(tokens, self.serving())

    def release(self, index: int) -> None:
        self.router.release(index)

    def load(self, index: int) -> int:
        """Requests in flight on ``index``."""
        return self.router.load[index]

    def finished(self, index: int, prompt_tokens: int, cached_tokens: int) -> None:
        """A request finished on ``index`` with this many prompt tokens, these of them cached."""
        self.replicas[index].prompt_tokens += prompt_tokens
        self.replicas[index].cached_tokens += cached_tokens

    def figures(self) -> list[dict[str, Any]]:
        """Per replica: up, loading (a remote one that answers that it loads its model), requests in flight and routed there, prompt tokens finished there and
        the share of them served from its prefix cache."""
        return [{
            "replica": i, "up": r.up, "loading": r.loading, "in_flight": self.router.load[i], "routed": self.router.routed[i],
            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "cache_hit_rate": r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0,
        } for i, r in enumerate(self.replicas)]

    # -- questions ---------------------------------------------------------------------------

    def start(self, ctx: Context) -> None:
        """Ask through ``ctx`` (the tokenizer manager's) from now on."""
        self.ctx = ctx

    async def call(self, index: int, msg: Any, *, timeout: float = 10.0, detokenizer: bool = False,
                   reply: Any = None) -> Any:
        """Ask replica ``index``'s scheduler (or detokenizer); the reply as ``msg`` declares it (or ``reply``)."""
        replica = self.replicas[index]
        address = replica.detokenizer if detokenizer else replica.scheduler
        if address is None:
            raise CallError(f"replica {index}: no detokenizer address given")
        assert self.ctx is not None, "the pool asks once its tokenizer manager started"
        return await self.ctx.call(address, msg, timeout=timeout, reply=reply)

    async def call_all(self, msg: Any, *, timeout: float = 10.0, detokenizer: bool = False) -> dict[int, Any]:
        """Ask the scheduler (or the detokenizer) of every replica up, at once: each one's answer
        or the ``CallError`` it gave."""
        answers: dict[int, Any] = {}

        async def ask(index: int) -> None:
            try:
                answers[index] = await self.call(index, msg, timeout=timeout, detokenizer=detokenizer)
            except CallError as exc:
                answers[index] = exc

        async with trio.open_nursery() as nursery:
            for index in self.serving():
                nursery.start_soon(ask, index)
        return answers

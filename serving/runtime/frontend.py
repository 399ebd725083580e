"""The front end a topology describes: its tokenizer manager and the pool of
replicas that manager sends requests to (``serving.managers.replica_pool``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

import msgspec

from actors import WatchdogTimeout

from ..managers.messages import RuntimeStatus
from ..managers.replica_pool import ReplicaPool
from ..managers.router import Router, RouterConfig
from ..managers.tokenizer_manager import RequestLimits, TokenizerManager
from .topology import Topology

__all__ = ["make_replica_pool", "make_tokenizer_manager"]


def make_replica_pool(topology: Topology, replicas: list[dict[str, str]], *,
                      serving: Collection[int] | None = None) -> ReplicaPool:
    """The pool of ``replicas`` (each one's addresses), ``serving`` those up now (default: all)."""
    return ReplicaPool(
        replicas, router=Router(len(replicas), RouterConfig(**msgspec.structs.asdict(topology.router))),
        serving=serving, remote={i for i, r in enumerate(topology.replica_placements()) if r.scheduler.process == "remote"},
        remote_timeout=topology.watchdogs.remote_timeout)


def make_tokenizer_manager(topology: Topology, tokenizer: Any, addresses: dict[str, str], *, worker: int = 0,
                           replicas: list[dict[str, str]] | None = None, serving: Collection[int] | None = None,
                           on_stall: Callable[[WatchdogTimeout, int], None] | None = None,
                           on_status: Callable[[RuntimeStatus], Awaitable[None]] | None = None) -> TokenizerManager:
    """The tokenizer manager (of tokenizer worker ``worker``) that ``topology`` describes;
    ``replicas``: each replica's addresses (default: the one in ``addresses``), ``serving``:
    those up now (default: all)."""
    server = topology.server
    limits = RequestLimits(server.max_batch_size, server.max_samples, server.max_stop_strings,
                           server.max_stop_length, max_logprobs=server.max_logprobs)
    pool = make_replica_pool(topology, replicas or [addresses], serving=serving)
    return TokenizerManager(tokenizer, replicas=pool, worker=worker,
                            watchdog_timeout=topology.watchdogs.output_timeout, limits=limits,
                            quarantine_after=topology.supervision.quarantine_after,
                            trial_timeout=topology.supervision.trial_timeout, hold_timeout=server.request_wait,
                            request_timeout=server.request_timeout, on_stall=on_stall, on_status=on_status)

"""A tokenizer/HTTP worker process (``server.workers: N``): hypercorn on the
listening socket it inherited, its own TokenizerManager (mailbox
``tokenizer-i``), and a ``WorkerRuntime`` that mirrors the main process.

The main process (``serving.runtime.workers``) supervises everything and
sends each worker a ``RuntimeStatus`` after every supervisor event; the
worker copies it into its status tracker, opens or closes its gate
(pause, weight update), and resubmits its requests in flight after the
scheduler or the detokenizer restarted. Server-wide admin (pause, weight
update) and output stalls go to the main process's coordinator.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import msgspec
import trio
from hypercorn.trio import serve

from actors import ActorChild, WatchdogTimeout
from models.loading import load_tokenizer

from ..managers.messages import RuntimeStatus, SetPaused, UpdateWeightsAll, WeightsResult, WorkerStalled
from ..managers.tokenizer_manager import TokenizerManager
from ..runtime.interface import Gate, StatusTracker, TokenizerManagerSlot
from ..runtime.frontend import make_tokenizer_manager
from ..runtime.topology import Topology, tokenizer_source
from .app import build_app, hypercorn_config
from .metrics import Metrics

__all__ = ["HttpWorker", "WorkerRuntime", "worker_child"]

log = logging.getLogger(__name__)


class WorkerRuntime:
    """A worker's ``Runtime``: its tokenizer manager, and the main process's status."""

    def __init__(self, topology: Topology, tokenizer: Any, worker: int, addresses: dict[str, str], hub: Any,
                 metrics: Metrics) -> None:
        self.topology = topology
        self.tokenizer = tokenizer
        self.worker = worker
        self.addresses = addresses
        self.control = addresses["control"]
        self.metrics = metrics
        self.status = StatusTracker()
        self.gate = Gate()
        self._tm = TokenizerManagerSlot(lambda: make_tokenizer_manager(
            topology, tokenizer, addresses, worker=worker, on_stall=self._stalled, on_status=self.apply))
        self.tokenizer_manager_child = ActorChild(self._tm.build, addresses["tokenizer"], hub)

    @property
    def tokenizer_manager(self) -> TokenizerManager:
        return self._tm.current

    async def set_paused(self, paused: bool) -> None:
        """Pause or continue every worker (through the main process); this one at once."""
        self.gate.set_closed(paused)
        await self.tokenizer_manager.ctx.call(self.control, SetPaused(paused), timeout=10.0)

    async def update_weights(self, path: str) -> WeightsResult:
        return await self.tokenizer_manager.ctx.call(self.control, UpdateWeightsAll(path), timeout=660.0)

    async def apply(self, status: RuntimeStatus) -> None:
        """News from the main process (the tokenizer manager's RuntimeStatus handler)."""
        tm = self.tokenizer_manager
        self.status.apply(status)
        if self.worker == 0:  # one worker observes the server's recoveries
            for seconds in self.status.take_recoveries():
                self.metrics.recovery.observe(seconds)
        if status.failure is not None:
            count = tm.fail_all(f"the server failed: {status.failure}")
            log.critical("runtime failed (%s); ended %d requests in flight", status.failure, count)
            return
        self.gate.set_closed(status.paused or status.updating)
        if status.resume and status.scheduler_up:
            tm.feed_watchdogs()  # the new scheduler gets a full timeout
            await tm.resubmit_in_flight(status.crash or "a restart downstream")
            self.metrics.resumed.set(tm.resumed)

    def end_requests(self, message: str) -> None:
        """End every request in flight with a 503 (an orderly stop)."""
        if self._tm.started:
            self._tm.current.fail_all(message)

    def _stalled(self, report: WatchdogTimeout, replica: int = 0) -> None:
        tm = self.tokenizer_manager
        tm.ctx.nursery.start_soon(partial(tm.ctx.send, self.control, WorkerStalled(self.worker, str(report))))


class HttpWorker:
    """A supervisor child (in its own process): the worker's runtime and hypercorn on the shared socket."""

    def __init__(self, hub: Any, topology: Topology, index: int, addresses: dict[str, str], listen_fd: int) -> None:
        self.hub = hub
        self.topology = topology
        self.index = index
        self.addresses = addresses
        self.listen_fd = listen_fd
        self.runtime: WorkerRuntime | None = None
        self._stopping = trio.Event()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        tokenizer = await trio.to_thread.run_sync(load_tokenizer, tokenizer_source(self.topology.model))
        metrics = Metrics()
        runtime = self.runtime = WorkerRuntime(self.topology, tokenizer, self.index, self.addresses, self.hub,
                                               metrics)

        @asynccontextmanager
        async def opened() -> AsyncIterator[WorkerRuntime]:
            yield runtime

        app = build_app(self.topology, opened, metrics=metrics)
        config = hypercorn_config(f"fd://{self.listen_fd}")

        async def serve_http(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await serve(app, config, shutdown_trigger=self._stopping.wait, task_status=task_status)
            finally:
                await runtime.tokenizer_manager_child.stop()

        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.tokenizer_manager_child.run)
            await nursery.start(serve_http)
            log.info("tokenizer worker %d serving (mailbox %s)", self.index, self.addresses["tokenizer"])
            task_status.started(self)

    async def stop(self) -> None:
        if self.runtime is not None:
            self.runtime.end_requests("the server is shutting down")
        self._stopping.set()
        await trio.lowlevel.checkpoint()


def worker_child(hub: Any, *, index: int, topology: dict[str, Any], addresses: dict[str, str],
                 listen_fd: int) -> HttpWorker:
    """A tokenizer worker as a supervisor child (run in a child process); ``addresses``:
    its own mailbox (``tokenizer``), the scheduler's, the detokenizer's and the coordinator's."""
    return HttpWorker(hub, msgspec.convert(topology, Topology), index, addresses, listen_fd)

"""Several tokenizer/HTTP workers in front of one scheduler (``server.workers: N``).

SGLang's ``tokenizer_worker_num``: N worker processes share one listening
socket (the main process binds it and each worker inherits it, so the port
stays open while a worker restarts). Each worker runs the Starlette app on
hypercorn and its own TokenizerManager, whose mailbox is ``tokenizer-i``;
requests carry ``worker = i`` and the detokenizer sends each output to the
worker that owns the request.

This module is the main process's side (the worker's side is
``serving.http.worker``). The main process runs the supervisor, a
``Coordinator`` (the control mailbox) and a ``StatusBroadcaster``, and serves
no HTTP. After every supervisor event it sends each worker a ``RuntimeStatus``
(scheduler up or down, restarts, failure; ``resume`` after the scheduler or
the detokenizer restarted, so each worker resubmits what it has in flight).
A worker whose outputs stall reports ``WorkerStalled``; the coordinator
kills the scheduler as the single-process soft watchdog would.

A worker that dies is restarted; before its new process starts, the
scheduler aborts every request of that worker index and frees their KV
cache (``AbortWhere(worker=i)``), so the new process starts clean.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import trio

from actors import Actor, ActorChild, CallError, ChildSpec, Context, SupervisorEvent
from actors.process import ProcessChild

from ..managers.messages import (
    AbortWhere,
    ControlInbox,
    RuntimeStatus,
    ServerInfoReq,
    SetPaused,
    UpdateWeightsAll,
    UpdateWeightsReq,
    WeightsResult,
    WorkerStalled,
)
from .interface import StatusTracker
from .launch import Supervised, open_supervised
from .specs import core_specs, make_supervisor
from .topology import Topology

__all__ = ["Coordinator", "OutputStalled", "StatusBroadcaster", "WorkerPool", "open_worker_pool"]

log = logging.getLogger(__name__)


class OutputStalled(Exception):
    """A tokenizer worker saw no output for its watchdog's timeout with requests in flight."""


class WorkerPool(Supervised):
    """The main process of a server with tokenizer workers: the scheduler, the
    detokenizer, the coordinator and N worker processes under one supervisor.
    Every change of status goes to every worker (``RuntimeStatus``)."""

    def __init__(self, topology: Topology, tokenizer: Any, runtime_dir: Path, hub: Any, listen_fd: int) -> None:
        super().__init__(topology, tokenizer, runtime_dir)
        self.paused = False  # the server-wide gates, as every worker is told
        self.updating = False
        self.addresses["control"] = f"ipc://{runtime_dir}/control"
        self.worker_addresses = topology.worker_addresses(runtime_dir)
        self.broadcaster = StatusBroadcaster(hub, self.worker_addresses)
        metrics_dir = runtime_dir / "metrics"
        metrics_dir.mkdir()
        # the workers keep their Prometheus figures there, so any of them reports the sum
        self._env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
        self._hub = hub
        self._listen_fd = listen_fd
        self._coordinator: ActorChild | None = None
        grace = topology.supervision.shutdown_grace
        specs = core_specs(topology, self.addresses, self.worker_addresses, hub, tokenizer, lambda: self.weights)
        specs.append(ChildSpec("control", self._start_coordinator, shutdown=grace))
        specs += [ChildSpec(f"worker-{i}", self._worker_starter(i), shutdown=grace)
                  for i in range(len(self.worker_addresses))]
        self.supervisor = make_supervisor(topology, specs, self._on_event)
        self.status = StatusTracker(self.supervisor)

    async def supervise(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.broadcaster.run)
            try:
                await super().supervise(task_status=task_status)
            finally:
                self.broadcaster.close()  # the broadcaster sends what is queued and returns

    # -- the gates, server-wide ----------------------------------------------------------

    def publish(self, *, crash: str | None = None) -> None:
        """Tell every worker how things stand (``crash``: and to resume their requests after it)."""
        if self.status.failure is None:
            self.broadcaster.publish(self.status.snapshot(crash=crash, paused=self.paused,
                                                          updating=self.updating))

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        self.publish()

    def set_updating(self, updating: bool) -> None:
        self.updating = updating
        self.publish()

    # -- children ------------------------------------------------------------------------

    def _start_coordinator(self) -> ActorChild:
        self._coordinator = ActorChild(lambda: Coordinator(self.addresses["scheduler"], self),
                                       self.addresses["control"], self._hub)
        return self._coordinator

    def _worker_starter(self, index: int) -> Any:
        starts = 0

        def start() -> _WorkerProcess:
            nonlocal starts
            starts += 1
            addresses = {"tokenizer": self.worker_addresses[index],
                         **{name: self.addresses[name] for name in ("scheduler", "detokenizer", "control")}}
            args = {"index": index, "topology": msgspec.to_builtins(self.topology), "addresses": addresses,
                    "listen_fd": self._listen_fd}
            process = ProcessChild("serving.http.worker:worker_child", args, name=f"worker-{index}",
                                   kill_after=self.topology.supervision.shutdown_grace,
                                   pass_fds=(self._listen_fd,), env=self._env, hub=self._hub.options)
            return _WorkerProcess(index, process, self, restart=starts > 1)

        return start

    async def abort_worker(self, index: int) -> int:
        """Before a dead worker's successor starts: abort its requests in the scheduler."""
        actor = self._coordinator.actor if self._coordinator is not None else None
        if not isinstance(actor, Coordinator):
            return 0
        return await actor.abort_worker(index, f"tokenizer worker {index} died")

    # -- events ----------------------------------------------------------------------------

    def _changed(self, event: SupervisorEvent, *, crash: str | None) -> None:
        self.publish(crash=crash)  # the workers hear of every event

    def _failed(self, failure: BaseException) -> None:
        log.critical("runtime failed (%r); the tokenizer workers end their requests", failure)
        self.broadcaster.publish(self.status.snapshot(paused=self.paused, updating=self.updating))


class Coordinator(Actor):
    """The main process's mailbox: stall reports and server-wide admin from the
    workers; aborts for dead workers."""

    inbox = ControlInbox

    def __init__(self, scheduler: str, pool: WorkerPool) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.ctx: Context | None = None

    async def on_start(self, ctx: Context) -> None:
        self.ctx = ctx

    async def handle(self, msg: Any) -> Any:
        match msg:
            case WorkerStalled(worker, message):
                log.error("tokenizer worker %d: %s", worker, message)
                self.pool.kill_scheduler(OutputStalled(f"tokenizer worker {worker}: {message}"))
            case SetPaused(paused):
                self.pool.set_paused(paused)
                return paused
            case UpdateWeightsAll(path):
                return await self._update_weights(path, self.pool.topology.server.weights_drain_timeout)
        return None

    async def _update_weights(self, path: str, timeout: float) -> WeightsResult:
        """Like the single-process reader/writer gate, across workers: close every
        worker's gate, wait until the scheduler holds no request (those in flight
        finish on the old weights), load, open the gates."""
        assert self.ctx is not None
        self.pool.set_updating(True)
        try:
            with trio.move_on_after(timeout):
                while True:
                    info = await self.ctx.call(self.scheduler, ServerInfoReq(), timeout=10.0)
                    if info.waiting == 0 and info.running == 0:
                        result = await self.ctx.call(self.scheduler, UpdateWeightsReq(path), timeout=600.0)
                        if result.success:
                            self.pool.weights = path  # a restarted scheduler loads these
                        if result.success or "in flight" not in result.message:
                            return result
                    await trio.sleep(0.05)  # draining: poll the scheduler's queues
            return WeightsResult(False, f"requests still in flight after {timeout:g} s; the old weights keep serving",
                                 status=409)
        except CallError as exc:
            return WeightsResult(False, f"the scheduler did not answer: {exc}")
        finally:
            self.pool.set_updating(False)

    async def abort_worker(self, worker: int, message: str) -> int:
        """Abort every request of ``worker`` in the scheduler; how many (0 if it does not answer)."""
        assert self.ctx is not None
        try:
            count = await self.ctx.call(self.scheduler, AbortWhere(worker=worker, message=message), timeout=5.0)
        except CallError as exc:  # restarting: it holds no request of anyone
            log.warning("could not abort the requests of worker %d: %s", worker, exc)
            return 0
        log.warning("tokenizer worker %d died; the scheduler aborted its %d requests", worker, count)
        return count


class StatusBroadcaster:
    """Sends each RuntimeStatus to every worker, in order, from one task.

    A worker that does not take a status within ``SEND_TIMEOUT`` s (restarting, or swamped) does not
    hold up the others; it is owed that status, which goes to it again every ``SEND_TIMEOUT`` s until
    it is taken, folded into any newer one (a ``resume`` owed stays a resume: a worker that missed it
    would never resubmit its requests; round 1's L9)."""

    def __init__(self, hub: Any, addresses: list[str]) -> None:
        self.hub = hub
        self.addresses = addresses
        self._send, self._receive = trio.open_memory_channel[RuntimeStatus](math.inf)
        self._senders: dict[str, Any] = {}
        self.owed: dict[str, RuntimeStatus] = {}  # per worker, the status it has not taken yet

    def publish(self, status: RuntimeStatus) -> None:
        self._send.send_nowait(status)

    def close(self) -> None:
        """No more news: ``run`` sends what is queued and returns."""
        self._send.close()

    async def run(self) -> None:
        try:
            while True:
                status = None
                with trio.move_on_after(SEND_TIMEOUT if self.owed else math.inf):
                    try:
                        status = await self._receive.receive()
                    except trio.EndOfChannel:
                        break
                if status is not None:
                    for address in self.addresses:
                        await self._deliver(address, status)
                else:  # idle: what is owed, again
                    for address, owed in list(self.owed.items()):
                        await self._deliver(address, owed)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                for sender in self._senders.values():
                    await sender.aclose()

    async def _deliver(self, address: str, status: RuntimeStatus) -> None:
        owed = self.owed.pop(address, None)
        if owed is not None and owed.resume and not status.resume:
            status = msgspec.structs.replace(status, resume=True, crash=status.crash or owed.crash)
        with trio.move_on_after(SEND_TIMEOUT) as waited:  # a worker that is not there does not stop the rest
            sender = self._senders.get(address)
            if sender is None:
                sender = self._senders[address] = await self.hub.connect(address)
            await sender.send(status)
        if waited.cancelled_caught:
            self.owed[address] = status
            log.warning("runtime status to %s not sent within %g s; sent again until it is taken",
                        address, SEND_TIMEOUT)


SEND_TIMEOUT = 1.0  # the longest a status waits for one worker before the next worker gets it


class _WorkerProcess:
    """A worker's process; on a restart, the scheduler first forgets the dead one's requests."""

    def __init__(self, index: int, process: ProcessChild, pool: WorkerPool, restart: bool) -> None:
        self.index = index
        self.process = process
        self.pool = pool
        self.restart = restart

    @property
    def pid(self) -> int | None:
        return self.process.pid

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        if self.restart:
            await self.pool.abort_worker(self.index)
        await self.process.run(task_status=task_status)

    async def stop(self) -> None:
        await self.process.stop()


@asynccontextmanager
async def open_worker_pool(topology: Topology, listen_fd: int) -> AsyncIterator[WorkerPool]:
    """Start ``topology`` with ``server.workers`` tokenizer worker processes serving HTTP
    on ``listen_fd`` (a listening socket they inherit); stop it after."""

    def build(tokenizer: Any, runtime_dir: Path, hub: Any, nursery: trio.Nursery) -> WorkerPool:
        return WorkerPool(topology, tokenizer, runtime_dir, hub, listen_fd)

    async with open_supervised(topology, build) as pool:
        yield pool

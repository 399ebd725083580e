"""Several tokenizer/HTTP workers in front of one scheduler (``server.workers: N``).

SGLang's ``tokenizer_worker_num``: N worker processes share one listening
socket (the main process binds it and each worker inherits it, so the port
stays open while a worker restarts). Each worker runs the Starlette app on
hypercorn and its own TokenizerManager, whose mailbox is ``tokenizer-i``;
requests carry ``worker = i`` and the detokenizer sends each output to the
worker that owns the request.

The main process runs the supervisor and a ``Coordinator``, and serves no
HTTP. After every supervisor event it sends each worker a ``RuntimeStatus``
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
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import trio

from actors import Actor, ActorChild, CallError, ChildSpec, Context, WatchdogTimeout
from actors.process import ProcessChild

from .messages import (
    AbortWhere,
    ControlInbox,
    RuntimeStatus,
    ServerInfoReq,
    SetPaused,
    UpdateWeightsAll,
    UpdateWeightsReq,
    WorkerStalled,
)
from .tokenizer_manager import TokenizerManager
from .topology import Topology, tokenizer_source

__all__ = ["Coordinator", "HttpWorker", "OutputStalled", "StatusBroadcaster", "WorkerRuntime",
           "worker_child", "worker_specs"]

log = logging.getLogger("serving.workers")


class OutputStalled(Exception):
    """A tokenizer worker saw no output for its watchdog's timeout with requests in flight."""


# -- the main process ------------------------------------------------------------


class Coordinator(Actor):
    """The main process's mailbox: stall reports and server-wide admin from workers;
    aborts for dead workers. ``engine`` is the main process's AsyncEngine."""

    inbox = ControlInbox

    def __init__(self, scheduler: str, engine: Callable[[], Any]) -> None:
        self.scheduler = scheduler
        self.engine = engine
        self.ctx: Context | None = None

    async def on_start(self, ctx: Context) -> None:
        self.ctx = ctx

    async def handle(self, msg: Any) -> Any:
        engine = self.engine()
        match msg:
            case WorkerStalled(worker, message):
                log.error("tokenizer worker %d: %s", worker, message)
                engine.supervisor.kill("scheduler", OutputStalled(f"tokenizer worker {worker}: {message}"))
            case SetPaused(paused):
                engine.paused = paused
                engine.publish()
                return paused
            case UpdateWeightsAll(path, timeout):
                return await self._update_weights(engine, path, timeout)
        return None

    async def _update_weights(self, engine: Any, path: str, timeout: float) -> dict[str, Any]:
        """Like the single-process reader/writer lock, across workers: close every
        worker's gate, wait until the scheduler holds no request (those in flight
        finish on the old weights), load, open the gates."""
        assert self.ctx is not None
        engine.updating = True
        engine.publish()
        try:
            with trio.move_on_after(timeout):
                while True:
                    info = await self.ctx.call(self.scheduler, ServerInfoReq(), timeout=10.0)
                    if info["waiting"] == 0 and info["running"] == 0:
                        result = await self.ctx.call(self.scheduler, UpdateWeightsReq(path), timeout=timeout)
                        if result["success"] or "in flight" not in result["message"]:
                            return result
                    await trio.sleep(0.05)  # draining: poll the scheduler's queues
            return {"success": False, "message": f"requests still in flight after {timeout:g} s"}
        except CallError as exc:
            return {"success": False, "message": f"the scheduler did not answer: {exc}"}
        finally:
            engine.updating = False
            engine.publish()

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
    """Sends each RuntimeStatus to every worker, in order, from one task."""

    def __init__(self, hub: Any, addresses: list[str]) -> None:
        self.hub = hub
        self.addresses = addresses
        self._send, self._receive = trio.open_memory_channel[RuntimeStatus](math.inf)
        self._senders: dict[str, Any] = {}

    def publish(self, status: RuntimeStatus) -> None:
        self._send.send_nowait(status)

    def close(self) -> None:
        """No more news: ``run`` sends what is queued and returns."""
        self._send.close()

    async def run(self) -> None:
        try:
            async for status in self._receive:
                for address in self.addresses:
                    with trio.move_on_after(1.0) as waited:  # a worker that is not there does not stop the rest
                        sender = self._senders.get(address)
                        if sender is None:
                            sender = self._senders[address] = await self.hub.connect(address)
                        await sender.send(status)
                    if waited.cancelled_caught:
                        log.warning("runtime status to %s not sent within 1 s", address)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                for sender in self._senders.values():
                    await sender.aclose()


class _WorkerProcess:
    """A worker's process; on a restart, the scheduler first forgets the dead one's requests."""

    def __init__(self, index: int, process: ProcessChild, coordinator: Callable[[], Coordinator | None],
                 restart: bool) -> None:
        self.index = index
        self.process = process
        self.coordinator = coordinator
        self.restart = restart

    @property
    def pid(self) -> int | None:
        return self.process.pid

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        coordinator = self.coordinator()
        if self.restart and coordinator is not None:
            await coordinator.abort_worker(self.index, f"tokenizer worker {self.index} died")
        await self.process.run(task_status=task_status)

    async def stop(self) -> None:
        await self.process.stop()


def worker_specs(topology: Topology, addresses: dict[str, str], workers: list[str], hub: Any,
                 listen_fd: int, engine: Callable[[], Any], metrics_dir: str) -> list[ChildSpec]:
    """The coordinator and the N worker processes, in start order. The workers keep
    their Prometheus figures in ``metrics_dir`` (so any of them reports the sum)."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    grace = topology.supervision.shutdown_grace
    control = addresses["control"]
    coordinator_child: list[ActorChild] = []

    def coordinator() -> Coordinator | None:
        actor = coordinator_child[-1].actor if coordinator_child else None
        return actor if isinstance(actor, Coordinator) else None

    def start_coordinator() -> ActorChild:
        child = ActorChild(lambda: Coordinator(addresses["scheduler"], engine), control, hub)
        coordinator_child[:] = [child]
        return child

    def start_worker(index: int) -> Callable[[], _WorkerProcess]:
        starts = 0

        def start() -> _WorkerProcess:
            nonlocal starts
            starts += 1
            args = {"index": index, "topology": msgspec.to_builtins(topology), "address": workers[index],
                    "scheduler": addresses["scheduler"], "detokenizer": addresses["detokenizer"],
                    "control": control, "listen_fd": listen_fd}
            process = ProcessChild("serving.workers:worker_child", args, name=f"worker-{index}",
                                   kill_after=grace, pass_fds=(listen_fd,), env=env)
            return _WorkerProcess(index, process, coordinator, restart=starts > 1)

        return start

    specs = [ChildSpec("control", start_coordinator, shutdown=grace)]
    specs += [ChildSpec(f"worker-{i}", start_worker(i), shutdown=grace) for i in range(len(workers))]
    return specs


# -- a worker process --------------------------------------------------------------


class WorkerRuntime:
    """What the HTTP routes of a worker see of the runtime (AsyncEngine's face),
    kept up to date by the main process's RuntimeStatus messages."""

    def __init__(self, topology: Topology, tokenizer: Any, worker: int, control: str) -> None:
        self.topology = topology
        self.tokenizer = tokenizer
        self.worker = worker
        self.control = control
        self.on_gate: Callable[[bool], None] | None = None  # the HTTP state's gate: closed or open
        self.on_resumed: Callable[[int], None] | None = None  # metrics: requests this worker resumed
        self.on_recovery: Callable[[float], None] | None = None  # metrics: a recovery, in seconds
        self._recoveries_seen: int | None = None
        self.tokenizer_manager: TokenizerManager | None = None
        self.failure: BaseException | None = None
        self.failed = trio.Event()
        self._up = trio.Event()
        self._up.set()  # workers start after the scheduler
        self._running = True
        self.restarts: dict[str, int] = {}
        self.crashes: dict[tuple[str, str], int] = {}
        self.recoveries: list[float] = []
        self._pids: dict[str, int] = {}

    async def scheduler_up(self) -> None:
        await self._up.wait()

    def scheduler_running(self) -> bool:
        return self._running

    def pids(self) -> dict[str, int]:
        return dict(self._pids)

    async def set_paused(self, paused: bool) -> None:
        """Pause or continue every worker (through the main process)."""
        if self.on_gate is not None:
            self.on_gate(paused)  # this one at once
        await self._call_control(SetPaused(paused), timeout=10.0)

    async def update_weights(self, path: str) -> dict[str, Any]:
        return await self._call_control(UpdateWeightsAll(path), timeout=660.0)

    async def _call_control(self, msg: Any, *, timeout: float) -> Any:
        tm = self.tokenizer_manager
        assert tm is not None
        return await tm.ctx.call(self.control, msg, timeout=timeout)

    async def apply(self, status: RuntimeStatus) -> None:
        tm = self.tokenizer_manager
        assert tm is not None
        self.restarts = dict(status.restarts)
        self.crashes = {(actor, cause): count for actor, cause, count in status.crashes}
        self.recoveries = list(status.recoveries)
        if self._recoveries_seen is None:  # those before this process started: its predecessor's
            self._recoveries_seen = len(self.recoveries)
        for seconds in self.recoveries[self._recoveries_seen :]:
            if self.on_recovery is not None:
                self.on_recovery(seconds)
        self._recoveries_seen = len(self.recoveries)
        self._pids = dict(status.pids)
        if self.failure is not None:
            return
        if status.failure is not None:
            self.failure = RuntimeError(status.failure)
            self.failed.set()
            self._running = False
            self._up.set()  # wake the waiters: they will find the failure
            count = tm.fail_all(f"the server failed: {status.failure}")
            log.critical("runtime failed (%s); ended %d requests in flight", status.failure, count)
            return
        if self.on_gate is not None:
            self.on_gate(status.paused or status.updating)
        self._running = status.scheduler_up
        if status.scheduler_up:
            self._up.set()
        elif self._up.is_set():
            self._up = trio.Event()
        if status.resume and status.scheduler_up:
            tm.watchdog.feed()  # the new scheduler gets a full timeout
            await tm.resubmit_in_flight()
            if self.on_resumed is not None:
                self.on_resumed(tm.resumed)


class HttpWorker:
    """A supervisor child (in its own process): the TokenizerManager and hypercorn on the shared socket."""

    def __init__(self, hub: Any, topology: Topology, index: int, address: str, scheduler: str,
                 detokenizer: str, control: str, listen_fd: int) -> None:
        self.hub = hub
        self.topology = topology
        self.index = index
        self.address = address
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.control = control
        self.listen_fd = listen_fd
        self.runtime: WorkerRuntime | None = None
        self._stopping = trio.Event()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        from hypercorn.config import Config
        from hypercorn.trio import serve

        from models.loading import load_tokenizer

        from .http_server import build_app

        tokenizer = await trio.to_thread.run_sync(load_tokenizer, tokenizer_source(self.topology.model))
        runtime = self.runtime = WorkerRuntime(self.topology, tokenizer, self.index, self.control)
        tm_child = ActorChild(lambda: TokenizerManager(
            tokenizer, scheduler=self.scheduler, detokenizer=self.detokenizer, worker=self.index,
            watchdog_timeout=self.topology.watchdogs.output_timeout,
            on_stall=self._stalled, on_status=runtime.apply), self.address, self.hub)

        config = Config()
        config.bind = [f"fd://{self.listen_fd}"]
        config.accesslog = None
        config.graceful_timeout = 5.0
        app = build_app(self.topology, runtime=runtime)

        async def serve_http(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await serve(app, config, shutdown_trigger=self._stopping.wait, task_status=task_status)
            finally:
                await tm_child.stop()

        async with trio.open_nursery() as nursery:
            await nursery.start(tm_child.run)
            runtime.tokenizer_manager = tm_child.actor  # type: ignore[assignment]
            await nursery.start(serve_http)
            log.info("tokenizer worker %d serving (mailbox %s)", self.index, self.address)
            task_status.started(self)

    def _stalled(self, report: WatchdogTimeout) -> None:
        tm = self.runtime.tokenizer_manager if self.runtime is not None else None
        if tm is not None:
            tm.ctx.nursery.start_soon(partial(tm.ctx.send, self.control, WorkerStalled(self.index, str(report))))

    async def stop(self) -> None:
        runtime = self.runtime
        if runtime is not None and runtime.tokenizer_manager is not None:
            runtime.tokenizer_manager.fail_all("the server is shutting down")
        self._stopping.set()
        await trio.lowlevel.checkpoint()


def worker_child(hub: Any, *, index: int, topology: dict[str, Any], address: str, scheduler: str,
                 detokenizer: str, control: str, listen_fd: int) -> HttpWorker:
    """A tokenizer worker as a supervisor child (run in a child process)."""
    return HttpWorker(hub, msgspec.convert(topology, Topology), index, address, scheduler, detokenizer, control,
                      listen_fd)

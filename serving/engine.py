"""The offline Engine: a whole topology in this process's hands, no HTTP.

``open_engine`` (async, inside trio) starts the three managers under a
supervisor — all in this process over ``inproc://`` links, or the scheduler
and detokenizer in child processes over ``ipc://`` — and yields an
``AsyncEngine``. ``Engine`` is the synchronous face: it runs the same thing
on a background thread::

    with Engine(model="tiny") as engine:
        print(engine.generate(["Hello"], {"max_new_tokens": 8})[0]["text"])
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import trio

from actors import ActorChild, ChildSpec, RestartIntensityExceeded, Supervisor, SupervisorEvent
from transports import open_hub

from .messages import RuntimeStatus, SamplingParams
from .tokenizer_manager import Chunk, GenerateInput, TokenizerManager, fold
from .topology import (
    ActorsSection,
    ModelSection,
    Placement,
    SchedulerSection,
    Topology,
    build_children,
    make_supervisor,
    tokenizer_source,
)

__all__ = ["AsyncEngine", "Engine", "open_engine", "open_runtime", "topology_for"]

log = logging.getLogger("serving.engine")


class AsyncEngine:
    """A running topology. With tokenizer workers (``server.workers > 1``) the
    tokenizer managers live in the workers and ``tokenizer_manager`` is absent."""

    worker: int | None = None  # the tokenizer worker this is (a worker's runtime has one)

    def __init__(self, supervisor: Supervisor, addresses: dict[str, str], topology: Topology,
                 tokenizer: Any) -> None:
        self.supervisor = supervisor
        self.addresses = addresses
        self.topology = topology
        self.tokenizer = tokenizer
        self.failure: BaseException | None = None  # set when the supervisor gave up
        self.failed = trio.Event()
        self.recoveries: list[float] = []  # seconds from a crash to the restarted child's readiness
        self._tokenizer_manager: TokenizerManager | None = None
        self._scheduler_up = trio.Event()
        self._scheduler_up.set()
        self.starts: dict[str, int] = {}
        self.crashes: dict[tuple[str, str], int] = {}  # (actor, cause) → count
        self._start_seen = trio.Event()
        self.broadcaster: Any = None  # tokenizer workers: where their RuntimeStatus goes
        self.paused = False  # tokenizer workers: their shared gates
        self.updating = False

    @property
    def restarts(self) -> dict[str, int]:
        return dict(self.supervisor.restarts)

    def scheduler_running(self) -> bool:
        return "scheduler" in self.supervisor.running() and self.failure is None

    def pids(self) -> dict[str, int]:
        pids = {name: getattr(self.supervisor.child(name), "pid", None) for name in self.supervisor.running()}
        return {name: pid for name, pid in pids.items() if pid}

    def status(self, *, resume: bool = False) -> RuntimeStatus:
        return RuntimeStatus(
            scheduler_up=self._scheduler_up.is_set() and self.scheduler_running(), resume=resume,
            failure=None if self.failure is None else str(self.failure), restarts=self.restarts,
            crashes=[(actor, cause, count) for (actor, cause), count in self.crashes.items()],
            recoveries=list(self.recoveries), pids=self.pids(), paused=self.paused, updating=self.updating,
        )

    def publish(self) -> None:
        """Tell the tokenizer workers how things stand (after a change made here)."""
        if self.broadcaster is not None and self.failure is None:
            self.broadcaster.publish(self.status())

    async def started(self, child: str, times: int) -> None:
        """Wait until ``child`` has started ``times`` times (1: its first start)."""
        while self.starts.get(child, 0) < times and self.failure is None:
            self._start_seen = trio.Event()
            await self._start_seen.wait()

    def _record_start(self, child: str) -> None:
        self.starts[child] = self.starts.get(child, 0) + 1
        self._start_seen.set()

    async def scheduler_up(self) -> None:
        """Return once the scheduler is running (at once, usually) or the runtime failed."""
        await self._scheduler_up.wait()

    def _scheduler_event(self, kind: str) -> None:
        if kind in ("crashed", "exited", "restarting") and self._scheduler_up.is_set():
            self._scheduler_up = trio.Event()
        elif kind == "started":
            self._scheduler_up.set()

    @property
    def tokenizer_manager(self) -> TokenizerManager:
        assert self._tokenizer_manager is not None
        return self._tokenizer_manager

    def fail(self, failure: BaseException) -> None:
        """The runtime is beyond repair: end every request with an error, now."""
        self.failure = failure
        self.failed.set()
        self._scheduler_up.set()  # wake the waiters: they will find the failure
        self._start_seen.set()
        if self._tokenizer_manager is not None:
            count = self._tokenizer_manager.fail_all(f"the server failed: {failure}")
            log.critical("runtime failed (%r); ended %d requests in flight", failure, count)
        if self.broadcaster is not None:
            log.critical("runtime failed (%r); the tokenizer workers end their requests", failure)
            self.broadcaster.publish(self.status())

    async def stream(self, obj: GenerateInput) -> AsyncIterator[Chunk]:
        async for chunk in self.tokenizer_manager.generate(obj):
            yield chunk

    async def generate(self, prompts: str | list[str] | list[list[int]],
                       sampling_params: dict[str, Any] | SamplingParams | None = None,
                       **options: Any) -> list[dict[str, Any]]:
        """Run prompts (text, or token id lists) to completion; one result per sub-request."""
        params = msgspec.convert(sampling_params or {}, SamplingParams) \
            if not isinstance(sampling_params, SamplingParams) else sampling_params
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if batch and isinstance(batch[0], str):
            obj = GenerateInput(text=batch, sampling_params=params, **options)
        else:
            obj = GenerateInput(input_ids=batch, sampling_params=params, **options)
        chunks: dict[int, list[Chunk]] = {}
        async for chunk in self.stream(obj):
            chunks.setdefault(chunk.index, []).append(chunk)
        return [fold(chunks[i]) for i in sorted(chunks)]


def topology_for(model: str | None, *, processes: bool = False, **scheduler_options: Any) -> Topology:
    """A topology from keyword options: one process (inproc), or three (ipc)."""
    where = "child" if processes else "main"
    scheme = "ipc://{runtime_dir}/" if processes else "inproc://"
    kv = scheduler_options.pop("kv_budget_bytes", None)
    dtype = scheduler_options.pop("dtype", "bfloat16")
    scheduler = msgspec.convert(scheduler_options, SchedulerSection)
    if kv is not None:
        scheduler = msgspec.structs.replace(scheduler, kv_budget=kv)
    actors = ActorsSection(
        Placement(scheme + "scheduler", where), Placement(scheme + "detokenizer", where),
        Placement(scheme + "tokenizer", "main"),
    )
    return Topology(model=ModelSection(path=model, dtype=dtype), scheduler=scheduler, actors=actors)


@asynccontextmanager
async def open_runtime(topology: Topology, *, listen_fd: int | None = None) -> AsyncIterator[AsyncEngine]:
    """Start the three managers of ``topology`` under a supervisor; stop them after.

    With ``server.workers > 1`` the tokenizer managers run in worker processes
    that serve HTTP on ``listen_fd`` (a listening socket they inherit)."""
    from models.loading import load_tokenizer

    topology.check()
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, tokenizer_source(topology.model))
    engine: AsyncEngine | None = None

    def make_tokenizer_manager(addresses: dict[str, str]) -> Any:
        def build() -> TokenizerManager:
            tm = TokenizerManager(tokenizer, scheduler=addresses["scheduler"], detokenizer=addresses["detokenizer"],
                                  watchdog_timeout=topology.watchdogs.output_timeout, on_stall=on_stall)
            engine._tokenizer_manager = tm
            return tm

        return build

    def on_stall(report: BaseException) -> None:
        # no output while requests are in flight: the scheduler hangs where no watchdog of its own sees
        engine.supervisor.kill("scheduler", report)

    workers = topology.server.workers
    if workers > 1 and listen_fd is None:
        raise ValueError("server.workers > 1: the workers need a listening socket (listen_fd)")

    with tempfile.TemporaryDirectory(prefix="tercet-") as runtime_dir:
        async with open_hub() as hub, trio.open_nursery() as nursery:
            crashed_at: dict[str, float] = {}

            def on_event(event: SupervisorEvent) -> None:
                if event.kind == "escalated" and event.supervisor == "server":
                    # fail the requests before the children are stopped (that takes a while)
                    engine.fail(RestartIntensityExceeded(event.supervisor, topology.supervision.max_restarts,
                                                         topology.supervision.within, event.reason))
                if event.child == "scheduler":
                    engine._scheduler_event(event.kind)
                if event.kind == "started":
                    engine._record_start(event.child)
                if event.kind == "crashed":
                    crashed_at[event.child] = trio.current_time()
                    key = (event.child, type(event.reason).__name__)
                    engine.crashes[key] = engine.crashes.get(key, 0) + 1
                # a restarted scheduler or detokenizer lost the requests in flight: resume them
                resume = False
                if event.kind == "started" and event.child in crashed_at:
                    engine.recoveries.append(trio.current_time() - crashed_at.pop(event.child))
                    resume = event.child in ("scheduler", "detokenizer")
                if engine.broadcaster is not None:  # the workers hear of every event
                    if event.kind != "escalated" and engine.failure is None:
                        engine.broadcaster.publish(engine.status(resume=resume))
                elif resume:
                    engine.tokenizer_manager.watchdog.feed()  # the new one gets a full timeout
                    nursery.start_soon(engine.tokenizer_manager.resubmit_in_flight)

            def frontend(addresses: dict[str, str]) -> list[ChildSpec]:
                grace = topology.supervision.shutdown_grace
                if workers == 1:
                    build = make_tokenizer_manager(addresses)
                    return [ChildSpec("tokenizer", lambda: ActorChild(build, addresses["tokenizer"], hub),
                                      shutdown=grace)]
                from .workers import worker_specs

                addresses["control"] = f"ipc://{runtime_dir}/control"
                metrics_dir = Path(runtime_dir) / "metrics"
                metrics_dir.mkdir()
                return worker_specs(topology, addresses, topology.worker_addresses(Path(runtime_dir)), hub,
                                    listen_fd, lambda: engine, str(metrics_dir))

            specs, addresses = build_children(topology, hub, tokenizer, Path(runtime_dir), frontend)
            supervisor = make_supervisor(topology, specs, on_event)
            engine = AsyncEngine(supervisor, addresses, topology, tokenizer)
            if workers > 1:
                from .workers import StatusBroadcaster

                engine.broadcaster = StatusBroadcaster(hub, topology.worker_addresses(Path(runtime_dir)))
                nursery.start_soon(engine.broadcaster.run)

            async def supervise(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                started = False

                def ready(value: Any = None) -> None:
                    nonlocal started
                    started = True
                    task_status.started(value)

                try:
                    await supervisor.run(task_status=_Status(ready))
                except Exception as exc:
                    if not started:
                        raise
                    if engine.failure is None:
                        engine.fail(exc)
                finally:
                    if engine.broadcaster is not None:
                        engine.broadcaster.close()

            await nursery.start(supervise)
            try:
                yield engine
            finally:
                await supervisor.stop()
                nursery.cancel_scope.deadline = trio.current_time() + 30.0


class _Status:
    def __init__(self, started: Any) -> None:
        self.started = started


@asynccontextmanager
async def open_engine(model: str | None = None, *, processes: bool = False,
                      **scheduler_options: Any) -> AsyncIterator[AsyncEngine]:
    """Start a topology: model None = the embedded SmolLM2, "tiny" = a tiny random model."""
    async with open_runtime(topology_for(model, processes=processes, **scheduler_options)) as engine:
        yield engine


class Engine:
    """The synchronous Engine: ``generate`` blocks; ``shutdown`` (or ``with``) stops it."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._engine: AsyncEngine | None = None
        self._thread = threading.Thread(target=self._main, args=(model, options), daemon=True,
                                        name="tercet-engine")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _main(self, model: str | None, options: dict[str, Any]) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with open_engine(model, **options) as engine:
                self._engine = engine
                self._ready.set()
                await self._stop.wait()

        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = exc
        finally:
            self._ready.set()

    def generate(self, prompts: Any, sampling_params: dict[str, Any] | None = None,
                 **options: Any) -> list[dict[str, Any]]:
        assert self._engine is not None, "the engine is shut down"
        return trio.from_thread.run(self._engine.generate, prompts, sampling_params, **options,
                                    trio_token=self._token)

    def shutdown(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join()
        self._engine = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

"""A running topology as the HTTP layer sees it: ``Runtime``, its status and its gate.

Two runtimes implement ``Runtime``: ``LocalRuntime`` (the tokenizer manager
in this process, ``serving.runtime.launch``) and a tokenizer worker's
``WorkerRuntime`` (``serving.http.worker``), which mirrors what the main
process tells it. Both keep their figures in a ``StatusTracker``: the main
side feeds it supervisor events, a worker copies the main side's
``RuntimeStatus`` into it. Nothing here starts anything.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Protocol

import trio

from actors import Supervisor, SupervisorEvent

from ..managers.messages import RuntimeStatus, WeightsResult
from ..managers.tokenizer_manager import TokenizerManager
from .topology import Topology

log = logging.getLogger(__name__)

__all__ = ["Gate", "Runtime", "StatusTracker", "TokenizerManagerSlot"]

RESUMING = ("scheduler", "detokenizer")  # a restart of these loses the requests in flight


class StatusTracker:
    """Turns supervisor events into a runtime's status: whether the scheduler is up,
    the failure that ended the runtime, restarts, crashes by cause, recovery times
    (a crash to the restarted child's readiness) and child pids.

    With ``supervisor`` (the process that supervises) restarts and pids are read
    from it; without (a tokenizer worker) they are what ``apply`` copied."""

    def __init__(self, supervisor: Supervisor | None = None) -> None:
        self.supervisor = supervisor
        self.failure: BaseException | None = None
        self.failed = trio.Event()
        self.crashes: dict[tuple[str, str], int] = {}  # (actor, cause) → count
        self.recoveries: list[float] = []
        self._recoveries_taken = 0  # (take_recoveries)
        self._applied = False  # a worker: a status of the main process arrived
        self.starts: dict[str, int] = {}
        self._crashed_at: dict[str, float] = {}
        self._crash_cause: dict[str, str] = {}
        self._restarts: dict[str, int] = {}
        self._pids: dict[str, int] = {}
        self.pool = {0}  # the replicas that may serve (``ReplicaStatus``: while they stay within their intensity)
        self._up = trio.Event()
        self._up.set()
        self._running = True  # a worker: as the main process said
        self._start_seen = trio.Event()

    # -- reading ------------------------------------------------------------------------

    @property
    def restarts(self) -> dict[str, int]:
        return dict(self.supervisor.restarts) if self.supervisor is not None else dict(self._restarts)

    def pids(self) -> dict[str, int]:
        if self.supervisor is None:
            return dict(self._pids)
        pids = {name: getattr(self.supervisor.child(name), "pid", None) for name in self.supervisor.running()}
        return {name: pid for name, pid in pids.items() if pid}

    def scheduler_running(self) -> bool:
        if self.failure is not None:
            return False
        if self.supervisor is None:
            return self._running
        return "scheduler" in self.supervisor.running()

    async def scheduler_up(self) -> None:
        """Return once the scheduler is running (at once, usually) or the runtime failed."""
        await self._up.wait()

    async def started(self, child: str, times: int) -> None:
        """Wait until ``child`` has started ``times`` times (1: its first start)."""
        while self.starts.get(child, 0) < times and self.failure is None:
            self._start_seen = trio.Event()
            await self._start_seen.wait()

    def snapshot(self, *, crash: str | None = None, paused: bool = False, updating: bool = False) -> RuntimeStatus:
        """The status as a message; ``crash``: resume the requests in flight after it."""
        return RuntimeStatus(
            scheduler_up=self._up.is_set() and self.scheduler_running(), resume=crash is not None, crash=crash,
            failure=None if self.failure is None else str(self.failure), restarts=self.restarts,
            crashes=[(actor, cause, count) for (actor, cause), count in self.crashes.items()],
            recoveries=list(self.recoveries), pids=self.pids(), paused=paused, updating=updating,
        )

    # -- the supervising side ------------------------------------------------------------

    def observe(self, event: SupervisorEvent) -> str | None:
        """Record one supervisor event. When the requests in flight must be resumed
        (a scheduler or detokenizer is back after a crash), what crashed and why;
        else None. Escalation is the runtime's to handle: it fails (``fail``)."""
        if event.child == "scheduler" and event.kind in ("crashed", "exited", "restarting", "started"):
            self._set_up(event.kind == "started")
        if event.kind == "crashed":
            self._crash_cause[event.child] = f"the {event.child} crashed: {event.reason!r}"
        recovered = event.kind == "started" and event.child in self._crashed_at
        self.record(event.child, event)
        if not recovered:
            return None
        cause = self._crash_cause.pop(event.child)
        return cause if event.child in RESUMING else None

    def record(self, name: str, event: SupervisorEvent) -> None:
        """The crash and start figures of one child's event (``name``: the child as the status names it):
        crashes by cause, starts, and the time from a crash to the restarted child's readiness."""
        if event.kind == "crashed":
            self._crashed_at[name] = trio.current_time()
            key = (name, type(event.reason).__name__)
            self.crashes[key] = self.crashes.get(key, 0) + 1
        elif event.kind == "started":
            self.starts[name] = self.starts.get(name, 0) + 1
            self._start_seen.set()
            if name in self._crashed_at:
                self.recoveries.append(trio.current_time() - self._crashed_at.pop(name))

    def _set_up(self, up: bool) -> None:
        """Whether the scheduler serves (``scheduler_up`` waits for it)."""
        if up:
            self._up.set()
        elif self._up.is_set():
            self._up = trio.Event()

    def fail(self, failure: BaseException) -> bool:
        """The runtime is beyond repair; False if it had already failed."""
        if self.failure is not None:
            return False
        self.failure = failure
        self.failed.set()
        self._up.set()  # wake the waiters: they will find the failure
        self._start_seen.set()
        return True

    # -- a tokenizer worker ------------------------------------------------------------

    def take_recoveries(self) -> list[float]:
        """The recovery times (seconds) not taken before: each is observed once, by whoever takes it
        (the metrics; in a tokenizer worker, worker 0's)."""
        new = self.recoveries[self._recoveries_taken:]
        self._recoveries_taken = len(self.recoveries)
        return new

    def apply(self, status: RuntimeStatus) -> None:
        """Take the main process's status (the recoveries in the first one were before this worker)."""
        self._restarts = dict(status.restarts)
        self.crashes = {(actor, cause): count for actor, cause, count in status.crashes}
        self.recoveries = list(status.recoveries)
        if not self._applied:
            self._applied = True
            self._recoveries_taken = len(self.recoveries)
        self._pids = dict(status.pids)
        if status.failure is not None:
            self.fail(RuntimeError(status.failure))
            self._running = False
        elif self.failure is None:
            self._running = status.scheduler_up
            if status.scheduler_up:
                self._up.set()
            elif self._up.is_set():
                self._up = trio.Event()


class Gate:
    """Admission of new requests: closed while generation is paused; and a
    reader/writer lock around weight updates (requests in flight are readers;
    a writer waits for them to finish and holds new ones back)."""

    def __init__(self) -> None:
        self._open = trio.Event()
        self._open.set()
        self._readers = 0
        self._no_readers = trio.Event()
        self._no_readers.set()
        self._writer = trio.Lock()
        self._writer_done = trio.Event()
        self._writer_done.set()

    @property
    def readers(self) -> int:
        """Requests in flight through this gate (each sub-request counts)."""
        return self._readers

    @property
    def is_open(self) -> bool:
        return self._open.is_set() and self._writer_done.is_set()

    def set_closed(self, closed: bool) -> None:
        if not closed:
            self._open.set()
        elif self._open.is_set():
            self._open = trio.Event()

    async def wait_open(self) -> None:
        while not self.is_open:
            await self._open.wait()
            await self._writer_done.wait()

    @contextmanager
    def reading(self, weight: int = 1) -> Iterator[None]:
        """Count as ``weight`` requests in flight (its sub-requests; enter only when ``is_open``:
        no checkpoint between)."""
        assert self.is_open
        self._readers += weight
        self._no_readers = trio.Event()
        try:
            yield
        finally:
            self._readers -= weight
            if self._readers == 0:
                self._no_readers.set()

    @asynccontextmanager
    async def writing(self, drain_timeout: float) -> AsyncIterator[None]:
        """Hold new requests back and wait (at most ``drain_timeout`` s, else
        ``trio.TooSlowError`` with the gate open again) for those in flight to finish."""
        async with self._writer:
            self._writer_done = trio.Event()
            try:
                with trio.fail_after(drain_timeout):
                    await self._no_readers.wait()
                yield
            finally:
                self._writer_done.set()


class TokenizerManagerSlot:
    """The tokenizer manager of a runtime: each start of its actor builds a new one
    (``build``, the actor's factory), and ``current`` is the one running."""

    def __init__(self, make: Callable[[], TokenizerManager]) -> None:
        self._make = make
        self._current: TokenizerManager | None = None

    def build(self) -> TokenizerManager:
        if self._current is not None:  # its actor restarted: the old one's streams end, not wait for ever (N6)
            ended = self._current.fail_all("the tokenizer manager restarted; this request was ended")
            if ended:
                log.warning("the tokenizer manager restarted: %d requests in flight were ended", ended)
        self._current = self._make()
        return self._current

    @property
    def started(self) -> bool:
        return self._current is not None

    @property
    def current(self) -> TokenizerManager:
        assert self._current is not None, "the tokenizer manager has not started"
        return self._current


class Runtime(Protocol):
    """What the HTTP layer uses of a running topology."""

    topology: Topology
    tokenizer: Any
    addresses: dict[str, str]  # each actor's, as running ({runtime_dir} filled in)
    worker: int | None  # a tokenizer worker's index; None when the runtime has one tokenizer manager
    status: StatusTracker
    gate: Gate

    @property
    def tokenizer_manager(self) -> TokenizerManager: ...

    async def set_paused(self, paused: bool) -> None:
        """Pause (or continue) new requests server-wide; CallError if that cannot be told everywhere."""

    async def update_weights(self, path: str) -> WeightsResult:
        """Drain, load new weights, open again."""

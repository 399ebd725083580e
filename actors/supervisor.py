"""Supervision trees with OTP semantics.

A supervisor starts its children in order, waiting for each to report ready,
and watches them. A child marked ``with_previous`` starts at the same time as
the one before it (for children that need nothing of each other to start);
the next waits for both, and a start that fails cancels the others under way.
A child marked ``wait=False`` is not waited for: it gets ready in the
background (a peer on another host that may take minutes to answer), its
``started`` event says when, and a start of it that fails is one more crash.
When one exits, its restart type decides whether it comes back
(``permanent``: always; ``transient``: only after a crash; ``temporary``:
never) and the strategy decides which siblings go with it (``one_for_one``:
none; ``one_for_all``: all; ``rest_for_one``: those started after it). More
than ``max_restarts`` restarts within ``within`` seconds and the supervisor
stops every child and fails upward with RestartIntensityExceeded (never with
``max_restarts=None``: children that only wait for something to come back; a crash
that ``forgive(child, reason)`` calls provoked on purpose does not count: a
test run meant to crash, say). Children stop in reverse order: asked first, then cancelled when their grace period
runs out; then each spec's ``close`` runs (what its starts shared ends with the supervisor).

A child is anything with ``async run(*, task_status)`` (report ready with
``task_status.started()``, return for a normal exit, raise for a crash) and
``async stop()`` (a polite request). Supervisors are children too, so they
nest into trees; a child in another OS process has the same shape.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import trio

from ._errors import ChildStartError, RestartIntensityExceeded, unwrap

__all__ = [
    "Backoff",
    "Child",
    "ChildSpec",
    "Restart",
    "Strategy",
    "Supervisor",
    "SupervisorEvent",
]

log = logging.getLogger("actors.supervisor")


class Restart(enum.StrEnum):
    PERMANENT = "permanent"
    TRANSIENT = "transient"
    TEMPORARY = "temporary"


class Strategy(enum.StrEnum):
    ONE_FOR_ONE = "one_for_one"
    ONE_FOR_ALL = "one_for_all"
    REST_FOR_ONE = "rest_for_one"


class Child(Protocol):
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None: ...

    async def stop(self) -> None: ...


@dataclass(frozen=True)
class ChildSpec:
    name: str
    start: Callable[[], Child]  # a fresh Child for every (re)start
    restart: Restart = Restart.PERMANENT
    shutdown: float = 5.0  # grace period between asking and cancelling
    with_previous: bool = False  # starts together with the child before it, not after it
    wait: bool = True  # the supervisor waits for it to report ready (False: it gets ready in the background)
    # what the supervisor awaits once it ends, after its children stopped: what the starts share
    # ends with it (a ProcessChild's spare process: ``Standby.aclose``)
    close: Callable[[], Awaitable[None]] | None = None


@dataclass(frozen=True)
class Backoff:
    """Delay before the n-th restart within the intensity window: initial * factor**(n-1)."""

    initial: float = 0.0
    factor: float = 2.0
    maximum: float = 5.0

    def delay(self, n: int) -> float:
        return 0.0 if n <= 0 or self.initial <= 0 else min(self.initial * self.factor ** (n - 1), self.maximum)


@dataclass(frozen=True)
class SupervisorEvent:
    supervisor: str
    child: str
    kind: str  # started | exited | crashed | restarting | stopped | escalated
    reason: BaseException | None = None


@dataclass(eq=False)
class _Running:
    spec: ChildSpec
    child: Child
    value: Any = None  # what the child passed to task_status.started()
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)
    stopping: bool = False
    killed: BaseException | None = None  # why the supervisor was told to kill it


class _Status:
    def __init__(self, status: Any, running: _Running, on_started: Callable[[_Running], None] | None) -> None:
        self._status = status
        self._running = running
        self._on_started = on_started
        self.reported = False

    def started(self, value: Any = None) -> None:
        self.reported = True
        self._running.value = value
        if self._on_started is not None:
            self._on_started(self._running)
        self._status.started(value)


_STOP = object()


class Supervisor:
    def __init__(self, name: str, children: Sequence[ChildSpec], *,
                 strategy: Strategy = Strategy.ONE_FOR_ONE, max_restarts: int | None = 3,
                 within: float = 5.0, backoff: Backoff = Backoff(),
                 observer: Callable[[SupervisorEvent], None] | None = None,
                 forgive: Callable[[str, BaseException | None], bool] | None = None) -> None:
        names = [spec.name for spec in children]
        if len(set(names)) != len(names):
            raise ValueError(f"supervisor {name!r}: child names repeat: {names}")
        self.name = name
        self.specs = list(children)
        self.strategy = Strategy(strategy)
        self.max_restarts = max_restarts
        self.within = within
        self.backoff = backoff
        self.observer = observer
        self.forgive = forgive
        self.restarts: dict[str, int] = {spec.name: 0 for spec in children}
        self._running: dict[str, _Running] = {}
        self._starting: dict[str, _Running] = {}  # ``wait=False`` children not ready yet
        self._restart_times: list[float] = []
        self._nursery: trio.Nursery | None = None
        self._events_send, self._events = trio.open_memory_channel[Any](float("inf"))

    # -- public ---------------------------------------------------------------

    def child(self, name: str) -> Any:
        """What the running child ``name`` reported when it started (or None)."""
        running = self._running.get(name)
        return None if running is None else running.value

    def running(self) -> list[str]:
        return [spec.name for spec in self.specs if spec.name in self._running]

    async def stop(self) -> None:
        self._events_send.send_nowait(_STOP)
        await trio.lowlevel.checkpoint()

    def kill(self, name: str, reason: BaseException) -> bool:
        """Cancel a running child now, as a crash caused by ``reason`` (e.g. a watchdog
        elsewhere saw it hang); its restart policy applies. False if it is not running."""
        running = self._running.get(name)
        if running is None or running.stopping:
            return False
        log.error("%s: killing child %s: %r", self.name, name, reason)
        running.killed = reason
        running.scope.cancel()
        return True

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        failure: BaseException | None = None
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await self._start_all(self.specs)
                task_status.started(self)
                await self._watch()
            except (RestartIntensityExceeded, ChildStartError) as exc:
                failure = exc
            finally:
                with trio.CancelScope(shield=True):
                    await self._stop_children([*self._running.values(), *self._starting.values()])
                    for spec in self.specs:
                        if spec.close is not None:
                            await spec.close()
                nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    # -- internals ------------------------------------------------------------

    def _notify(self, child: str, kind: str, reason: BaseException | None = None) -> None:
        if self.observer is not None:
            self.observer(SupervisorEvent(self.name, child, kind, reason))

    async def _start_all(self, specs: list[ChildSpec]) -> None:
        """Start ``specs`` in order; those marked ``with_previous`` together with the one
        before. A failure (a ChildStartError) cancels the starts still under way."""
        groups: list[list[ChildSpec]] = []
        for spec in specs:
            if not spec.wait:
                self._start_soon(spec)
            elif spec.with_previous and groups:
                groups[-1].append(spec)
            else:
                groups.append([spec])
        for group in groups:
            if len(group) == 1:
                await self._start(group[0])
                continue
            failures: list[ChildStartError] = []

            async def start(spec: ChildSpec) -> None:
                try:
                    await self._start(spec)
                except ChildStartError as exc:
                    failures.append(exc)
                    nursery.cancel_scope.cancel()

            async with trio.open_nursery() as nursery:
                for spec in group:
                    nursery.start_soon(start, spec)
            if failures:
                raise failures[0]

    async def _start(self, spec: ChildSpec) -> None:
        running = _Running(spec, spec.start())
        assert self._nursery is not None
        try:
            await self._nursery.start(self._run_child, running)
        except Exception as exc:
            reason = unwrap(exc)
            log.error("%s: child %s failed to start: %r", self.name, spec.name, reason)
            raise ChildStartError(f"{self.name}: child {spec.name!r} failed to start: {reason!r}") from reason
        self._running[spec.name] = running
        self._notify(spec.name, "started")

    def _start_soon(self, spec: ChildSpec) -> None:
        """Start ``spec`` (``wait=False``) in the background: it is running once it reported ready."""
        running = _Running(spec, spec.start())
        self._starting[spec.name] = running
        assert self._nursery is not None
        self._nursery.start_soon(self._start_in_background, running)

    async def _start_in_background(self, running: _Running) -> None:
        name = running.spec.name
        assert self._nursery is not None
        try:
            await self._nursery.start(partial(self._run_child, on_started=self._started_in_background), running)
        except Exception as exc:
            if self._starting.pop(name, None) is not running or running.stopping:
                return  # stopped while it got ready
            reason = unwrap(exc)
            log.error("%s: child %s failed to start: %r", self.name, name, reason)
            self._running[name] = running  # (a crash of the child as it stands: its policy applies)
            self._events_send.send_nowait(
                (running, ChildStartError(f"{self.name}: child {name!r} failed to start: {reason!r}")))

    def _started_in_background(self, running: _Running) -> None:
        # (at once, as it reports: a crash right after finds it running)
        name = running.spec.name
        if self._starting.pop(name, None) is running and not running.stopping:
            self._running[name] = running
            self._notify(name, "started")

    async def _run_child(self, running: _Running, task_status: Any,
                         on_started: Callable[[_Running], None] | None = None) -> None:
        status = _Status(task_status, running, on_started)
        reason: BaseException | None = None
        try:
            with running.scope:
                try:
                    await running.child.run(task_status=status)
                except Exception as exc:
                    if not status.reported:
                        raise
                    reason = unwrap(exc)
            if running.killed is not None:
                reason = running.killed
        finally:
            running.done.set()
        if not status.reported:
            raise ChildStartError(f"child {running.spec.name!r} returned before reporting ready")
        if not running.stopping:
            self._events_send.send_nowait((running, reason))

    async def _watch(self) -> None:
        async for event in self._events:
            if event is _STOP:
                return
            running, reason = event
            if self._running.get(running.spec.name) is not running:
                continue  # a stale exit of a child already replaced or stopped
            await self._child_exited(running, reason)

    async def _child_exited(self, running: _Running, reason: BaseException | None) -> None:
        spec = running.spec
        del self._running[spec.name]
        if reason is None:
            log.info("%s: child %s exited", self.name, spec.name)
            self._notify(spec.name, "exited")
        else:
            log.error("%s: child %s crashed: %r", self.name, spec.name, reason)
            self._notify(spec.name, "crashed", reason)
        if spec.restart == Restart.TEMPORARY or (spec.restart == Restart.TRANSIENT and reason is None):
            return
        await self._restart(spec, reason)

    async def _restart(self, spec: ChildSpec, reason: BaseException | None) -> None:
        counted = reason is None or self.forgive is None or not self.forgive(spec.name, reason)
        if not counted:
            log.warning("%s: %s crashed as expected (%r): not counted against the restart intensity",
                        self.name, spec.name, reason)
        while True:
            now = trio.current_time()
            self._restart_times = [t for t in self._restart_times if now - t < self.within]
            if counted:
                self._restart_times.append(now)
            counted = True  # (a start that fails counts)
            if self.max_restarts is not None and len(self._restart_times) > self.max_restarts:
                self._notify(spec.name, "escalated", reason)
                raise RestartIntensityExceeded(self.name, self.max_restarts, self.within, reason)
            group = self._group(spec)
            await self._stop_children([r for s in group if (r := self._running.get(s.name) or self._starting.get(s.name))])
            group = [s for s in group if s is spec or s.restart != Restart.TEMPORARY]
            delay = self.backoff.delay(len(self._restart_times))
            log.warning("%s: restarting %s (cause: %r) in %.3g s", self.name,
                        ", ".join(s.name for s in group), reason, delay)
            for s in group:
                self._notify(s.name, "restarting", reason)
            await trio.sleep(delay)
            try:
                for s in group:
                    self.restarts[s.name] += 1
                await self._start_all(group)
                return
            except ChildStartError as exc:
                reason = exc

    def _group(self, spec: ChildSpec) -> list[ChildSpec]:
        index = self.specs.index(spec)
        if self.strategy == Strategy.ONE_FOR_ALL:
            return list(self.specs)
        if self.strategy == Strategy.REST_FOR_ONE:
            return self.specs[index:]
        return [spec]

    async def _stop_children(self, children: list[_Running]) -> None:
        order = {spec.name: i for i, spec in enumerate(self.specs)}
        for running in sorted(children, key=lambda r: order[r.spec.name], reverse=True):
            await self._stop_child(running)

    async def _stop_child(self, running: _Running) -> None:
        running.stopping = True
        self._running.pop(running.spec.name, None)
        self._starting.pop(running.spec.name, None)
        if not running.done.is_set():
            with trio.move_on_after(running.spec.shutdown):
                await running.child.stop()
                await running.done.wait()
            if not running.done.is_set():
                log.warning("%s: child %s did not stop within %g s; cancelling", self.name,
                            running.spec.name, running.spec.shutdown)
                running.scope.cancel()
                await running.done.wait()
        self._notify(running.spec.name, "stopped")

"""Watchdogs: notice work that stopped moving, say where it is stuck, crash.

Both kinds run as a background task in the actor they guard (start them in
``ctx.nursery``). Firing logs the stack of the watched task and raises
WatchdogTimeout in that nursery, which crashes the actor: its supervisor
restarts it per policy. A watchdog never kills the whole program.

- SoftWatchdog: ``feed()`` on every message; fires when it has not been fed
  for ``timeout`` seconds while work is in flight (``busy()`` says whether it
  is: an idle actor is never blamed for silence). ``disable()`` covers a wait
  that is long by design, for an actor that cannot say ``busy``.
- StepWatchdog: ``with watchdog.step():`` around one step of work; fires when
  a step outlives ``timeout``.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import trio

__all__ = ["SoftWatchdog", "StepWatchdog", "WatchdogTimeout", "format_task_stack"]

log = logging.getLogger("actors.watchdog")


class WatchdogTimeout(Exception):
    def __init__(self, name: str, timeout: float, what: str, stack: str) -> None:
        super().__init__(f"watchdog {name!r}: {what} for more than {timeout:g} s")
        self.name = name
        self.timeout = timeout
        self.stack = stack


def format_task_stack(task: trio.lowlevel.Task | None) -> str:
    """Where ``task`` (and the tasks in its nurseries) is suspended, innermost last."""
    if task is None:
        return "<no task>\n"
    lines = [f"task {task.name}:\n"]
    frames: list[tuple[FrameType, int]] = []
    coro: Any = task.coro
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            frames.append((frame, frame.f_lineno))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    lines.extend(traceback.format_list(traceback.StackSummary.extract(frames)))
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            lines.append(format_task_stack(child))
    return "".join(lines)


class _Watchdog:
    def __init__(self, name: str, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"watchdog {name!r}: timeout must be positive, got {timeout}")
        self.name = name
        self.timeout = timeout
        self.fired = 0
        self._task: trio.lowlevel.Task | None = None

    def _fire(self, what: str) -> None:
        self.fired += 1
        stack = format_task_stack(self._task)
        log.error("watchdog %s: %s for more than %g s; stack of the watched task:\n%s",
                  self.name, what, self.timeout, stack)
        raise WatchdogTimeout(self.name, self.timeout, what, stack)


class SoftWatchdog(_Watchdog):
    """``on_fire``, when given, is called instead of raising (the stuck party is
    elsewhere, e.g. a scheduler in another process); the watchdog then re-arms."""

    def __init__(self, name: str, timeout: float, *, busy: Callable[[], bool] = lambda: True,
                 on_fire: Callable[[WatchdogTimeout], None] | None = None) -> None:
        super().__init__(name, timeout)
        self._busy = busy
        self._on_fire = on_fire
        self._disabled = 0
        self._last_fed = 0.0

    def feed(self) -> None:
        self._last_fed = trio.current_time()
        self._task = trio.lowlevel.current_task()

    @contextmanager
    def disable(self) -> Iterator[None]:
        """No firing inside this block (an idle wait); the clock restarts after it."""
        self._disabled += 1
        try:
            yield
        finally:
            self._disabled -= 1
            self.feed()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self._last_fed = trio.current_time()
        task_status.started()
        while True:
            deadline = self._last_fed + self.timeout
            if trio.current_time() < deadline:
                await trio.sleep_until(deadline)
                continue
            if self._disabled or not self._busy():
                self._last_fed = trio.current_time()  # idle is not stuck
                continue
            try:
                self._fire("no message while work is in flight")
            except WatchdogTimeout as report:
                if self._on_fire is None:
                    raise
                self._on_fire(report)
                self._last_fed = trio.current_time()


class StepWatchdog(_Watchdog):
    def __init__(self, name: str, timeout: float) -> None:
        super().__init__(name, timeout)
        self._deadline = float("inf")
        self._step_started = trio.Event()

    @contextmanager
    def step(self) -> Iterator[None]:
        self._task = trio.lowlevel.current_task()
        self._deadline = trio.current_time() + self.timeout
        self._step_started.set()
        try:
            yield
        finally:
            self._deadline = float("inf")
            self._step_started = trio.Event()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            if self._deadline == float("inf"):
                await self._step_started.wait()
                continue
            deadline = self._deadline
            await trio.sleep_until(deadline)
            if self._deadline == deadline:  # the same step, still running
                self._fire("a step ran")

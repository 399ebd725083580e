"""Schedulers that misbehave on purpose, run in child processes by the recovery tests."""

import os
import resource
import signal
import time

import msgspec

from actors import ActorChild
from serving.managers.detokenizer import detokenizer_child
from serving.managers.scheduler import Scheduler, SchedulerConfig


class HangingScheduler(Scheduler):
    """Its model step blocks forever once, after ``steps`` steps (marker file: only once)."""

    def __init__(self, config, steps: int, marker: str) -> None:
        super().__init__(config)
        self.hang_after = steps
        self.marker = marker

    def on_loaded(self):
        runner, real_step, count = self.runner, self.runner.step, [0]

        def step(seqs):
            count[0] += 1
            if count[0] > self.hang_after and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                time.sleep(1e9)  # a kernel that never returns
            return real_step(seqs)

        runner.step = step


def hanging_scheduler_child(hub, *, address, config, steps, marker):
    parsed = msgspec.convert(config, SchedulerConfig)
    return ActorChild(lambda: HangingScheduler(parsed, steps, marker), address, hub)


class SlowScheduler(Scheduler):
    """Each model step takes ``delay`` s longer while the file ``marker`` exists: a replica whose
    requests are still streaming when the test strikes it, however late the front end sees them."""

    def __init__(self, config, delay: float, marker: str) -> None:
        super().__init__(config)
        self.delay = delay
        self.marker = marker

    def on_loaded(self):
        real_step = self.runner.step

        def step(seqs):
            if os.path.exists(self.marker):
                time.sleep(self.delay)  # a slow step, on purpose
            return real_step(seqs)

        self.runner.step = step


def slow_scheduler_child(hub, *, address, config, delay, marker):
    parsed = msgspec.convert(config, SchedulerConfig)
    return ActorChild(lambda: SlowScheduler(parsed, delay, marker), address, hub)


POISON = [7, 7, 7, 7, 7, 13]  # a prompt that starts so kills the scheduler process when it runs
LATE_POISON = [7, 7, 7, 7, 7, 14]  # ... once it has generated LATE tokens
LATE = 3


class PoisonedScheduler(Scheduler):
    """Its model step kills the whole process with a segfault whenever a
    request whose prompt starts with ``POISON`` is in the step, or one that starts
    with ``LATE_POISON`` and has generated ``LATE`` tokens."""

    def on_loaded(self):
        real_step = self.runner.step

        def poisoned(s):
            head = list(s.prompt_ids[: len(POISON)])
            return head == POISON or (head == LATE_POISON and len(s.output_ids) >= LATE)

        def step(seqs):
            if any(poisoned(s) for s in seqs):
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # (no core file)
                os.kill(os.getpid(), signal.SIGSEGV)
            return real_step(seqs)

        self.runner.step = step


def poisoned_scheduler_child(hub, *, address, config):
    parsed = msgspec.convert(config, SchedulerConfig)
    return ActorChild(lambda: PoisonedScheduler(parsed), address, hub)


def slow_restarting_detokenizer_child(hub, *, delay, marker, **args):
    """The detokenizer, each of whose starts after the first takes ``delay`` s longer (a marker
    file says it started once): a restart that outlasts the output watchdog's timeout."""
    if os.path.exists(marker):
        time.sleep(delay)
    else:
        open(marker, "w").close()
    return detokenizer_child(hub, **args)

"""Watchdogs: fire only when stuck, dump the stuck stack, crash into a restart."""

import logging

import pytest
import trio

from actors import SoftWatchdog, StepWatchdog, WatchdogTimeout, format_task_stack
from actors.testing import open_harness

from .messages import Begin, End, Guarded, Progress, Work


async def test_step_watchdog_fires_on_a_slow_step_and_the_actor_restarts(autojump_clock, caplog):
    async with open_harness() as h:
        sup = await h.start_actor("model", lambda: Guarded(step_timeout=10.0), "inproc://model")
        await h.send("inproc://model", Work(5.0))  # within its deadline
        await h.send("inproc://model", Work(1e9))  # stuck
        t0 = trio.current_time()
        crash = await h.wait_event(lambda e: e.kind == "crashed", timeout=100.0)
        assert trio.current_time() - t0 == pytest.approx(15.0)
        assert isinstance(crash.reason, WatchdogTimeout)
        assert crash.reason.name == "step"
        assert "stuck_in_the_model" in crash.reason.stack
        await h.wait_event(lambda e: h.count("started", "model") == 2)
        assert sup.running() == ["model"]
    assert any("stuck_in_the_model" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


async def test_soft_watchdog_fires_only_with_work_in_flight(autojump_clock):
    async with open_harness() as h:
        await h.start_actor("tm", lambda: Guarded(soft_timeout=30.0), "inproc://tm")
        await trio.sleep(300.0)  # idle: nothing in flight, no firing
        await h.send("inproc://tm", Begin())
        for _ in range(10):  # fed in time: no firing
            await trio.sleep(20.0)
            await h.send("inproc://tm", Progress())
        await h.send("inproc://tm", End())
        await trio.sleep(300.0)
        assert h.count("crashed") == 0

        await h.send("inproc://tm", Begin())
        t0 = trio.current_time()
        crash = await h.wait_event(lambda e: e.kind == "crashed", timeout=100.0)
        assert isinstance(crash.reason, WatchdogTimeout) and crash.reason.name == "soft"
        assert trio.current_time() - t0 == pytest.approx(30.0)


async def test_soft_watchdog_is_quiet_while_disabled(autojump_clock):
    fired_at = []
    dog = SoftWatchdog("idle", 5.0, on_fire=lambda report: fired_at.append(trio.current_time()))
    async with trio.open_nursery() as nursery:
        await nursery.start(dog.run)
        dog.feed()
        with dog.disable():
            await trio.sleep(100.0)
        ended = trio.current_time()
        await trio.sleep(4.9)  # the clock restarted when the block ended
        assert fired_at == []
        await trio.sleep(0.2)  # ...and it is armed again: it fires 5 s after the block
        assert fired_at == [pytest.approx(ended + 5.0)]
        nursery.cancel_scope.cancel()


async def test_soft_watchdog_raises_with_the_fed_tasks_stack(autojump_clock):
    dog = SoftWatchdog("rx", 5.0)

    async def waiting_for_the_scheduler():
        dog.feed()
        await trio.sleep_forever()

    started = trio.current_time()
    with pytest.RaisesGroup(pytest.RaisesExc(WatchdogTimeout, check=lambda e: "waiting_for_the_scheduler" in e.stack)):
        with trio.fail_after(60.0):  # MockClock: a watchdog that never fires fails here, not at the suite timeout
            async with trio.open_nursery() as nursery:
                await nursery.start(dog.run)
                nursery.start_soon(waiting_for_the_scheduler)
    assert trio.current_time() - started == pytest.approx(5.0)


async def test_step_watchdog_is_quiet_between_steps(autojump_clock):
    dog = StepWatchdog("step", 5.0)
    with pytest.RaisesGroup(pytest.RaisesExc(WatchdogTimeout, match="a step ran")):
        async with trio.open_nursery() as nursery:
            await nursery.start(dog.run)
            for _ in range(20):
                with dog.step():
                    await trio.sleep(4.0)
                await trio.sleep(50.0)
            assert dog.fired == 0
            started = trio.current_time()
            with dog.step():  # still armed: a step that overruns is reported
                await trio.sleep(6.0)
            nursery.cancel_scope.cancel()  # not reached when the watchdog fires
    assert dog.fired == 1
    assert trio.current_time() - started == pytest.approx(5.0)


def test_a_watchdog_needs_a_positive_timeout():
    with pytest.raises(ValueError, match="positive"):
        StepWatchdog("bad", 0)


async def test_format_task_stack_names_nested_tasks():
    async def inner_sleeper():
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(inner_sleeper)
        await trio.testing.wait_all_tasks_blocked()
        text = format_task_stack(trio.lowlevel.current_task())
        nursery.cancel_scope.cancel()
    assert "inner_sleeper" in text


async def test_soft_watchdog_can_report_instead_of_raising(autojump_clock):
    reports = []
    dog = SoftWatchdog("rx", 5.0, on_fire=reports.append)
    async with trio.open_nursery() as nursery:
        await nursery.start(dog.run)
        dog.feed()
        await trio.sleep(12.0)
        nursery.cancel_scope.cancel()
    assert len(reports) == 2 and all(isinstance(r, WatchdogTimeout) for r in reports)

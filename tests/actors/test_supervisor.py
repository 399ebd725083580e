"""Supervision: start order, strategies, restart types, intensity, shutdown."""

import dataclasses

import pytest
import trio
import trio.testing

from actors import Backoff, ChildStartError, Restart, RestartIntensityExceeded, Strategy, Supervisor
from actors.testing import open_harness

from .messages import Boom, Ping, Pong, Quit, Quitter, Slow


def trio_of(h, log, **options):
    return [
        h.actor_spec(name, lambda name=name: Quitter("inproc://out", name, log), f"inproc://{name}", **options)
        for name in ("a", "b", "c")
    ]


def starts(log):
    return [name for kind, name in log if kind == "start"]


async def test_children_start_in_order_each_awaited_ready(autojump_clock):
    log = []
    async with open_harness() as h:
        specs = [
            h.actor_spec(name, lambda name=name, delay=delay: Quitter("inproc://out", name, log, ready_after=delay),
                         f"inproc://{name}")
            for name, delay in (("a", 3.0), ("b", 1.0), ("c", 0.0))
        ]
        t0 = trio.current_time()
        sup = await h.start_supervisor("sup", specs)
        assert trio.current_time() - t0 == pytest.approx(4.0)
        assert starts(log) == ["a", "b", "c"]
        assert sup.running() == ["a", "b", "c"]
        await sup.stop()
        await h.wait_event(lambda e: e.child == "a" and e.kind == "stopped")
    assert [name for kind, name in log if kind == "stop"] == ["c", "b", "a"]


def slow_starters(h, log, delays=(("a", 3.0), ("b", 1.0), ("c", 0.0)), failing=(), together=("b", "c")):
    """a, b, c ready after 3, 1 and 0 s; b and c marked to start with the one before them."""
    return [
        h.actor_spec(name, lambda name=name, delay=delay: Quitter("inproc://out", name, log, ready_after=delay,
                                                                fail_start=name in failing), f"inproc://{name}",
                     with_previous=name in together)
        for name, delay in delays
    ]


async def test_children_started_together_are_ready_with_the_slowest(autojump_clock):
    log = []
    async with open_harness() as h:
        t0 = trio.current_time()
        sup = await h.start_supervisor("sup", slow_starters(h, log))
        assert trio.current_time() - t0 == pytest.approx(3.0)  # not 3 + 1 + 0
        assert starts(log) == ["c", "b", "a"]  # as each became ready
        assert sup.running() == ["a", "b", "c"]
        await sup.stop()
        await h.wait_event(lambda e: e.child == "a" and e.kind == "stopped")
    assert [name for kind, name in log if kind == "stop"] == ["c", "b", "a"]  # still in reverse order


async def test_a_child_not_marked_waits_for_the_group_before_it(autojump_clock):
    log = []
    async with open_harness() as h:
        specs = slow_starters(h, log, delays=(("a", 1.0), ("b", 3.0), ("c", 2.0), ("d", 1.0)), together=("b", "d"))
        t0 = trio.current_time()
        await h.start_supervisor("sup", specs)
        assert trio.current_time() - t0 == pytest.approx(3.0 + 2.0)  # (a with b), then (c with d)
        assert starts(log) == ["a", "b", "d", "c"]


async def test_a_start_failing_among_children_started_together_cancels_the_others(autojump_clock):
    log = []
    async with open_harness() as h:
        t0 = trio.current_time()
        with pytest.raises(ChildStartError, match="'b' failed to start"):
            await h.start_supervisor("sup", slow_starters(h, log, failing=("b",)))
        assert trio.current_time() - t0 == pytest.approx(1.0)  # a's start (3 s) was not waited for
        assert "a" not in starts(log)
        assert [name for kind, name in log if kind == "stop"] == ["c"]  # the one that was up is stopped


async def test_children_started_together_restart_together(autojump_clock):
    log = []
    async with open_harness() as h:
        sup = await h.start_supervisor("sup", slow_starters(h, log), strategy=Strategy.ONE_FOR_ALL)
        log.clear()
        await h.send("inproc://b", Boom())
        await h.wait_event(lambda e: e.kind == "crashed")
        t0 = trio.current_time()
        await h.wait_event(lambda e: h.count("started", "a") == 2)
        assert trio.current_time() - t0 == pytest.approx(3.0)
        assert sorted(starts(log)) == ["a", "b", "c"] and sup.running() == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("strategy", "restarted", "stopped"),
    [
        (Strategy.ONE_FOR_ONE, ["b"], []),
        (Strategy.ONE_FOR_ALL, ["a", "b", "c"], ["c", "a"]),
        (Strategy.REST_FOR_ONE, ["b", "c"], ["c"]),
    ],
)
async def test_strategy_decides_who_restarts(autojump_clock, strategy, restarted, stopped):
    log = []
    async with open_harness() as h:
        out = await h.probe("inproc://out", Pong)
        sup = await h.start_supervisor("sup", trio_of(h, log), strategy=strategy)
        log.clear()
        await h.send("inproc://b", Boom())
        last = restarted[-1]
        await h.wait_event(lambda e: h.count("started", last) == 2)
        assert starts(log) == restarted
        assert [name for kind, name in log if kind == "stop"] == stopped
        assert sup.running() == ["a", "b", "c"]
        for name in ("a", "b", "c"):  # everyone serves again
            await h.send(f"inproc://{name}", Ping(1))
            assert (await out.expect(Pong)).by == name


@pytest.mark.parametrize(
    ("restart", "message", "comes_back"),
    [
        (Restart.PERMANENT, Quit(), True),
        (Restart.PERMANENT, Boom(), True),
        (Restart.TRANSIENT, Quit(), False),
        (Restart.TRANSIENT, Boom(), True),
        (Restart.TEMPORARY, Quit(), False),
        (Restart.TEMPORARY, Boom(), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, (Quit, Boom)) else str(v),
)
async def test_restart_type_decides_whether_a_child_comes_back(autojump_clock, restart, message, comes_back):
    log = []
    async with open_harness() as h:
        spec = h.actor_spec("a", lambda: Quitter("inproc://out", "a", log), "inproc://a", restart=restart)
        sup = await h.start_supervisor("sup", [spec])
        await h.send("inproc://a", message)
        ended = await h.wait_event(lambda e: e.kind in ("exited", "crashed"))
        assert ended.kind == ("exited" if isinstance(message, Quit) else "crashed")
        if comes_back:
            await h.wait_event(lambda e: h.count("started", "a") == 2)
        else:
            await trio.testing.wait_all_tasks_blocked()  # the supervisor has decided
            assert h.count("restarting", "a") == 0
        assert sup.running() == (["a"] if comes_back else [])
        assert starts(log) == (["a", "a"] if comes_back else ["a"])


async def test_restart_intensity_exceeded_stops_children_and_escalates(autojump_clock):
    log = []
    async with open_harness() as h:
        sup = await h.start_supervisor("sup", trio_of(h, log), max_restarts=2, within=10.0)
        for _ in range(3):
            await trio.sleep(1.0)
            await h.send("inproc://b", Boom())
        await h.wait_event(lambda e: sum(x.kind == "crashed" for x in h.events) == 3)
        failed = await h.wait_event(lambda e: e.kind == "failed")
        assert isinstance(failed.reason, RestartIntensityExceeded)
        assert "more than 2 restarts within 10 s" in str(failed.reason)
        assert sup.running() == []
        assert [name for kind, name in log if kind == "stop"] == ["c", "a"]


async def test_crashes_spread_beyond_the_window_do_not_escalate(autojump_clock):
    async with open_harness() as h:
        await h.start_supervisor("sup", trio_of(h, []), max_restarts=2, within=10.0)
        for n in range(6):
            await trio.sleep(6.0)
            await h.send("inproc://b", Boom())
            await h.wait_event(lambda e, n=n: h.count("started", "b") == n + 2)
        assert not [e for e in h.events if e.kind in ("escalated", "failed")]


async def test_crashes_it_forgives_do_not_count_against_the_intensity(autojump_clock):
    forgiven = []

    def forgive(child, reason):  # every other crash of b was provoked on purpose
        forgiven.append(child)
        return len(forgiven) % 2 == 0

    async with open_harness() as h:
        await h.start_supervisor("sup", trio_of(h, []), max_restarts=2, within=100.0, forgive=forgive)
        for n in range(4):  # 2 counted, 2 forgiven: within the intensity
            await h.send("inproc://b", Boom())
            await h.wait_event(lambda e, n=n: h.count("started", "b") == n + 2)
        assert forgiven == ["b"] * 4 and not [e for e in h.events if e.kind in ("escalated", "failed")]
        await h.send("inproc://b", Boom())  # the third counted
        failed = await h.wait_event(lambda e: e.kind == "failed")
        assert isinstance(failed.reason, RestartIntensityExceeded)


async def test_back_off_grows_exponentially(autojump_clock):
    async with open_harness() as h:
        await h.start_supervisor(
            "sup", trio_of(h, []), max_restarts=10, within=100.0,
            backoff=Backoff(initial=1.0, factor=2.0, maximum=3.0),
        )
        delays = []
        for n in range(4):
            t0 = trio.current_time()
            await h.send("inproc://a", Boom())
            await h.wait_event(lambda e, n=n: h.count("started", "a") == n + 2)
            delays.append(trio.current_time() - t0)
        assert delays == pytest.approx([1.0, 2.0, 3.0, 3.0])


async def test_nested_supervisor_escalation_is_restarted_by_its_parent(autojump_clock):
    log = []
    async with open_harness() as h:
        inner_specs = trio_of(h, log)
        inner = lambda: Supervisor("inner", inner_specs, max_restarts=0, observer=h.record)  # noqa: E731
        from actors import ChildSpec

        outer = await h.start_supervisor("outer", [ChildSpec("inner", inner)], max_restarts=3)
        await h.send("inproc://c", Boom())
        await h.wait_event(lambda e: e.supervisor == "outer" and e.kind == "crashed")
        crashed = [e for e in h.events if e.supervisor == "outer" and e.kind == "crashed"][0]
        assert isinstance(crashed.reason, RestartIntensityExceeded)
        await h.wait_event(lambda e: h.count("started", "inner", "outer") == 2)
        assert starts(log) == ["a", "b", "c", "a", "b", "c"]
        assert outer.child("inner").running() == ["a", "b", "c"]


async def test_shutdown_asks_then_cancels_after_the_grace_period(autojump_clock):
    log = []
    async with open_harness() as h:
        spec = h.actor_spec("slow", lambda: Slow("inproc://out", "slow", log), "inproc://slow", shutdown=3.0)
        sup = await h.start_supervisor("sup", [spec])
        t0 = trio.current_time()
        await sup.stop()
        await h.wait_event(lambda e: e.kind == "stopped")
        assert trio.current_time() - t0 == pytest.approx(3.0)
        assert log[-1] == ("stopping", "slow")


async def test_a_child_failing_to_start_fails_the_supervisor(autojump_clock):
    async with open_harness() as h:
        specs = [h.actor_spec("a", lambda: Quitter("inproc://out", "a"), "inproc://a"),
                 h.actor_spec("b", lambda: Quitter("inproc://out", "b", fail_start=True), "inproc://b")]
        with pytest.raises(ChildStartError, match="'b' failed to start"):
            await h.start_supervisor("sup", specs)


async def test_duplicate_child_names_are_refused():
    with pytest.raises(ValueError, match="repeat"):
        Supervisor("sup", [ChildSpecStub("x"), ChildSpecStub("x")])


def ChildSpecStub(name):
    from actors import ChildSpec

    return ChildSpec(name, lambda: None)


async def test_kill_is_a_crash_with_the_given_reason(autojump_clock):
    async with open_harness() as h:
        out = await h.probe("inproc://out", Pong)
        sup = await h.start_supervisor("sup", trio_of(h, []))
        h.faults("b").hang()
        await h.send("inproc://b", Ping(1))
        await trio.testing.wait_all_tasks_blocked()  # b is stuck in a handler
        assert sup.kill("b", TimeoutError("b stopped answering"))
        crash = await h.wait_event(lambda e: e.kind == "crashed")
        assert isinstance(crash.reason, TimeoutError)
        await h.wait_event(lambda e: h.count("started", "b") == 2)
        await h.send("inproc://b", Ping(2))
        assert (await out.expect(Pong)).n == 2
        assert not sup.kill("nope", TimeoutError())


# -- children not waited for (wait=False): a peer on another host that may take long to answer ------


def background(h, log, slow="b", ready_after=10.0, failing=()):
    """a, b, c, each ready at once but ``slow`` (after ``ready_after`` s, not waited for)."""
    return [
        h.actor_spec(name, lambda name=name: Quitter("inproc://out", name, log, fail_start=name in failing,
                                                     ready_after=ready_after if name == slow else 0.0),
                     f"inproc://{name}", wait=name != slow)
        for name in ("a", "b", "c")
    ]


async def test_a_child_not_waited_for_gets_ready_in_the_background(autojump_clock):
    log = []
    async with open_harness() as h:
        t0 = trio.current_time()
        sup = await h.start_supervisor("sup", background(h, log))
        assert trio.current_time() == t0 and sup.running() == ["a", "c"]
        started = await h.wait_event(lambda e: e.child == "b" and e.kind == "started", timeout=30)
        assert trio.current_time() - t0 == pytest.approx(10.0) and started.supervisor == "sup"
        assert sup.running() == ["a", "b", "c"]
        await sup.stop()
        await h.wait_event(lambda e: e.child == "a" and e.kind == "stopped")
    assert [name for kind, name in log if kind == "stop"] == ["c", "b", "a"]


async def test_siblings_are_restarted_while_a_child_gets_ready_in_the_background(autojump_clock):
    async with open_harness() as h:
        sup = await h.start_supervisor("sup", background(h, [], ready_after=1000.0))
        await h.send("inproc://c", Boom())
        await h.wait_event(lambda e: h.count("started", "c") == 2, timeout=5)
        assert sup.running() == ["a", "c"] and h.count("started", "b") == 0
        await h.wait_event(lambda e: e.child == "b" and e.kind == "started", timeout=2000)


async def test_a_child_stopped_while_it_gets_ready_is_stopped_within_its_grace(autojump_clock):
    log = []
    async with open_harness() as h:
        sup = await h.start_supervisor("sup", background(h, log, ready_after=1000.0))
        t0 = trio.current_time()
        await sup.stop()
        stopped = await h.wait_event(lambda e: e.child == "b" and e.kind == "stopped", timeout=60)
        assert trio.current_time() - t0 <= 5.0 + 0.1  # its grace, then cancelled
        await h.wait_event(lambda e: e.child == "a" and e.kind == "stopped", timeout=60)
        assert stopped.supervisor == "sup" and h.count("started", "b") == 0
        assert not [e for e in h.events if e.kind in ("crashed", "restarting", "failed")]


async def test_a_start_in_the_background_that_fails_is_a_crash(autojump_clock):
    async with open_harness() as h:
        await h.start_supervisor("sup", background(h, [], failing=("b",), ready_after=1.0), max_restarts=2,
                                 within=100.0)
        crash = await h.wait_event(lambda e: e.child == "b" and e.kind == "crashed", timeout=5)
        assert isinstance(crash.reason, ChildStartError) and "'b' failed to start" in str(crash.reason)
        failed = await h.wait_event(lambda e: e.kind == "failed", timeout=60)
        assert isinstance(failed.reason, RestartIntensityExceeded) and h.count("crashed", "b") == 3


async def test_a_supervisor_without_a_restart_limit_never_gives_up(autojump_clock):
    async with open_harness() as h:
        await h.start_supervisor("sup", trio_of(h, []), max_restarts=None, within=100.0)
        for n in range(12):
            await h.send("inproc://b", Boom())
            await h.wait_event(lambda e, n=n: h.count("started", "b") == n + 2)
        assert not [e for e in h.events if e.kind in ("escalated", "failed")]


@pytest.mark.parametrize("ending", ["stopped", "escalated"])
async def test_each_specs_close_runs_once_when_the_supervisor_ends_after_its_children(autojump_clock, ending):
    log = []

    def closer(name):
        async def close():
            await trio.lowlevel.checkpoint()
            log.append(("close", name))
        return close

    async with open_harness() as h:
        specs = [dataclasses.replace(spec, close=closer(spec.name)) for spec in trio_of(h, log)]
        sup = await h.start_supervisor("sup", specs, max_restarts=0 if ending == "escalated" else 3)
        await h.send("inproc://b", Boom())
        if ending == "escalated":
            await h.wait_event(lambda e: e.kind == "failed")
        else:
            await h.wait_event(lambda e: h.count("started", "b") == 2)
            assert not [entry for entry in log if entry[0] == "close"]  # a restart closes nothing
            await sup.stop()
            await h.wait_event(lambda e: h.count("stopped", "a") == 1)
    closes = [i for i, (kind, _) in enumerate(log) if kind == "close"]
    assert [log[i] for i in closes] == [("close", "a"), ("close", "b"), ("close", "c")]
    assert min(closes) > max(i for i, (kind, _) in enumerate(log) if kind == "stop")  # after the children

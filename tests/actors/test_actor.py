"""Actors: dispatch by type, replies, lifecycle hooks, crashes, faults."""

import pytest
import trio

from actors import CallError, CallTimeout
from actors.testing import open_harness

from .messages import Ask, Boom, Count, Echo, Get, GetCount, GetWrong, Ping, Pong


async def test_messages_dispatch_by_type_and_answer(autojump_clock):
    async with open_harness() as h:
        out = await h.probe("inproc://out", Pong)
        await h.start_actor("echo", lambda: Echo("inproc://out"), "inproc://echo")
        for n in range(3):
            await h.send("inproc://echo", Ping(n))
        assert [(await out.expect(Pong)).n for _ in range(3)] == [0, 1, 2]
        assert await h.call("inproc://echo", Get(), reply=int) == 3


@pytest.mark.parametrize("scheme", ["inproc", "ipc"])
async def test_a_call_returns_the_reply_type_its_message_declares(scheme, tmp_path):
    """A message class's ``reply`` is what a call of it returns, typed, across a wire as in one process;
    a reply that is not one is a CallError naming the type, not a dict passed on."""
    address = "inproc://echo" if scheme == "inproc" else f"ipc://{tmp_path}/echo.sock"
    async with open_harness() as h:
        await h.start_actor("echo", lambda: Echo("inproc://out"), address)
        assert await h.call(address, GetCount()) == Count(0)
        assert await h.call(address, Get()) == 0  # (no declared type: as it came)
        with pytest.raises(CallError, match="not a Count"):
            await h.call(address, GetWrong())


async def test_call_from_a_handler_gets_its_reply(autojump_clock):
    async with open_harness() as h:
        await h.start_actor("a", lambda: Echo("inproc://out", "a"), "inproc://a")
        await h.start_actor("b", lambda: Echo("inproc://out", "b"), "inproc://b")
        assert await h.call("inproc://a", Ask("inproc://b"), reply=int) == 1000


async def test_call_deadline_and_callee_error(autojump_clock):
    async with open_harness() as h:
        await h.start_actor("echo", lambda: Echo("inproc://out"), "inproc://echo")
        h.faults("echo").hang()
        with pytest.raises(CallTimeout):
            await h.call("inproc://echo", Get(), timeout=2.0)
    async with open_harness() as h:
        await h.start_actor("echo", lambda: Echo("inproc://out"), "inproc://echo")
        with pytest.raises(CallError, match="told to crash"):
            await h.call("inproc://echo", Boom())


async def test_lifecycle_hooks_run_in_order(autojump_clock):
    log = []
    async with open_harness() as h:
        sup = await h.start_actor("echo", lambda: Echo("inproc://out", log=log), "inproc://echo")
        assert log == [("start", "echo")]
        await sup.stop()
        await h.wait_event(lambda e: e.kind == "stopped")
    assert log == [("start", "echo"), ("stop", "echo")]


async def test_handler_exception_crashes_the_actor_and_it_restarts(autojump_clock):
    log = []
    async with open_harness() as h:
        out = await h.probe("inproc://out", Pong)
        await h.start_actor("echo", lambda: Echo("inproc://out", log=log), "inproc://echo")
        await h.send("inproc://echo", Boom())
        crash = await h.wait_event(lambda e: e.kind == "crashed")
        assert isinstance(crash.reason, RuntimeError)
        await h.send("inproc://echo", Ping(7))
        assert (await out.expect(Pong)).n == 7
    assert log.count(("start", "echo")) == 2


async def test_injected_faults_crash_hang_delay_drop(autojump_clock):
    async with open_harness() as h:
        out = await h.probe("inproc://out", Pong)
        await h.start_actor("echo", lambda: Echo("inproc://out"), "inproc://echo")
        faults = h.faults("echo")

        faults.drop()
        await h.send("inproc://echo", Ping(1))
        await h.send("inproc://echo", Ping(2))
        assert (await out.expect(Pong)).n == 2

        faults.delay(30.0)
        start = trio.current_time()
        await h.send("inproc://echo", Ping(3))
        await out.expect(Pong, timeout=60.0)
        assert trio.current_time() - start == pytest.approx(30.0)

        faults.crash()
        await h.send("inproc://echo", Ping(4))
        await h.wait_event(lambda e: e.kind == "crashed")
        await h.send("inproc://echo", Ping(5))
        assert (await out.expect(Pong)).n == 5

        faults.hang()
        await h.send("inproc://echo", Ping(6))
        await out.expect_nothing(100.0)


async def test_link_faults_drop_and_delay(autojump_clock):
    async with open_harness() as h:
        out = await h.probe("inproc://out", Pong)
        await h.start_actor("echo", lambda: Echo("inproc://out"), "inproc://echo")
        link = h.link("inproc://out")
        link.drop(2)
        for n in range(3):
            await h.send("inproc://echo", Ping(n))
        assert (await out.expect(Pong)).n == 2
        assert link.dropped == 2
        link.delay = 5.0
        start = trio.current_time()
        await h.send("inproc://echo", Ping(9))
        await out.expect(Pong, where=lambda m: m.n == 9, timeout=10)
        assert trio.current_time() - start >= 5.0


async def test_malformed_frames_are_dropped_and_the_actor_keeps_serving(autojump_clock):
    async with open_harness() as h:
        out = await h.probe("inproc://out", Pong)
        sup = await h.start_actor("echo", lambda: Echo("inproc://out"), "inproc://echo")
        await h.send_frames("inproc://echo", [b"\xc1"])
        await h.send_frames("inproc://echo", [b"\x92\xa4Ping"])
        await h.send_frames("inproc://echo", [b"\x92\xa4Nope\x01"])
        await h.send("inproc://echo", Ping(1))
        assert (await out.expect(Pong)).n == 1
        assert sup.restarts == {"echo": 0}
        assert not [e for e in h.events if e.kind == "crashed"]


async def test_probe_reports_what_it_did_not_get(autojump_clock):
    async with open_harness() as h:
        out = await h.probe("inproc://out", Pong)
        with pytest.raises(AssertionError, match="nothing arrived"):
            await out.expect(Pong, timeout=1.0)
        await h.start_actor("echo", lambda: Echo("inproc://out"), "inproc://echo")
        await h.send("inproc://echo", Ping(1))
        with pytest.raises(AssertionError, match="unexpected"):
            await out.expect(Pong, where=lambda m: m.n == 2)

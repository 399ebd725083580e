"""A peer that answers twice, answers what was never asked, or names no reply address.

Through real sockets (and inproc): the actor never crashes, nothing is
delivered twice, and ``stats`` counts what was dropped.
"""

from __future__ import annotations

import pytest
import trio

from actors import Call, Reply
from actors import actor as actor_module
from actors.actor import HEARTBEAT_PATIENCE_S, REPLY_PATIENCE_S, Caller, Heartbeat
from actors.testing import open_harness

from ..conftest import free_tcp_port
from .messages import Ask, Echo, Get, Ping, Pong

SCHEMES = ["inproc", "ipc", "tcp"]


@pytest.fixture(params=SCHEMES)
def address(request, tmp_path):
    """``address(name)``: an address of the scheme under test."""

    def make(name: str) -> str:
        if request.param == "inproc":
            return f"inproc://{name}"
        if request.param == "ipc":
            return f"ipc://{tmp_path}/{name}.sock"
        return f"tcp://127.0.0.1:{free_tcp_port()}"

    return make


async def stop(h, sup):
    """Stop the actor while its peers still answer (its senders' closes are acknowledged at once)."""
    await sup.stop()
    await h.wait_event(lambda e: e.kind == "stopped")


async def test_unknown_and_duplicate_replies_are_dropped_and_counted(address):
    echo, callee, out = address("echo"), address("callee"), address("out")
    async with open_harness() as h:
        pongs = await h.probe(out, Pong)
        sup = await h.start_actor("echo", lambda: Echo(out), echo)
        calls = await h.hub.bind(callee, Call[Get])  # the callee the actor asks: the test
        answer = trio.Event()
        result = []

        async def ask():
            result.append(await h.call(echo, Ask(callee), reply=int, timeout=10))
            answer.set()

        with trio.fail_after(10):  # a bound that fails; every wait below is on an event
            h.nursery.start_soon(ask)
            asked = await calls.receive()
            assert asked.reply_to == echo and isinstance(asked.body, Get)
            await h.send(echo, Reply(asked.id + 1000, 1))  # never asked
            await h.send(echo, Reply(asked.id, 5))
            await h.send(echo, Reply(asked.id, 6))  # a duplicate
            await h.send(echo, Reply(asked.id, 7))  # and another
            await h.send(echo, Ping(1))  # sent after the replies: handled after they are
            assert (await pongs.expect(Pong)).n == 1
            await answer.wait()
        assert result == [1005]  # the first answer, once
        assert sup.child("echo").stats.as_dict() == {
            "mailbox": {}, "runtime": {"unknown reply": 1, "unawaited reply": 2},
        }
        assert h.count("crashed") == 0
        await stop(h, sup)
        await calls.aclose()


async def test_calls_without_a_usable_reply_address_are_refused_unhandled(address):
    echo, out = address("echo"), address("out")
    async with open_harness() as h:
        pongs = await h.probe(out, Pong)
        sup = await h.start_actor("echo", lambda: Echo(out), echo)
        with trio.fail_after(10):
            for call_id, reply_to in enumerate(["bogus", "udp://10.0.0.1:5", "tcp://*:5555",
                                                "tcp://127.0.0.1:0", "inproc://"]):
                await h.send(echo, Call(call_id, reply_to, Ping(100 + call_id)))
            await h.send(echo, Heartbeat(9, "nowhere"))
            # well-formed, but no socket can connect to it: handled, the reply dropped
            await h.send(echo, Call(10, "ipc:///" + "x" * 200, Ping(10)))
            await h.send(echo, Ping(11))
            assert [(await pongs.expect(Pong)).n for _ in range(2)] == [10, 11]
            assert await h.call(echo, Get(), reply=int) == 2  # the refused calls were not handled
        assert sup.child("echo").stats.as_dict() == {
            "mailbox": {}, "runtime": {"unanswerable call": 6, "unanswerable heartbeat": 1},
        }
        assert h.count("crashed") == 0
        await stop(h, sup)


async def test_replies_nobody_takes_are_dropped_and_the_actor_serves_on(autojump_clock):
    """inproc: a send waits for its name to be bound; a peer may name one nobody binds."""
    async with open_harness() as h:
        pongs = await h.probe("inproc://out", Pong)
        sup = await h.start_actor("echo", lambda: Echo("inproc://out"), "inproc://echo")
        start = trio.current_time()
        await h.send("inproc://echo", Heartbeat(1, "inproc://nobody"))
        await h.send("inproc://echo", Call(2, "inproc://nobody-either", Ping(2)))
        await h.send("inproc://echo", Ping(3))
        assert (await pongs.expect(Pong, timeout=60)).n == 2
        assert trio.current_time() - start == pytest.approx(HEARTBEAT_PATIENCE_S)
        assert (await pongs.expect(Pong, timeout=60)).n == 3  # after the reply to Call 2 was given up
        assert trio.current_time() - start == pytest.approx(HEARTBEAT_PATIENCE_S + REPLY_PATIENCE_S)
        assert sup.child("echo").stats.as_dict() == {"mailbox": {}, "runtime": {"undelivered reply": 2}}
        assert h.count("crashed") == 0


async def test_replies_to_more_addresses_than_max_peers_are_dropped(autojump_clock, monkeypatch):
    monkeypatch.setattr(actor_module, "MAX_PEERS", 2)
    async with open_harness() as h:
        probes = [await h.probe(f"inproc://r{n}", Reply) for n in range(3)]
        sup = await h.start_actor("echo", lambda: Echo("inproc://out"), "inproc://echo")
        for n in range(3):
            await h.send("inproc://echo", Call(n, f"inproc://r{n}", Get()))
        await h.send("inproc://echo", Call(9, "inproc://r0", Get()))  # an address it sends to already
        assert [(await probes[0].expect(Reply)).id for _ in range(2)] == [0, 9]
        assert [r.id for r in probes[1].received] == [1] and probes[2].received == []
        assert sup.child("echo").stats.as_dict() == {"mailbox": {}, "runtime": {"unanswerable call": 1}}


async def test_undecodable_frames_are_counted_in_the_mailbox_stats(address):
    echo, out = address("echo"), address("out")
    async with open_harness() as h:
        pongs = await h.probe(out, Pong)
        sup = await h.start_actor("echo", lambda: Echo(out), echo)
        await h.send_frames(echo, [b"\xc1"])
        await h.send(echo, Ping(1))
        with trio.fail_after(10):
            assert (await pongs.expect(Pong)).n == 1
        assert sup.child("echo").stats.as_dict() == {"mailbox": {"malformed": 1}, "runtime": {}}
        await stop(h, sup)


async def test_a_caller_resolves_each_call_once(autojump_clock):
    """The unit below the wire: ids never issued, answered twice, answered after a give-up."""
    caller = Caller("inproc://me")
    received = []

    class Loopback:  # a sender whose peer answers every request twice, at once
        address = "inproc://peer"

        async def send(self, call):
            received.append(call)
            caller.resolve(Reply(call.id, call.body.n))
            caller.resolve(Reply(call.id, -1))

    assert await caller.call(Loopback(), Ping(3)) == 3
    caller.resolve(Reply(0, 0))
    caller.resolve(Reply(2, 0))
    assert dict(caller.dropped.counts) == {"unawaited reply": 1, "unknown reply": 2}


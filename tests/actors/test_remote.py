"""Heartbeats stand in for liveness of actors without a pid."""

import trio

from actors import ChildSpec
from actors.remote import HeartbeatLost, RemoteChild
from actors.testing import open_harness

from .messages import Echo, Ping, Pong


async def test_heartbeats_are_answered_while_the_handler_is_busy(autojump_clock):
    async with open_harness() as h:
        await h.start_actor("peer", lambda: Echo("inproc://out"), "inproc://peer")
        h.faults("peer").hang()
        await h.send("inproc://peer", Ping(1))  # the handler is now stuck
        with trio.fail_after(60.0):  # MockClock: unanswered heartbeats fail here, not at the suite timeout
            monitor = await h.start_supervisor("mon", [ChildSpec(
                "peer-link", lambda: RemoteChild("inproc://peer", h.hub, reply_to="inproc://mon", interval=1.0,
                                                 timeout=3.0))])
        await trio.sleep(30.0)
        assert monitor.child("peer-link").answered >= 20
        assert h.count("crashed", "peer-link") == 0


async def test_a_silent_peer_is_a_crash_and_the_link_waits_for_its_return(autojump_clock):
    async with open_harness() as h:
        peer = await h.start_actor("peer", lambda: Echo("inproc://out"), "inproc://peer")
        await h.start_supervisor("mon", [ChildSpec(
            "peer-link", lambda: RemoteChild("inproc://peer", h.hub, reply_to="inproc://mon", interval=1.0, timeout=3.0))],
            max_restarts=5, within=60.0)
        await trio.sleep(5.0)
        await peer.stop()  # the host goes away
        t0 = trio.current_time()
        crash = await h.wait_event(lambda e: e.child == "peer-link" and e.kind == "crashed", timeout=30)
        assert isinstance(crash.reason, HeartbeatLost)
        assert trio.current_time() - t0 <= 1.0 + 3.0 + 0.1
        await trio.sleep(20.0)  # the link was restarted and waits for the peer
        assert h.count("restarting", "peer-link") == 1 and h.count("started", "peer-link") == 1
        await h.start_actor("peer2", lambda: Echo("inproc://out"), "inproc://peer")
        await h.wait_event(lambda e: h.count("started", "peer-link") == 2, timeout=30)


async def test_heartbeats_over_tcp(tcp_address):
    peer_address, reply_to = tcp_address(), tcp_address()
    async with open_harness() as h:
        out = await h.probe("inproc://out", Pong)
        await h.start_actor("peer", lambda: Echo("inproc://out"), peer_address)
        with trio.fail_after(10):  # a bound that fails; no event says "answered", so the count is polled
            link = await h.start_supervisor("mon", [ChildSpec(
                "peer-link", lambda: RemoteChild(peer_address, h.hub, reply_to=reply_to, interval=0.05, timeout=2.0))])
            await h.send(peer_address, Ping(3))
            assert (await out.expect(Pong)).n == 3
            while link.child("peer-link").answered < 3:
                await trio.sleep(0.05)
        assert h.count("crashed", "peer-link") == 0

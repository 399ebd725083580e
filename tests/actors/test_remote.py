"""Heartbeats stand in for liveness of actors without a pid: they answer which start of the
actor answers and whether it serves yet."""

import trio

from actors import ChildSpec, Reply
from actors.actor import Heartbeat
from actors.remote import HeartbeatLost, Monitor, PeerRestarted, RemoteChild
from actors.testing import open_harness

from .messages import Echo, Ping, Pong


async def watch(h, peer, *, name="peer-link", monitor="inproc://mon", **options):
    """A supervisor ``mon`` over a Monitor and a RemoteChild of ``peer`` (not waited for)."""
    options = {"interval": 1.0, "timeout": 3.0, **options}
    monitors = []

    def start_monitor():
        monitors.append(Monitor(h.hub, monitor))
        return monitors[-1]

    return await h.start_supervisor("mon", [
        ChildSpec("monitor", start_monitor),
        ChildSpec(name, lambda: RemoteChild(peer, lambda: monitors[-1], **options), wait=False)], max_restarts=None)


async def test_heartbeats_are_answered_while_the_handler_is_busy(autojump_clock):
    async with open_harness() as h:
        await h.start_actor("peer", lambda: Echo("inproc://out"), "inproc://peer")
        h.faults("peer").hang()
        await h.send("inproc://peer", Ping(1))  # the handler is now stuck
        monitor = await watch(h, "inproc://peer")
        with trio.fail_after(60.0):  # MockClock: unanswered heartbeats fail here, not at the suite timeout
            await h.wait_event(lambda e: e.child == "peer-link" and e.kind == "started")
        await trio.sleep(30.0)
        assert monitor.child("peer-link").answered >= 20
        assert h.count("crashed", "peer-link") == 0


async def test_a_silent_peer_is_a_crash_and_the_link_waits_for_its_return(autojump_clock):
    async with open_harness() as h:
        peer = await h.start_actor("peer", lambda: Echo("inproc://out"), "inproc://peer")
        await watch(h, "inproc://peer")
        await h.wait_event(lambda e: e.child == "peer-link" and e.kind == "started")
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


async def test_a_peer_that_restarted_between_two_heartbeats_is_a_crash_and_its_new_start_is_watched(autojump_clock):
    async with open_harness() as h:
        peer = await h.start_actor("peer", lambda: Echo("inproc://out"), "inproc://peer")
        sup = await watch(h, "inproc://peer", timeout=30.0)
        await h.wait_event(lambda e: e.child == "peer-link" and e.kind == "started")
        first = sup.child("peer-link").boot
        await peer.stop()
        await h.wait_event(lambda e: e.child == "peer" and e.kind == "stopped")
        await h.start_actor("peer2", lambda: Echo("inproc://out"), "inproc://peer")  # back within the timeout
        crash = await h.wait_event(lambda e: e.child == "peer-link" and e.kind == "crashed", timeout=30)
        assert isinstance(crash.reason, PeerRestarted) and h.count("crashed", "peer-link") == 1
        await h.wait_event(lambda e: h.count("started", "peer-link") == 2, timeout=30)
        assert sup.child("peer-link").boot not in (None, first)


class Loading(Echo):
    """An Echo that serves once ``loaded`` is set (a model loading after its mailbox is bound)."""

    def __init__(self, loaded: trio.Event):
        super().__init__("inproc://out")
        self.loaded = loaded

    async def until_ready(self):
        await self.loaded.wait()


async def test_a_peer_that_answers_it_is_loading_is_waited_for_until_it_serves(autojump_clock):
    loaded, pulses = trio.Event(), []
    async with open_harness() as h:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(h.start_actor, "peer", lambda: Loading(loaded), "inproc://peer")
            await watch(h, "inproc://peer", on_pulse=pulses.append)
            await trio.sleep(20.0)
            assert h.count("started", "peer-link") == 0 and h.count("crashed", "peer-link") == 0
            assert len(pulses) >= 10 and not any(p.ready for p in pulses)
            loaded.set()
        await h.wait_event(lambda e: e.child == "peer-link" and e.kind == "started", timeout=5)
        assert pulses[-1].ready and pulses[-1].boot == pulses[0].boot


async def test_a_start_shunned_is_waited_past(autojump_clock):
    """A link told to shun the peer's start (given up on: its outputs stalled) is ready only once
    the peer restarted."""
    async with open_harness() as h:
        peer = await h.start_actor("peer", lambda: Echo("inproc://out"), "inproc://peer")
        seen = await watch(h, "inproc://peer", name="first")
        await h.wait_event(lambda e: e.child == "first" and e.kind == "started")
        boot = seen.child("first").boot
        sup = await h.start_supervisor("shunning", [ChildSpec(
            "second", lambda: RemoteChild("inproc://peer", lambda: seen.child("monitor"), shun={boot}), wait=False)])
        await trio.sleep(20.0)
        assert h.count("started", "second") == 0
        await peer.stop()
        await h.wait_event(lambda e: e.child == "peer" and e.kind == "stopped")
        await h.start_actor("peer2", lambda: Echo("inproc://out"), "inproc://peer")
        await h.wait_event(lambda e: e.child == "second" and e.kind == "started", timeout=30)
        assert sup.child("second").boot != boot


async def test_a_peer_of_an_earlier_build_answering_an_empty_reply_is_watched_without_a_boot(autojump_clock):
    async with open_harness() as h, trio.open_nursery() as nursery:
        async def earlier_build():  # answers heartbeats with an empty Reply, as before Pulse
            async with await h.hub.bind("inproc://old", Heartbeat) as inbox:
                async for beat in inbox:
                    await h.send(beat.reply_to, Reply(beat.id))

        nursery.start_soon(earlier_build)
        sup = await watch(h, "inproc://old")
        await h.wait_event(lambda e: e.child == "peer-link" and e.kind == "started", timeout=10)
        await trio.sleep(10.0)
        assert sup.child("peer-link").boot is None and sup.child("peer-link").answered >= 5
        assert h.count("crashed", "peer-link") == 0
        nursery.cancel_scope.cancel()


async def test_a_peer_answering_something_else_than_a_pulse_is_waited_for_not_restarted_in_a_loop(autojump_clock):
    async with open_harness() as h, trio.open_nursery() as nursery:
        async def stranger():  # answers heartbeats, but not with a Pulse
            async with await h.hub.bind("inproc://stranger", Heartbeat) as inbox:
                async for beat in inbox:
                    await h.send(beat.reply_to, Reply(beat.id, "hello"))

        nursery.start_soon(stranger)
        await watch(h, "inproc://stranger")
        await trio.sleep(30.0)
        assert h.count("started", "peer-link") == 0 and h.count("crashed", "peer-link") == 0
        nursery.cancel_scope.cancel()


async def test_heartbeats_over_tcp(tcp_address):
    peer_address, reply_to = tcp_address(), tcp_address()
    async with open_harness() as h:
        out = await h.probe("inproc://out", Pong)
        await h.start_actor("peer", lambda: Echo("inproc://out"), peer_address)
        with trio.fail_after(10):  # a bound that fails; no event says "answered", so the count is polled
            link = await watch(h, peer_address, monitor=reply_to, interval=0.05, timeout=2.0)
            await h.send(peer_address, Ping(3))
            assert (await out.expect(Pong)).n == 3
            while link.child("peer-link") is None or link.child("peer-link").answered < 3:
                await trio.sleep(0.05)
        assert h.count("crashed", "peer-link") == 0

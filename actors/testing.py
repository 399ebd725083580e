"""A harness for testing actors and supervision trees, with fault injection.

Run tests on trio's ``MockClock(autojump_threshold=0)`` (pytest-trio: the
``autojump_clock`` fixture) and every deadline, watchdog and back-off below
finishes in milliseconds of real time::

    async def test_echo(autojump_clock):
        async with open_harness() as h:
            out = await h.probe("inproc://out", Pong)
            await h.start_actor("echo", lambda: Echo(reply_to="inproc://out"), "inproc://echo")
            await h.send("inproc://echo", Ping(1))
            assert (await out.expect(Pong)).n == 1

What it offers:

- ``start_actor`` / ``start_supervisor``: run one actor, or a small tree,
  under the harness; supervisor events are recorded (``events``,
  ``wait_event``).
- ``probe(address, type)``: a peer that binds ``address`` and records what
  arrives; ``expect`` the next message (with a deadline), ``expect_nothing``.
- ``send`` / ``call`` / ``send_frames`` (raw, possibly malformed frames).
- Faults: ``faults(name)`` of a started actor queues ``crash``, ``hang``,
  ``delay`` or ``drop`` for its next messages; ``link(address)`` drops or
  delays messages sent to an address by anyone in the harness's hub.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from transports import Address, Frames, Hub, HubOptions, Sender

from .actor import Actor, ActorChild, Caller, Reply
from .supervisor import ChildSpec, Restart, Supervisor, SupervisorEvent

__all__ = ["ActorFaults", "Harness", "InjectedCrash", "LinkFaults", "Probe", "open_harness"]


class InjectedCrash(Exception):
    """Raised inside an actor by ``ActorFaults.crash``."""


class ActorFaults:
    """Faults applied to an actor's next messages, in the order queued."""

    def __init__(self) -> None:
        self._queue: deque[tuple[str, float]] = deque()
        self.dispatched = 0

    def crash(self) -> None:
        self._queue.append(("crash", 0.0))

    def hang(self) -> None:
        self._queue.append(("hang", 0.0))

    def delay(self, seconds: float) -> None:
        self._queue.append(("delay", seconds))

    def drop(self, count: int = 1) -> None:
        self._queue.extend([("drop", 0.0)] * count)

    async def before_dispatch(self, msg: Any) -> bool:
        self.dispatched += 1
        if not self._queue:
            return True
        kind, seconds = self._queue.popleft()
        if kind == "crash":
            raise InjectedCrash(f"injected crash before handling {type(msg).__name__}")
        if kind == "hang":
            await trio.sleep_forever()
        if kind == "delay":
            await trio.sleep(seconds)
        return kind != "drop"


class LinkFaults:
    """Drop or delay the next messages sent to one address."""

    def __init__(self) -> None:
        self.to_drop = 0
        self.delay = 0.0
        self.dropped = 0

    def drop(self, count: int = 1) -> None:
        self.to_drop += count


class _FaultySender(Sender):
    def __init__(self, inner: Sender, faults: LinkFaults) -> None:
        self.address = inner.address
        self._inner = inner
        self._faults = faults

    async def send(self, value: Any) -> None:
        if self._faults.delay:
            await trio.sleep(self._faults.delay)
        if self._faults.to_drop:
            self._faults.to_drop -= 1
            self._faults.dropped += 1
            await trio.lowlevel.checkpoint()
            return
        await self._inner.send(value)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _FaultyHub(Hub):
    """A Hub whose senders consult the harness's link faults."""

    def __init__(self, nursery: trio.Nursery, options: HubOptions | None = None) -> None:
        super().__init__(nursery, options)
        self.links: dict[str, LinkFaults] = {}

    async def connect(self, address: Any, **kwargs: Any) -> Sender:
        sender = await super().connect(address, **kwargs)
        faults = self.links.setdefault(str(Address.parse(str(address))), LinkFaults())
        return _FaultySender(sender, faults)


class Probe:
    """A peer bound at an address that records every message it receives."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.received: list[Any] = []
        self._unread: deque[Any] = deque()
        self._arrived = trio.Event()

    def _put(self, msg: Any) -> None:
        self.received.append(msg)
        self._unread.append(msg)
        self._arrived.set()

    async def expect(self, type_: type | tuple[type, ...] = object, *,
                     where: Callable[[Any], bool] | None = None, timeout: float = 5.0) -> Any:
        """The next message; it must be a ``type_`` (and satisfy ``where``)."""
        with trio.move_on_after(timeout):
            while not self._unread:
                self._arrived = trio.Event()
                await self._arrived.wait()
            msg = self._unread.popleft()
            assert isinstance(msg, type_), f"{self.address}: expected {type_}, got {msg!r}"
            assert where is None or where(msg), f"{self.address}: unexpected {msg!r}"
            return msg
        raise AssertionError(f"{self.address}: nothing arrived within {timeout:g} s")

    async def expect_nothing(self, seconds: float) -> None:
        await trio.sleep(seconds)
        assert not self._unread, f"{self.address}: unexpected {list(self._unread)!r}"


class Harness:
    def __init__(self, hub: _FaultyHub, nursery: trio.Nursery) -> None:
        self.hub = hub
        self.nursery = nursery
        self.events: list[SupervisorEvent] = []
        self._event_arrived = trio.Event()
        self._faults: dict[str, ActorFaults] = {}
        self._senders: dict[str, Sender] = {}
        self._caller = Caller(f"inproc://harness-replies-{id(self)}")
        self._names = itertools.count()

    # -- running things --------------------------------------------------------

    def record(self, event: SupervisorEvent) -> None:
        self.events.append(event)
        self._event_arrived.set()
        self._event_arrived = trio.Event()

    def actor_spec(self, name: str, factory: Callable[[], Actor], address: str, *,
                   restart: Restart = Restart.PERMANENT, shutdown: float = 5.0,
                   capacity: int = 64, with_previous: bool = False, wait: bool = True) -> ChildSpec:
        """A ChildSpec for an actor whose faults this harness can inject."""
        faults = self._faults.setdefault(name, ActorFaults())
        return ChildSpec(
            name,
            lambda: ActorChild(factory, address, self.hub, capacity=capacity, faults=faults),
            restart,
            shutdown,
            with_previous,
            wait,
        )

    async def start_supervisor(self, name: str, children: Sequence[ChildSpec],
                               **options: Any) -> Supervisor:
        supervisor = Supervisor(name, children, observer=self.record, **options)
        await self.nursery.start(_run_expecting, supervisor, self)
        return supervisor

    async def start_actor(self, name: str, factory: Callable[[], Actor], address: str,
                          **options: Any) -> Supervisor:
        """One actor under a one_for_one supervisor named ``name + '-sup'``."""
        return await self.start_supervisor(f"{name}-sup", [self.actor_spec(name, factory, address, **options)])

    def faults(self, name: str) -> ActorFaults:
        return self._faults.setdefault(name, ActorFaults())

    def link(self, address: str) -> LinkFaults:
        return self.hub.links.setdefault(str(Address.parse(address)), LinkFaults())

    def count(self, kind: str, child: str | None = None, supervisor: str | None = None) -> int:
        """How many recorded events match ``kind`` (and ``child``/``supervisor``)."""
        return sum(
            e.kind == kind and child in (None, e.child) and supervisor in (None, e.supervisor)
            for e in self.events
        )

    async def wait_event(self, where: Callable[[SupervisorEvent], bool], *,
                         timeout: float = 10.0) -> SupervisorEvent:
        """The first recorded event (past or future) that satisfies ``where``."""
        with trio.move_on_after(timeout):
            seen = 0
            while True:
                for event in self.events[seen:]:
                    if where(event):
                        return event
                seen = len(self.events)
                await self._event_arrived.wait()
        raise AssertionError(f"no such supervisor event within {timeout:g} s: {self.events!r}")

    # -- talking to things -----------------------------------------------------

    async def probe(self, address: str, type_: Any = Any) -> Probe:
        probe = Probe(address)
        receiver = await self.hub.bind(address, type_ if type_ is not Any else _ANY)
        self.nursery.start_soon(_pump, receiver, probe._put)
        return probe

    async def _sender(self, address: str) -> Sender:
        if address not in self._senders:
            self._senders[address] = await self.hub.connect(address)
        return self._senders[address]

    async def send(self, address: str, msg: Any) -> None:
        await (await self._sender(address)).send(msg)

    async def send_frames(self, address: str, frames: Sequence[bytes]) -> None:
        """Raw frames, as if from the wire: the receiver must decode (or drop) them."""
        await (await self._sender(address)).send(Frames(frames))

    async def call(self, address: str, msg: Any, *, reply: Any = None, timeout: float = 5.0) -> Any:
        if not hasattr(self, "_replies_bound"):
            self._replies_bound = await self.hub.bind(self._caller.reply_to, Reply)
            self.nursery.start_soon(_pump, self._replies_bound, self._caller.resolve)
        return await self._caller.call(await self._sender(address), msg, reply=reply, timeout=timeout)


_ANY = Any


async def _pump(receiver: Any, put: Callable[[Any], None]) -> None:
    async with receiver:
        async for msg in receiver:
            put(msg)


async def _run_expecting(supervisor: Supervisor, harness: Harness, task_status: Any) -> None:
    """Run a supervisor; a failure after it started is recorded for the test to assert on."""
    started = False

    class Status:
        def started(self, value: Any = None) -> None:
            nonlocal started
            started = True
            task_status.started(value)

    try:
        await supervisor.run(task_status=Status())
    except Exception as exc:
        if not started:
            raise
        harness.record(SupervisorEvent(supervisor.name, "", "failed", exc))


@asynccontextmanager
async def open_harness(options: HubOptions | None = None) -> AsyncIterator[Harness]:
    """A harness whose hub has ``options`` (CURVE, bounds; the defaults if None)."""
    # open_hub builds a plain Hub; this one is built the same way, with link faults
    async with trio.open_nursery() as hub_nursery:
        hub = _FaultyHub(hub_nursery, options)
        try:
            async with trio.open_nursery() as nursery:
                harness = Harness(hub, nursery)
                try:
                    yield harness
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await hub.aclose()
            hub_nursery.cancel_scope.cancel()

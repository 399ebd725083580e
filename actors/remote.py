"""Actors on another host: no pid to wait on, so heartbeats stand in for liveness.

``RemoteChild`` is a supervisor child that owns nothing but a question: does
the actor at ``address`` still answer, and is it the same start of it? It is
ready once the peer answers a heartbeat saying that it serves (an actor still
loading answers "not ready": the child waits), then sends one every
``interval`` seconds. A heartbeat unanswered for ``timeout`` seconds is a crash
(``HeartbeatLost``), and so is an answer from another start of the peer
(``PeerRestarted``: whatever the one watched held is gone). The supervisor's
policy applies: a restart is a new child, waiting for the peer to serve again.

Heartbeats are answered by the peer's runtime, not its handler, so they
prove the peer's process and event loop are alive; a stuck step is the
business of the peer's own step watchdog.

The answers come back to one mailbox, a ``Monitor`` (a supervisor child of its
own, started before the ``RemoteChild``-ren it serves): the peers must be
able to reach its address.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import trio

from transports import AddressError, DropCounter, Hub, Sender

from ._errors import CallError, CallTimeout
from .actor import MAX_PEERS, Caller, Pulse, Reply

__all__ = ["HeartbeatLost", "Monitor", "PeerRestarted", "RemoteChild"]

log = logging.getLogger("actors.remote")


class HeartbeatLost(Exception):
    pass


class PeerRestarted(Exception):
    """The peer answers, but from another start than the one watched: what it held is lost."""


class Monitor:
    """A supervisor child: the mailbox at ``address`` (listening at ``bind``) where the answers to
    heartbeats come back, and the heartbeats sent from it (``heartbeat``, once it started)."""

    def __init__(self, hub: Hub, address: str, *, bind: str | None = None) -> None:
        self.hub = hub
        self.address = address
        self.bind = bind or address
        self.dropped = DropCounter(address)  # answers no heartbeat waits for (late, duplicate, unknown)
        self._caller = Caller(address, dropped=self.dropped)
        self._senders: dict[str, Sender] = {}
        self._stopped = trio.Event()

    async def stop(self) -> None:
        self._stopped.set()
        await trio.lowlevel.checkpoint()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with await self.hub.bind(self.bind, Reply) as replies, trio.open_nursery() as nursery:
                nursery.start_soon(self._resolve, replies)
                task_status.started(self)
                await self._stopped.wait()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                for sender in self._senders.values():
                    await sender.aclose()
            self._senders.clear()

    async def heartbeat(self, address: str, *, timeout: float) -> Pulse | None:
        """Ask the actor at ``address`` how it is: its ``Pulse`` (None from a peer of an earlier build,
        whose answer says nothing); CallTimeout when no answer came within ``timeout``."""
        sender = self._senders.get(address)
        if sender is None:
            if len(self._senders) >= MAX_PEERS:  # (peers that moved: the oldest address goes)
                with trio.CancelScope(shield=True):
                    await self._senders.pop(next(iter(self._senders))).aclose()
            try:
                sender = self._senders[address] = await self.hub.connect(address)
            except (AddressError, OSError) as exc:  # (a name that does not resolve yet: a pod not up)
                await trio.sleep(timeout)
                raise CallTimeout(f"{address}: {exc}") from None
        return await self._caller.heartbeat(sender, timeout=timeout)

    async def _resolve(self, replies: Any) -> None:
        async for reply in replies:
            self._caller.resolve(reply)


class RemoteChild:
    """A supervisor child watching the actor at ``address`` (or where ``address()`` says at each
    heartbeat: a peer that moves) through ``monitor`` (or ``monitor()``: the one running). It is ready
    once the peer serves, from a start not in ``shun`` (a start given up on: the child waits for
    the next); ``on_pulse`` hears every answer while it waits and after."""

    def __init__(self, address: str | Callable[[], str], monitor: Monitor | Callable[[], Monitor | None], *,
                 interval: float = 1.0, timeout: float = 3.0, shun: Collection[str] = (),
                 on_pulse: Callable[[Pulse], None] | None = None) -> None:
        self._address = address
        self._monitor = monitor
        self.interval = interval
        self.timeout = timeout
        self.shun = shun
        self.on_pulse = on_pulse
        self.boot: str | None = None  # the start of the peer watched (None: its answers say nothing)
        self.answered = 0
        self._stopped = trio.Event()

    @property
    def address(self) -> str:
        return self._address if isinstance(self._address, str) else self._address()

    async def stop(self) -> None:
        self._stopped.set()
        await trio.lowlevel.checkpoint()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        while True:  # ready once the peer serves
            try:
                pulse = await self._beat()
            except CallError as exc:  # (no answer, or one that is no Pulse: a peer of another kind)
                log.info("waiting for %s to answer a heartbeat: %s", self.address, exc)
            else:
                if pulse is None or (pulse.ready and pulse.boot not in self.shun):
                    break
            if await self._stopping():
                return
        self.boot = None if pulse is None else pulse.boot
        task_status.started(self)
        while not await self._stopping():
            try:
                pulse = await self._beat()
            except CallTimeout:
                raise HeartbeatLost(f"{self.address} missed its heartbeat deadline ({self.timeout:g} s)") from None
            except CallError as exc:
                raise HeartbeatLost(f"{self.address} answered its heartbeat with no pulse: {exc}") from None
            if pulse is not None and pulse.boot != self.boot:
                raise PeerRestarted(f"{self.address} restarted (it answers from another start)")
            self.answered += 1

    async def _beat(self) -> Pulse | None:
        monitor = self._monitor if isinstance(self._monitor, Monitor) else self._monitor()
        if monitor is None:  # (restarting)
            await trio.sleep(self.timeout)
            raise CallTimeout("no monitor runs to send a heartbeat from")
        pulse = await monitor.heartbeat(self.address, timeout=self.timeout)
        if pulse is not None and self.on_pulse is not None:
            self.on_pulse(pulse)
        return pulse

    async def _stopping(self) -> bool:
        """Wait ``interval``: whether the child was asked to stop meanwhile."""
        with trio.move_on_after(self.interval):
            await self._stopped.wait()
        return self._stopped.is_set()

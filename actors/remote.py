"""Actors on another host: no pid to wait on, so heartbeats stand in for liveness.

``RemoteChild`` is a supervisor child that owns nothing but a question: does
the actor at ``address`` still answer? It is ready once a heartbeat is
answered, then sends one every ``interval`` seconds; a heartbeat unanswered
for ``timeout`` seconds is a crash (HeartbeatLost), and the supervisor's
policy applies: a restart waits for the peer to answer again, and the
restart intensity decides when to give up.

Heartbeats are answered by the peer's runtime, not its handler, so they
prove the peer's process and event loop are alive; a stuck step is the
business of the peer's own step watchdog.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from transports import DropCounter, Hub

from ._errors import CallTimeout
from .actor import Caller, Reply

__all__ = ["HeartbeatLost", "RemoteChild"]

log = logging.getLogger("actors.remote")


class HeartbeatLost(Exception):
    pass


class RemoteChild:
    def __init__(self, address: str, hub: Hub, *, reply_to: str, interval: float = 1.0,
                 timeout: float = 3.0) -> None:
        self.address = address
        self.hub = hub
        self.reply_to = reply_to
        self.interval = interval
        self.timeout = timeout
        self.answered = 0
        self.dropped = DropCounter(reply_to)  # replies no heartbeat waits for (late, duplicate, unknown)
        self._stopped = trio.Event()

    async def stop(self) -> None:
        self._stopped.set()
        await trio.lowlevel.checkpoint()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        caller = Caller(self.reply_to, dropped=self.dropped)
        async with await self.hub.bind(self.reply_to, Reply) as replies, \
                await self.hub.connect(self.address) as sender, trio.open_nursery() as nursery:
            nursery.start_soon(_resolve_replies, replies, caller)
            while True:  # ready once the peer answers at all
                try:
                    await caller.heartbeat(sender, timeout=self.timeout)
                    break
                except CallTimeout:
                    log.info("waiting for %s to answer a heartbeat", self.address)
            task_status.started(self)
            while True:
                with trio.move_on_after(self.interval):
                    await self._stopped.wait()
                    break
                try:
                    await caller.heartbeat(sender, timeout=self.timeout)
                except CallTimeout:
                    raise HeartbeatLost(f"{self.address} missed its heartbeat deadline ({self.timeout:g} s)") from None
                self.answered += 1
            nursery.cancel_scope.cancel()


async def _resolve_replies(replies: Any, caller: Caller) -> None:
    async for reply in replies:
        caller.resolve(reply)

"""Watching a ZeroMQ socket's monitor from trio: handshakes, disconnections."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from transports._zmqsocket import close_socket, wait_to_retry

HANDSHAKE_OUTCOMES = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
ADMITTED = (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
REFUSED_KEY = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)  # the ZAP handler does not know the client key


@asynccontextmanager
async def events_of(sock: zmq.Socket, events: int = HANDSHAKE_OUTCOMES) -> Any:
    """``next_event()``: (event, value) of the socket's next monitor event among ``events``.

    Attach it before the peer connects, so no event is missed. For a hub's
    receiver, pass its ROUTER (no public handle: the private ``_sock``).
    """
    monitor = sock.get_monitor_socket(events)
    fd = monitor.getsockopt(zmq.FD)

    async def next_event() -> tuple[int, int]:
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                await wait_to_retry(monitor, fd, zmq.POLLIN)
                continue
            return event["event"], event["value"]

    try:
        yield next_event
    finally:
        sock.disable_monitor()
        close_socket(monitor, fd)

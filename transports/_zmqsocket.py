"""One ZeroMQ socket driven from trio, with the pitfalls of doing so handled.

pyzmq has no trio support, so the socket's ``FD`` is waited on directly. That
FD is edge-triggered: it says "the socket's state may have changed", and
reading ``EVENTS`` consumes the edge. The rules kept here:

1. always try a ``NOBLOCK`` operation first and sleep only on ``zmq.Again``;
2. re-read ``EVENTS`` before every sleep on the FD (:func:`wait_to_retry`);
3. one task owns a socket and is the only one ever waiting on its FD;
4. ``notify_closing`` before ``close`` (:func:`close_socket`);
5. a send with no peer raises ``zmq.Again``: wait for ``POLLOUT``.

The hot path avoids ``getsockopt``, ``send_multipart`` and
``recv_multipart``: each costs microseconds in pyzmq 27, more than a frame.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Any

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from .base import AddressError

__all__ = [
    "YIELD_EVERY",
    "RECONNECT_IVL_MAX_MS",
    "RECONNECT_IVL_MS",
    "close_socket",
    "is_closed_error",
    "os_error",
    "recv_parts",
    "send_parts",
    "wait_until_destroyed",
    "wait_to_retry",
]

YIELD_EVERY = 32  # a send or receive that did not block still yields this often
RECONNECT_IVL_MS = 10  # a restarted receiver is found again within ~10 ms
RECONNECT_IVL_MAX_MS = 200  # ...backing off to 200 ms while nobody is bound

_NOBLOCK = zmq.NOBLOCK
_NOBLOCK_MORE = zmq.NOBLOCK | zmq.SNDMORE
_CLOSED_ERRNOS = {zmq.ETERM, zmq.ENOTSOCK, errno.EBADF}
_ADDRESS_ERRNOS = {errno.EINVAL, errno.EPROTONOSUPPORT, errno.ENODEV}


async def wait_to_retry(sock: zmq.Socket, fd: int, event: int) -> None:
    """After an operation raised ``zmq.Again``: return when it is worth retrying.

    ``EVENTS`` is read before sleeping (it consumes the FD's edge, and the
    socket may have become ready meanwhile); after a wake-up the caller
    retries the operation at once and comes back here if it fails again.
    ``event`` is ``zmq.POLLIN`` or ``zmq.POLLOUT``. Only the socket's owning
    task may call this (two waiters on one FD raise ``trio.BusyResourceError``).
    """
    if not (sock.getsockopt(zmq.EVENTS) & event):
        await trio.lowlevel.wait_readable(fd)


def send_parts(sock: zmq.Socket, frames: Sequence[Any]) -> None:
    """Send one multipart message without blocking; raise ``zmq.Again`` if full.

    Multipart messages are atomic in ZeroMQ: once the first part is accepted,
    the high-water mark does not refuse the others. Buffers after the header
    (numpy arrays) go without a copy.
    """
    last = len(frames) - 1
    if last == 0:
        sock.send(frames[0], _NOBLOCK)
        return
    sock.send(frames[0], _NOBLOCK_MORE)
    for index in range(1, last):
        sock.send(frames[index], _NOBLOCK_MORE, copy=False)
    sock.send(frames[last], _NOBLOCK, copy=False)


def recv_parts(sock: zmq.Socket, max_parts: int) -> list[Any] | None:
    """The remaining parts of a message whose first part was just received.

    Parts come as ``zmq.Frame`` (no copy); ``Frame.more`` is read instead of
    ``RCVMORE``, which is several times slower. A message of more than
    ``max_parts`` parts is read to its end and None returned: its parts are
    not kept.
    """
    frame = sock.recv(_NOBLOCK, copy=False)
    parts: list[Any] | None = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        if parts is not None:
            parts.append(frame)
            if len(parts) > max_parts:
                parts = None
    return parts


async def wait_until_destroyed(monitor: zmq.Socket) -> None:
    """Wait for ``EVENT_MONITOR_STOPPED`` on a monitor of a closed socket, then close it.

    libzmq closes a socket in its I/O threads after ``close`` returns; that
    event means every connection of the socket is closed too, so peers are
    no longer writing into it.
    """
    fd = monitor.getsockopt(zmq.FD)
    try:
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(_NOBLOCK))["event"]
            except zmq.Again:
                await wait_to_retry(monitor, fd, zmq.POLLIN)
                continue
            if event == zmq.EVENT_MONITOR_STOPPED:
                return
    finally:
        close_socket(monitor, fd)


def close_socket(sock: zmq.Socket, fd: int | None) -> None:
    """Wake any waiter on the FD, then close without lingering."""
    if fd is not None:
        trio.lowlevel.notify_closing(fd)
    sock.close(linger=0)


def is_closed_error(exc: zmq.ZMQError) -> bool:
    """The socket or its context is already closed."""
    return exc.errno in _CLOSED_ERRNOS


def os_error(exc: zmq.ZMQError, address: object) -> Exception:
    """Translate a bind/connect failure into AddressError or OSError."""
    if exc.errno in _ADDRESS_ERRNOS:
        return AddressError(f"cannot use {address}: {exc.strerror}")
    return OSError(exc.errno, f"{address}: {exc.strerror}")

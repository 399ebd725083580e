"""The sending end of an ipc/tcp channel: a DEALER socket and the task that owns it.

Hot path: ``send`` encodes in the caller's task and, while nothing is queued
for the owner, puts the frames on the socket itself with ``NOBLOCK`` (the
owner is then idle and not waiting on the FD, so no wake-up is stolen).
When the socket is full (high-water mark reached, or no receiver yet) the
frames go through a bounded memory channel to the owning task, which waits
for ``POLLOUT``; from then on every send queues behind it, keeping order.
A full queue blocks ``send``: backpressure, never loss.

Orderly close: ``aclose`` lets the owner flush the queue, send an
end-of-stream message (one empty frame) and wait for the receiver's
acknowledgement, which the receiver sends once it holds everything sent
before. Only then is the socket closed: nothing is left in flight for
libzmq to drop (over ipc://, libzmq silently drops messages still in
flight when the sender closes while the receiver's queue is full). Like a
send, the close waits for a receiver that is not bound (yet, or any more);
to give up, cancel it
(``trio.move_on_after``): the socket is then closed at once and what was
not acknowledged is abandoned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
import zmq

from .base import Address, Frames, Sender
from .codec import Encoder
from ._zmqsocket import YIELD_EVERY, close_socket, is_closed_error, send_parts, wait_to_retry

__all__ = ["END_OF_STREAM", "ZmqSender"]

END_OF_STREAM = b""  # a message of one empty frame; a msgpack header is never empty


class ZmqSender(Sender):
    def __init__(self, address: Address, sock: zmq.Socket, capacity: int,
                 forget: Callable[[Any], None]) -> None:
        self.address = address
        self.finished = trio.Event()  # the owner is done and the socket closed
        self._sock = sock
        self._fd: int = sock.getsockopt(zmq.FD)
        self._encoder = Encoder()
        self._to_owner, self._from_user = trio.open_memory_channel[list[Any]](capacity)
        self._backlog = 0  # messages handed to the owner and not yet on the socket
        self._unyielded = 0
        self._closed = False
        self._failure: str | None = None
        self._owner_scope = trio.CancelScope()
        self._forget = forget

    async def send(self, value: Any) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_usable()
        frames = self._encode(value)
        if not self._backlog:
            try:
                send_parts(self._sock, frames)
            except zmq.Again:
                pass  # full or no peer yet: the owner waits for POLLOUT
            except zmq.ZMQError as exc:
                raise trio.BrokenResourceError(f"{self.address}: {exc}") from None
            else:
                self._unyielded += 1
                if self._unyielded >= YIELD_EVERY:
                    self._unyielded = 0
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return
        self._backlog += 1
        try:
            await self._to_owner.send(frames)
        except BaseException:
            self._backlog -= 1
            raise
        self._unyielded = 0

    async def aclose(self) -> None:
        """Return once the receiver holds everything sent; a cancel abandons it."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        self._to_owner.close()
        try:
            await self.finished.wait()
        finally:
            if not self.finished.is_set():
                self._owner_scope.cancel()
        if self._failure is not None:
            raise trio.BrokenResourceError(f"{self.address}: {self._failure}; messages may be lost")

    def abort(self, reason: str) -> None:
        """Close at once, dropping what is still queued (the transport is closing)."""
        if self._failure is None and not self.finished.is_set():
            self._failure = reason
        self._owner_scope.cancel()

    def _check_usable(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("sender was closed")
        if self.finished.is_set():
            raise trio.BrokenResourceError(f"{self.address}: {self._failure or 'closed'}")

    def _encode(self, value: Any) -> list[Any]:
        if isinstance(value, Frames):  # raw frames: fault injection in tests
            if not value or not len(value[0]):
                raise ValueError("raw frames need a non-empty first frame")
            return list(value)
        return self._encoder.encode(value)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The owning task: forward queued frames, then end the stream."""
        with self._owner_scope:
            task_status.started()
            try:
                await self._forward_until_closed()
                await self._send_waiting([END_OF_STREAM])
                await self._wait_acknowledged()
            except zmq.ZMQError as exc:
                if not is_closed_error(exc):
                    self._failure = str(exc)
            finally:
                close_socket(self._sock, self._fd)
                self._from_user.close()
                self.finished.set()
                self._forget(self)

    async def _forward_until_closed(self) -> None:
        from_user = self._from_user
        while True:
            try:
                frames = await from_user.receive()
            except trio.EndOfChannel:
                return
            while True:  # drain what queued up meanwhile, without yielding
                await self._send_waiting(frames)
                self._backlog -= 1
                try:
                    frames = from_user.receive_nowait()
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    return

    async def _send_waiting(self, frames: list[Any]) -> None:
        while True:
            try:
                send_parts(self._sock, frames)
                return
            except zmq.Again:
                await wait_to_retry(self._sock, self._fd, zmq.POLLOUT)

    async def _wait_acknowledged(self) -> None:
        while True:
            try:
                self._sock.recv(zmq.NOBLOCK)
                return
            except zmq.Again:
                await wait_to_retry(self._sock, self._fd, zmq.POLLIN)

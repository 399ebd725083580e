"""The receiving end of an ipc/tcp channel: a ROUTER socket and the task that owns it.

The owner drains every message ready on the socket per wake-up (up to
``DRAIN_BATCH``) into a bounded memory channel; ``receive`` takes from that
channel and decodes in the caller's task. While the channel is full the owner
reads nothing, so libzmq's receive high-water mark fills and the senders'
sockets block in turn: backpressure reaches every sender.

Hot path: a ``receive`` that finds the channel empty while the owner is not
waiting on the socket's FD takes the socket itself ("holds" it): it reads
the next message straight from the socket, or waits on the FD in the owner's
place. The owner stays off the socket while a receiving task holds it (it
parks, and the holder wakes it when it lets go, on every exit from
``receive``), so one task at a time touches the socket and waits on its FD.
A round trip then costs one task wake-up instead of two (owner, then
receiver). The owner hands the socket over, without any cancellation, when
its wake-up fed a task waiting in ``receive``: that task, coming back for
the next message, finds the owner parked. Messages arriving while nobody is
in ``receive`` are still pumped by the owner (end-of-stream acknowledgements
included). Ordering holds: the holder reads the socket only when the channel
is empty, and the owner puts what it reads in the channel without yielding.

ROUTER rather than PULL because the receiver must answer each sender's
end-of-stream with an acknowledgement, addressed by the routing id ROUTER
puts in front of every message. The acknowledgement goes out as soon as the
end marker is read (by the owner or a holder): everything that sender sent
before it has then left the wire and is in this process (in the channel, or
about to be returned).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import trio
import zmq

from .base import Address, DropCounter, Receiver
from .codec import CodecError, Decoder, Refused
from ._zmqsocket import (
    YIELD_EVERY,
    close_socket,
    is_closed_error,
    recv_parts,
    wait_to_retry,
    wait_until_destroyed,
)

__all__ = ["DRAIN_BATCH", "MAX_FRAMES", "ZmqReceiver"]

DRAIN_BATCH = 256  # most messages taken from the socket per wake-up of the owner
MAX_FRAMES = 1 << 16  # most frames of one message (a header and its arrays)
CLOSE_PATIENCE_S = 2.0  # the longest aclose waits for libzmq to destroy the socket
PEERS_NOTICE_S = 0.02  # ...and then for peers in this process to see their connection end
log = logging.getLogger("transports")


class _EndOfStream:
    """Put in the channel when a sender's end-of-stream arrives."""


_END = _EndOfStream()
_NOBLOCK = zmq.NOBLOCK
_NOBLOCK_MORE = zmq.NOBLOCK | zmq.SNDMORE


class ZmqReceiver(Receiver[Any]):
    def __init__(self, address: Address, sock: zmq.Socket, decoder: Decoder, capacity: int,
                 senders: int | None, forget: Callable[[Any], None], monitor_address: str, *,
                 max_message_bytes: int) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.dropped = DropCounter(str(address))
        self.finished = trio.Event()  # the owner is done and the socket closed
        self._sock = sock
        self._fd: int = sock.getsockopt(zmq.FD)
        self._decoder = decoder
        self._to_user, self._from_owner = trio.open_memory_channel[Any](capacity)
        self._ends_left = math.inf if senders is None else senders
        self._unyielded = 0
        self._closing = False
        self._failure: str | None = None
        self._owner_scope = trio.CancelScope()
        self._forget = forget
        self._monitor_address = monitor_address  # an inproc name unique in the context
        # Who may touch the socket (see the module docstring): a receiving
        # task holding it, else the owner.
        self._held = False  # a task in receive holds the socket
        self._owner_on_fd = False  # the owner is waiting on the FD
        self._owner_parked: trio.lowlevel.Task | None = None  # ...or waits for the holder
        self._channel_waiters = 0  # tasks in receive waiting on the channel

    async def receive(self) -> Any:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._ends_left <= 0:
                await trio.lowlevel.checkpoint()
                raise trio.EndOfChannel
            item = await self._next_item()
            if item is _END:
                self._ends_left -= 1
                continue
            try:
                return self._decoder.decode(item)
            except CodecError as error:
                self.dropped.drop(error)
                if error.salvaged is not None:  # identified: its sender can be answered
                    return Refused(error.salvaged, error)

    async def _next_item(self) -> Any:
        # Taking a ready item without a schedule point is safe against
        # cancellation (nothing can interrupt between taking and returning);
        # a real yield still comes every YIELD_EVERY items, before taking one.
        if self._unyielded >= YIELD_EVERY:
            self._unyielded = 0
            await trio.lowlevel.checkpoint()
        try:
            item = self._from_owner.receive_nowait()
            self._unyielded += 1
            return item
        except trio.WouldBlock:
            pass
        except trio.EndOfChannel:  # the owner stopped without our aclose
            raise self._broken() from None
        if self._held or self._owner_on_fd or self.finished.is_set():
            return await self._wait_on_channel()
        self._held = True
        try:
            return await self._take_from_socket()
        finally:
            self._held = False
            self._wake_owner()

    async def _wait_on_channel(self) -> Any:
        self._channel_waiters += 1
        try:
            item = await self._from_owner.receive()
        except trio.EndOfChannel:
            raise self._broken() from None
        finally:
            self._channel_waiters -= 1
            self._wake_owner()  # it may have parked for us after feeding us
        self._unyielded = 0
        return item

    async def _take_from_socket(self) -> Any:
        """Read the next message off the socket in the owner's place (the owner is off it)."""
        sock = self._sock
        while True:
            try:
                peer = sock.recv(_NOBLOCK)
            except zmq.Again:
                try:
                    # recv was tried first (a wait with messages queued would hang), and
                    # EVENTS is re-read before the wait (reading it consumes the edge)
                    await wait_to_retry(sock, self._fd, zmq.POLLIN)
                except trio.ClosedResourceError:  # the owner closed the socket
                    break
                self._unyielded = 0
                continue
            except zmq.ZMQError as exc:
                if not is_closed_error(exc):
                    raise trio.BrokenResourceError(f"{self.address}: {exc}") from None
                break
            parts = recv_parts(sock, MAX_FRAMES)
            self._unyielded += 1
            if (parts is None or len(parts) > 1) and not self._admit(parts):
                if self._unyielded >= YIELD_EVERY:  # a flood of dropped messages yields too
                    self._unyielded = 0
                    await trio.lowlevel.checkpoint()  # nothing taken is lost to a cancel here
                continue
            if len(parts) == 1 and not len(parts[0]):
                self._acknowledge(peer)
                return _END
            return parts
        # closed under us: the channel says how (our aclose, or the transport's)
        self._held = False
        return await self._wait_on_channel()

    def _wake_owner(self) -> None:
        task = self._owner_parked
        if task is not None:
            self._owner_parked = None
            trio.lowlevel.reschedule(task)

    async def _park_owner(self) -> None:
        """The owner waits until a holder lets go of the socket (or is cancelled)."""
        self._owner_parked = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._unpark)

    def _unpark(self, _: Any) -> trio.lowlevel.Abort:
        self._owner_parked = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _broken(self) -> trio.BrokenResourceError:
        return trio.BrokenResourceError(
            f"{self.address}: {self._failure or 'the transport was closed'}"
        )

    async def aclose(self) -> None:
        """Close, and return once the socket's connections are closed as well.

        A sender writing into a connection of a socket being destroyed loses
        that message (libzmq closes sockets asynchronously). Waiting until
        the socket is gone means the senders' sockets are told at once, hold
        what they send next and give it to the next receiver bound here.
        """
        self._from_owner.close()
        if self._closing or self.finished.is_set():
            await self.finished.wait()
            return
        self._closing = True
        monitor = self._sock.get_monitor_socket(zmq.EVENT_MONITOR_STOPPED, self._monitor_address)
        self._owner_scope.cancel()
        try:
            with trio.move_on_after(CLOSE_PATIENCE_S):
                await self.finished.wait()
                await wait_until_destroyed(monitor)
                # and give the peers' I/O threads a moment to see their
                # connection end before they write the next message into it
                await trio.sleep(PEERS_NOTICE_S)
        finally:
            if not monitor.closed:
                monitor.close(linger=0)

    def abort(self, reason: str) -> None:
        if self._failure is None and not self.finished.is_set():
            self._failure = reason
        self._owner_scope.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The owning task: move messages from the socket into the channel."""
        with self._owner_scope:
            task_status.started()
            try:
                await self._pump()
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # receive side closed by aclose
            except zmq.ZMQError as exc:
                if not is_closed_error(exc):
                    self._failure = str(exc)
                    log.error("%s: receiver failed: %s", self.address, exc)
            finally:
                close_socket(self._sock, self._fd)
                self._to_user.close()
                self.finished.set()
                self._forget(self)

    async def _pump(self) -> None:
        sock, fd, put = self._sock, self._fd, self._to_user
        while True:
            if self._held:
                await self._park_owner()  # the holder reads the socket; it wakes us
                continue
            fed_a_waiter = self._channel_waiters > 0
            taken = delivered = 0
            blocked = False
            while taken < DRAIN_BATCH:
                try:
                    peer = sock.recv(_NOBLOCK)  # try before waiting: the FD edge may be spent
                except zmq.Again:
                    break
                taken += 1
                item = parts = recv_parts(sock, MAX_FRAMES)  # the rest of a message is always there
                if (parts is None or len(parts) > 1) and not self._admit(parts):
                    continue
                delivered += 1
                if len(parts) == 1 and not len(parts[0]):
                    # acknowledged at once: everything before it is off the
                    # wire, and a receiver closed before putting it in the
                    # channel must not leave that sender's close hanging
                    self._acknowledge(peer)
                    item = _END
                try:
                    put.send_nowait(item)
                except trio.WouldBlock:
                    # full: stop reading, let the HWM push back. Once in the
                    # channel, look again who holds the socket.
                    await put.send(item)
                    blocked = True
                    break
            if blocked:
                continue
            if taken >= DRAIN_BATCH:
                # Let the receiving task handle what was taken before we look
                # again (and let others run). Shielded: a message just taken is
                # never lost to a cancel here (a cancellable checkpoint after a
                # successful recv could drop it).
                await trio.lowlevel.cancel_shielded_checkpoint()
            elif delivered and fed_a_waiter:
                # The socket is drained and a task in receive got a message
                # from us (not only dropped ones: it would wait on the channel): it comes back for the next one and reads the
                # socket itself; it wakes us when it leaves receive.
                await self._park_owner()
            else:
                self._owner_on_fd = True
                try:
                    await wait_to_retry(sock, fd, zmq.POLLIN)
                finally:
                    self._owner_on_fd = False

    def _admit(self, parts: list[Any] | None) -> bool:
        """Count and drop a message of several frames over the bounds (libzmq bounds each frame)."""
        if parts is None:
            self.dropped.drop(CodecError("oversized", f"a message of more than {MAX_FRAMES} frames"))
            return False
        if (size := sum(len(part) for part in parts)) > self.max_message_bytes:
            self.dropped.drop(CodecError("oversized", f"a message of {size} bytes, more than {self.max_message_bytes}"))
            return False
        return True

    def _acknowledge(self, peer: bytes) -> None:
        # ROUTER drops a message to a peer that has gone: nothing to wait for
        self._sock.send(peer, _NOBLOCK_MORE)
        self._sock.send(b"", _NOBLOCK)

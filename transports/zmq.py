"""ipc:///PATH and tcp://HOST:PORT through ZeroMQ, driven from trio.

Sockets: a receiver binds a ROUTER, a sender connects a DEALER (a raw peer
must be a DEALER too). Every message is a header frame (msgpack, from
:class:`~transports.codec.Encoder`) followed by one frame per numpy array,
sent and received without copies (pyzmq copies arrays under 64 KiB anyway;
do not modify an array after sending it). An end-of-stream is one empty frame; the
receiver answers it with an acknowledgement once it holds everything sent
before it, and only then does ``Sender.aclose()`` return.

Each socket is owned by one task in the hub's nursery, and one task at a
time touches it and waits on its edge-triggered FD. Two shortcuts hand the
socket to the caller while the owner is idle: a ``send`` while the owner
has nothing queued puts the frames on the socket itself, non-blocking; a
``receive`` that finds nothing buffered while the owner is not waiting on
the FD reads the socket (or waits on its FD) itself, with the owner parked
until it leaves ``receive`` (one wake-up per message instead of two). See
``_zmqsocket`` for the pitfalls handled, ``_zmqsender`` and ``_zmqreceiver``
for the two ends.

Backpressure: a receiver's ``capacity`` sizes its channel and its receive
high-water mark, a sender's ``capacity`` its queue and send high-water mark
(high-water marks are at least ``MIN_HWM``); when all are full, ``send``
blocks. Nothing is dropped on the way.

Addresses: tcp binds exactly the host given: ``tcp://127.0.0.1:PORT`` is
loopback only, ``tcp://*:PORT`` listens on every interface (the config
layer defaults to loopback), ``tcp://[::1]:PORT`` is IPv6. A tcp address
that is not loopback (127.0.0.0/8, ::1, localhost) is bound only with CURVE,
or with ``allow_insecure=True``: otherwise ``bind`` raises InsecureBindError. Port ``0`` or ``*`` picks a free port;
``receiver.address`` tells which. Binding an ipc path takes it over, as
ZeroMQ does (a restarted process rebinding its path). Senders connect before
or after the receiver binds and reconnect to a receiver bound again.

Optional CURVE (tcp): ``ZmqTransport(..., curve=CurveConfig(...))`` or
``curve=`` per bind/connect; see ``_zmqcurve``.

Sizes: every receiving socket has ``ZMQ_MAXMSGSIZE``. libzmq applies it to
each frame: a peer sending a frame over ``max_message_bytes`` to a receiver
is disconnected (it reconnects, and what it sends next is delivered). A
message of many smaller frames is received whole by libzmq before anyone can
look at it; the receiver then drops it, counted as ``oversized``, when its
frames add up to more than ``max_message_bytes`` or number more than
``MAX_FRAMES``. A sender's socket only ever receives empty acknowledgements:
its bound is ``ACK_MAX_BYTES``.
"""

from __future__ import annotations

import errno
import itertools
from typing import Any

import trio
import zmq

from .base import Address, InsecureBindError, Receiver, Sender
from .codec import Decoder
from .config import DEFAULT_MAX_MESSAGE_BYTES
from ._zmqcurve import CurveConfig, CurveGuard
from ._zmqreceiver import ZmqReceiver
from ._zmqsender import ZmqSender
from ._zmqsocket import RECONNECT_IVL_MAX_MS, RECONNECT_IVL_MS, os_error

__all__ = ["CurveConfig", "ZmqTransport"]

# libzmq hands a reader's progress to the writer every HWM/2 messages: with a
# tiny HWM that is a wake-up per message or two (4x slower at capacity 4), so
# the wire queues hold at least this many; the trio channels keep `capacity`.
MIN_HWM = 64
REBIND_PATIENCE_S = 1.0  # how long a port freed by this process may take to be free
ACK_MAX_BYTES = 64 << 10  # a sender's socket receives acknowledgements (empty) and nothing else


class ZmqTransport:
    """All ipc (or all tcp) channels of one Hub: one ZeroMQ context."""

    def __init__(self, nursery: trio.Nursery, scheme: str, *, curve: CurveConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, allow_insecure: bool = False) -> None:
        self.scheme = scheme
        self._nursery = nursery
        self._context = zmq.Context()
        self._curve = curve
        self._max_message_bytes = max_message_bytes
        self._allow_insecure = allow_insecure
        self._guard = CurveGuard(self._context)
        self._bound: set[Address] = set()
        self._endpoints: set[ZmqSender | ZmqReceiver] = set()
        self._monitors = itertools.count()
        self._closed = False

    async def bind(self, address: Address, decoder: Decoder, *, capacity: int,
                   senders: int | None, curve: CurveConfig | None = None) -> Receiver:
        self._check_open()
        curve = curve or self._curve
        if address.scheme == "tcp" and curve is None and not self._allow_insecure and not address.is_loopback:
            raise InsecureBindError(
                f"refusing to bind {address} without CURVE: any host that reaches it could send"
                " anything; configure curve, bind a loopback address, or pass allow_insecure=True"
            )
        if address in self._bound:
            raise OSError(errno.EADDRINUSE, f"{address} is already bound")
        sock = self._socket(zmq.ROUTER, address)
        try:
            sock.setsockopt(zmq.RCVHWM, max(capacity, MIN_HWM))
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            if curve:
                self._guard.secure_receiver(sock, curve)
            await _bind(sock, address)
            bound = Address.parse(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException:
            sock.close(linger=0)
            raise
        receiver = ZmqReceiver(bound, sock, decoder, capacity, senders, self._forget,
                               f"inproc://tercet-monitor-{next(self._monitors)}",
                               max_message_bytes=self._max_message_bytes)
        self._bound.add(bound)
        self._endpoints.add(receiver)
        await self._nursery.start(receiver.run)
        return receiver

    async def connect(self, address: Address, *, capacity: int,
                      curve: CurveConfig | None = None) -> Sender:
        self._check_open()
        sock = self._socket(zmq.DEALER, address)
        try:
            sock.setsockopt(zmq.SNDHWM, max(capacity, MIN_HWM))
            sock.setsockopt(zmq.MAXMSGSIZE, ACK_MAX_BYTES)
            if curve or self._curve:
                self._guard.secure_sender(sock, curve or self._curve)
            try:
                sock.connect(str(address))
            except zmq.ZMQError as exc:
                raise os_error(exc, address) from None
        except BaseException:
            sock.close(linger=0)
            raise
        sender = ZmqSender(address, sock, capacity, self._forget)
        self._endpoints.add(sender)
        await self._nursery.start(sender.run)
        return sender

    async def aclose(self) -> None:
        """Close every socket at once (unclosed senders lose what is in flight)."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        endpoints = list(self._endpoints)
        for endpoint in endpoints:
            endpoint.abort("the transport was closed")
        for endpoint in endpoints:
            await endpoint.finished.wait()
        self._guard.close()
        self._context.destroy(linger=0)

    def _socket(self, kind: int, address: Address) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if address.scheme == "tcp" and address.rest.startswith("["):
            sock.setsockopt(zmq.IPV6, 1)  # libzmq refuses IPv6 literals without it
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        return sock

    def _forget(self, endpoint: Any) -> None:
        self._endpoints.discard(endpoint)
        if isinstance(endpoint, ZmqReceiver):
            self._bound.discard(endpoint.address)

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError(f"the {self.scheme} transport was closed")


async def _bind(sock: zmq.Socket, address: Address) -> None:
    # A tcp port closed by this process a moment ago is released by libzmq's
    # I/O thread shortly after: retry EADDRINUSE briefly before giving up.
    with trio.move_on_after(REBIND_PATIENCE_S if address.scheme == "tcp" else 0):
        while True:
            try:
                sock.bind(str(address))
                return
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise os_error(exc, address) from None
            await trio.sleep(0.01)
    try:
        sock.bind(str(address))
    except zmq.ZMQError as exc:
        raise os_error(exc, address) from None

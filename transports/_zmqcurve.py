"""ZeroMQ CURVE for tcp: encrypted links, and receivers that admit known senders only.

The keys and where they come from are in :class:`~transports.config.CurveConfig`.

- A receiver (CURVE server) uses its own keypair and admits the senders
  whose public keys its config authorizes; a sender whose key is not there
  completes no handshake, so nothing it sends is delivered.
- A sender (CURVE client) uses its own keypair and the receiver's public
  key; without the right server key the handshake fails the same way.

Admission is checked by ZeroMQ's ZAP protocol, answered by pyzmq's
``ThreadAuthenticator`` (one thread per transport, started at the first
CURVE bind; it only looks keys up in a frozen set and never touches trio).
"""

from __future__ import annotations

import itertools

import zmq
from zmq.auth.thread import ThreadAuthenticator

from .config import CurveConfig

__all__ = ["CurveConfig", "CurveGuard"]


class CurveGuard:
    """Applies CURVE keys to sockets of one context and runs its ZAP handler."""

    def __init__(self, context: zmq.Context) -> None:
        self._context = context
        self._authenticator: ThreadAuthenticator | None = None
        self._domains = itertools.count()

    def secure_receiver(self, sock: zmq.Socket, curve: CurveConfig) -> None:
        keys = curve.load()
        if not keys.has_authorized:
            raise ValueError("a CURVE receiver needs authorized_dir or authorized_keys (the senders it admits)")
        if self._authenticator is None:
            self._authenticator = ThreadAuthenticator(self._context)
            self._authenticator.start()
        domain = f"tercet-{next(self._domains)}"
        self._authenticator.configure_curve_callback(domain, _Admitted(keys.authorized))
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_SERVER, 1)

    def secure_sender(self, sock: zmq.Socket, curve: CurveConfig) -> None:
        keys = curve.load()
        if keys.server is None:
            raise ValueError("a CURVE sender needs server_public_file or server_key (the receiver's key)")
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


class _Admitted:
    """pyzmq's credentials provider: a client key (z85) is admitted if it is in the set."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys

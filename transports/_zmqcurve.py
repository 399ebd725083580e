"""ZeroMQ CURVE for tcp: encrypted links, and receivers that admit known senders only.

Keys are certificate files in the format of ``zmq.auth.create_certificates``
(``NAME.key`` holds a public key, ``NAME.key_secret`` both keys).

- A receiver (CURVE server) needs its own secret certificate and a directory
  of the public certificates of the senders it admits; a sender whose key is
  not there completes no handshake, so nothing it sends is delivered.
- A sender (CURVE client) needs its own secret certificate and the
  receiver's public certificate; without the right server key the
  handshake fails the same way.

Admission is checked by ZeroMQ's ZAP protocol, answered by pyzmq's
``ThreadAuthenticator`` (one thread per transport, started at the first
CURVE bind; it only reads certificates and never touches trio).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from os import PathLike

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["CurveConfig", "CurveGuard"]


@dataclass(frozen=True)
class CurveConfig:
    """Keys for one side of a CURVE link (see the module docstring).

    ``secret_file``: this side's ``NAME.key_secret``. A receiver also needs
    ``authorized_dir`` (public certificates of admitted senders); a sender
    also needs ``server_public_file`` (the receiver's ``NAME.key``).
    """

    secret_file: str | PathLike[str]
    server_public_file: str | PathLike[str] | None = None
    authorized_dir: str | PathLike[str] | None = None


class CurveGuard:
    """Applies CURVE keys to sockets of one context and runs its ZAP handler."""

    def __init__(self, context: zmq.Context) -> None:
        self._context = context
        self._authenticator: ThreadAuthenticator | None = None
        self._domains = itertools.count()

    def secure_receiver(self, sock: zmq.Socket, curve: CurveConfig) -> None:
        if curve.authorized_dir is None:
            raise ValueError("a CURVE receiver needs authorized_dir (the senders it admits)")
        public, secret = _load_secret(curve.secret_file)
        if self._authenticator is None:
            self._authenticator = ThreadAuthenticator(self._context)
            self._authenticator.start()
        domain = f"tercet-{next(self._domains)}"
        self._authenticator.configure_curve(domain=domain, location=curve.authorized_dir)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVER, 1)

    def secure_sender(self, sock: zmq.Socket, curve: CurveConfig) -> None:
        if curve.server_public_file is None:
            raise ValueError("a CURVE sender needs server_public_file (the receiver's key)")
        public, secret = _load_secret(curve.secret_file)
        server_public, _ = zmq.auth.load_certificate(curve.server_public_file)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


def _load_secret(path: str | PathLike[str]) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret

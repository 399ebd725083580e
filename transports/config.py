"""A hub's options as plain data: what a topology file says and a child process inherits.

:class:`HubOptions` and :class:`CurveConfig` are frozen dataclasses of
strings, numbers and tuples, so they encode to JSON with msgspec
(``msgspec.to_builtins``) and decode back (``msgspec.convert``), the way
``ProcessChild`` hands its child the hub options of its parent.

CURVE keys come from files or inline, per key:

- files are ZeroMQ certificates as ``zmq.auth.create_certificates(dir,
  name)`` writes them: ``NAME.key`` holds a public key, ``NAME.key_secret``
  both keys (``python -c "import zmq.auth; zmq.auth.create_certificates('keys', 'tercet')"``);
- inline keys are z85 text, the 40-character form ``zmq.curve_keypair()``
  returns.

One CurveConfig secures one trust domain: the hub's keypair serves as the
server key of its receivers and the client key of its senders, its
senders expect the one server key ``server_public_file``/``server_key``,
and its receivers admit the client keys in ``authorized_dir`` and
``authorized_keys``. Processes sharing one keypair (every process of a
server on one host, :meth:`CurveConfig.generate`) all reach each other and
nobody else does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from os import PathLike

import zmq
import zmq.auth
from zmq.utils import z85

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "CurveConfig", "CurveKeys", "HubOptions"]

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # the largest message an ipc/tcp receiver accepts


@dataclass(frozen=True, kw_only=True)
class CurveConfig:
    """Keys for the CURVE side(s) of a hub's tcp channels (see the module docstring).

    A receiver needs this side's secret (``secret_file`` or ``secret_key``)
    and the senders it admits (``authorized_dir`` and/or
    ``authorized_keys``); a sender needs this side's secret and the
    receivers' public key (``server_public_file`` or ``server_key``).
    Paths are stored as strings, so the config travels as JSON.
    """

    secret_file: str | None = None  # this side's NAME.key_secret certificate
    secret_key: str | None = field(default=None, repr=False)  # ...or its secret key, z85
    server_public_file: str | None = None  # the receivers' NAME.key certificate
    server_key: str | None = None  # ...or their public key, z85
    authorized_dir: str | None = None  # a directory of admitted senders' NAME.key certificates
    authorized_keys: tuple[str, ...] = ()  # ...and/or their public keys, z85

    def __post_init__(self) -> None:
        for name in ("secret_file", "server_public_file", "authorized_dir"):
            value: str | PathLike[str] | None = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, os.fspath(value))
        object.__setattr__(self, "authorized_keys", tuple(self.authorized_keys))
        if self.secret_file is not None and self.secret_key is not None:
            raise ValueError("CurveConfig: give secret_file or secret_key, not both")
        if self.server_public_file is not None and self.server_key is not None:
            raise ValueError("CurveConfig: give server_public_file or server_key, not both")
        for name, key in (("secret_key", self.secret_key), ("server_key", self.server_key),
                          *(("authorized_keys", key) for key in self.authorized_keys)):
            if key is not None:
                _check_z85(name, key)

    @classmethod
    def generate(cls) -> CurveConfig:
        """A fresh keypair for the processes of one host: each admits the others, no one else.

        Hand the same config to every hub of the server (``ProcessChild(hub=...)``
        passes it to child processes); it lives only in memory and on the
        children's stdin, never in a file.
        """
        public, secret = (key.decode() for key in zmq.curve_keypair())
        return cls(secret_key=secret, server_key=public, authorized_keys=(public,))

    def load(self) -> CurveKeys:
        """Read the key files; raise ValueError (or OSError) naming what is wrong."""
        if self.secret_file is not None:
            public, secret = zmq.auth.load_certificate(self.secret_file)
            if secret is None:
                raise ValueError(f"{self.secret_file} holds no secret key (use the .key_secret file)")
        elif self.secret_key is not None:
            secret = self.secret_key.encode()
            public = zmq.curve_public(secret)
        else:
            raise ValueError("CurveConfig: this side's keys are missing (secret_file or secret_key)")
        server = None
        if self.server_public_file is not None:
            server, _ = zmq.auth.load_certificate(self.server_public_file)
        elif self.server_key is not None:
            server = self.server_key.encode()
        authorized = {key.encode() for key in self.authorized_keys}
        if self.authorized_dir is not None:
            if not os.path.isdir(self.authorized_dir):
                raise ValueError(f"CurveConfig: authorized_dir {self.authorized_dir} is not a directory")
            authorized.update(zmq.auth.load_certificates(self.authorized_dir))
        return CurveKeys(public, secret, server, frozenset(authorized),
                         has_authorized=self.authorized_dir is not None or bool(self.authorized_keys))


@dataclass(frozen=True)
class CurveKeys:
    """A CurveConfig's keys, loaded (z85 bytes)."""

    public: bytes
    secret: bytes = field(repr=False)
    server: bytes | None
    authorized: frozenset[bytes]
    has_authorized: bool  # authorized_dir or authorized_keys was given (the dir may be empty)


@dataclass(frozen=True, kw_only=True)
class HubOptions:
    """What ``open_hub`` takes, as plain data.

    ``curve``: secures every tcp channel of the hub. ``max_message_bytes``:
    the largest frame libzmq accepts on an ipc/tcp receiver (a peer sending
    a larger one is disconnected), and the largest message, all frames
    together, the receiver delivers. ``allow_insecure``: allow binding a
    tcp address that is not loopback without CURVE.
    """

    curve: CurveConfig | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    allow_insecure: bool = False

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1:
            raise ValueError(f"HubOptions: max_message_bytes must be >= 1, not {self.max_message_bytes}")


def _check_z85(name: str, key: str) -> None:
    try:
        ok = len(z85.decode(key.encode())) == 32
    except Exception:  # noqa: BLE001 - z85.decode raises ValueError, KeyError, struct.error
        ok = False
    if not ok:
        raise ValueError(f"CurveConfig.{name}: {key[:4]!r}... is not a z85 CURVE key (40 characters)")

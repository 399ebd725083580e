"""The transport interface: trio-shaped channels chosen by address scheme.

A *receiver* is bound at an address and takes messages from any number of
senders (many-to-one, like a ZeroMQ PULL socket or an actor's mailbox). A
*sender* is connected to an address. Both behave like trio channels:
``send``/``receive``/``aclose``, ``async with``, ``async for``, and
``trio.ClosedResourceError`` after one's own close.

Delivery contract, the same for every scheme:

- order is preserved per sender, nothing is lost or duplicated;
- a full receiver blocks its senders (backpressure), never drops;
- a sender whose receiver is not bound (yet, or any more) waits for it;
- ``Sender.aclose()`` is an orderly close: everything it sent stays
  deliverable. A receiver bound with ``senders=k`` raises
  ``trio.EndOfChannel`` once k senders have closed and their messages are
  drained; with ``senders=None`` (a mailbox) it never ends by itself;
- a frame that does not decode, or holds an array its field's ``Array``
  spec refuses, or a message larger than the hub's ``max_message_bytes``
  (ipc, tcp), is counted in ``Receiver.dropped``, logged once per kind, and
  skipped: it never reaches, nor kills, the receiver's owner.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections import Counter
from typing import Any, Generic, NamedTuple, TypeVar

import trio

from .codec import CodecError

__all__ = ["Address", "AddressError", "DropCounter", "Frames", "InsecureBindError", "Receiver", "Sender"]

T = TypeVar("T")
log = logging.getLogger("transports")


class AddressError(ValueError):
    """An address that names no transport, or one that is malformed."""


class InsecureBindError(AddressError):
    """A tcp address reachable from other hosts, bound without CURVE (and not explicitly allowed)."""


_TCP_REST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^:\s\[\]]+):(\d+|\*)")  # host:port, [v6]:port


class Address(NamedTuple):
    scheme: str  # inproc | ipc | tcp
    rest: str  # name, path, or host:port

    def __str__(self) -> str:
        return f"{self.scheme}://{self.rest}"

    @classmethod
    def parse(cls, text: str) -> Address:
        match = re.fullmatch(r"(inproc|ipc|tcp)://(.+)", text)
        if match is None:
            raise AddressError(
                f"bad address {text!r}: expected inproc://NAME, ipc:///PATH or tcp://HOST:PORT"
            )
        address = cls(match[1], match[2])
        if address.scheme == "tcp" and not _TCP_REST.fullmatch(address.rest):
            raise AddressError(f"bad address {text!r}: tcp addresses are tcp://HOST:PORT or tcp://[IPV6]:PORT")
        return address

    @property
    def host(self) -> str:
        """A tcp address's host, without the brackets of an IPv6 literal."""
        if self.scheme != "tcp":
            raise AddressError(f"{self} has no host")
        return self.rest.rpartition(":")[0].removeprefix("[").removesuffix("]")

    @property
    def is_loopback(self) -> bool:
        """A tcp address only this host can reach: 127.0.0.0/8, ::1 or localhost.

        An interface name (``lo``), ``*`` or any other host name is not
        loopback here, whatever it resolves to.
        """
        host = self.host
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


class Frames(tuple):
    """Encoded frames travelling where objects usually do (inproc fault injection)."""


class DropCounter:
    """Counts what a receiver (or an actor's runtime) dropped, by kind; logs the first of each kind."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.counts: Counter[str] = Counter()

    def drop(self, error: CodecError) -> None:
        self.count(error.kind, str(error))

    def count(self, kind: str, detail: str) -> None:
        """One more ``kind`` dropped; ``detail`` says which (logged for the first of its kind)."""
        if not self.counts[kind]:
            log.warning("%s: dropped %s (further %s ones are only counted)", self.where, detail, kind)
        self.counts[kind] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class Sender(trio.abc.SendChannel[Any]):
    """Sends messages to one address. Encoding happens here (ipc, tcp)."""

    address: Address


class Receiver(trio.abc.ReceiveChannel[T], Generic[T]):
    """Receives the messages sent to the address it is bound at."""

    address: Address
    dropped: DropCounter

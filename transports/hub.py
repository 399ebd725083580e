"""The Hub: one per process, it opens channels by address.

``bind`` gives a Receiver, ``connect`` a Sender; the scheme picks the
transport. The hub owns the transports' resources (the ZeroMQ context, the
tasks that own sockets) and closes them when its ``async with`` ends.

Its options (:class:`~transports.config.HubOptions`: CURVE, the message
size bound, whether a non-loopback tcp bind may go without CURVE) are plain
data: ``hub.options`` is what a child process needs to open a hub secured
the same way (``ProcessChild(..., hub=hub.options)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from .base import Address, AddressError, Receiver, Sender
from .codec import Decoder
from .config import CurveConfig, HubOptions
from .inproc import InprocTransport

__all__ = ["DEFAULT_CAPACITY", "Hub", "open_hub"]

DEFAULT_CAPACITY = 1024


class Hub:
    def __init__(self, nursery: trio.Nursery, options: HubOptions | None = None) -> None:
        self._nursery = nursery
        self.options = options or HubOptions()
        self._transports: dict[str, Any] = {"inproc": InprocTransport()}

    def _transport(self, address: Address) -> Any:
        transport = self._transports.get(address.scheme)
        if transport is None:
            transport = self._transports[address.scheme] = self._open_transport(address.scheme)
        return transport

    def _open_transport(self, scheme: str) -> Any:
        try:
            from .zmq import ZmqTransport
        except ImportError as exc:  # pragma: no cover - the seam for ipc/tcp
            raise AddressError(f"no transport for {scheme}://: {exc}") from exc
        options = self.options
        return ZmqTransport(self._nursery, scheme, curve=options.curve if scheme == "tcp" else None,
                            max_message_bytes=options.max_message_bytes,
                            allow_insecure=options.allow_insecure)

    async def bind(self, address: str | Address, type_: Any, *,
                   capacity: int = DEFAULT_CAPACITY, senders: int | None = None) -> Receiver:
        """Bind a receiver for messages of ``type_`` (or a ready Decoder)."""
        address = address if isinstance(address, Address) else Address.parse(address)
        decoder = type_ if isinstance(type_, Decoder) else Decoder(type_)
        return await self._transport(address).bind(
            address, decoder, capacity=capacity, senders=senders
        )

    async def connect(self, address: str | Address, *,
                      capacity: int = DEFAULT_CAPACITY) -> Sender:
        address = address if isinstance(address, Address) else Address.parse(address)
        return await self._transport(address).connect(address, capacity=capacity)

    async def aclose(self) -> None:
        for transport in self._transports.values():
            close = getattr(transport, "aclose", None)
            if close is not None:
                await close()


@asynccontextmanager
async def open_hub(options: HubOptions | None = None, *, curve: CurveConfig | None = None,
                   max_message_bytes: int | None = None,
                   allow_insecure: bool | None = None) -> AsyncIterator[Hub]:
    """A hub with ``options``; each keyword given overrides that field of them."""
    overrides = {name: value for name, value in (("curve", curve), ("max_message_bytes", max_message_bytes),
                                                 ("allow_insecure", allow_insecure)) if value is not None}
    options = dataclasses.replace(options or HubOptions(), **overrides)
    async with trio.open_nursery() as nursery:
        hub = Hub(nursery, options)
        try:
            yield hub
        finally:
            with trio.CancelScope(shield=True):
                await hub.aclose()
            nursery.cancel_scope.cancel()

"""inproc://NAME: trio memory channels inside one Hub; objects pass unencoded.

Unencoded, they are still held to the channel type's array constraints
(``Array`` fields): an object with an array its field refuses is dropped and
counted, as a frame would be.

A name is bound by one receiver at a time. Senders look the name up on every
send, so a receiver that is closed and bound again (an actor restarting) is
reached by the senders that were already connected, as ZeroMQ reconnects.
"""

from __future__ import annotations

import math
from typing import Any

import trio

from .base import Address, DropCounter, Frames, Receiver, Sender
from .codec import CodecError, Decoder, Refused

__all__ = ["InprocTransport"]


class _EndOfStream:
    """Put in the channel by an orderly sender close."""


_END = _EndOfStream()


class _Binding:
    def __init__(self, capacity: int) -> None:
        self.send, self.receive = trio.open_memory_channel[Any](capacity)


class InprocTransport:
    def __init__(self) -> None:
        self._bindings: dict[str, _Binding] = {}
        self._bound = trio.Event()  # set and replaced whenever a name is bound

    async def bind(self, address: Address, decoder: Decoder, *, capacity: int,
                   senders: int | None) -> Receiver:
        if address.rest in self._bindings:
            raise OSError(f"{address} is already bound")
        binding = self._bindings[address.rest] = _Binding(capacity)
        self._bound.set()
        self._bound = trio.Event()
        await trio.lowlevel.checkpoint()
        return _InprocReceiver(self, address, binding, decoder, senders)

    async def connect(self, address: Address, *, capacity: int) -> Sender:
        await trio.lowlevel.checkpoint()
        return _InprocSender(self, address)

    def _unbind(self, address: Address, binding: _Binding) -> None:
        if self._bindings.get(address.rest) is binding:
            del self._bindings[address.rest]

    async def _wait_bound(self, name: str) -> _Binding:
        while (binding := self._bindings.get(name)) is None:
            await self._bound.wait()
        return binding


class _InprocSender(Sender):
    def __init__(self, transport: InprocTransport, address: Address) -> None:
        self.address = address
        self._transport = transport
        self._closed = False

    async def send(self, value: Any) -> None:
        if self._closed:
            raise trio.ClosedResourceError("sender was closed")
        while True:
            binding = await self._transport._wait_bound(self.address.rest)
            try:
                await binding.send.send(value)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # the receiver went away while we waited: wait for the next one
                self._transport._unbind(self.address, binding)
            if self._closed:
                raise trio.ClosedResourceError("sender was closed")

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        binding = self._transport._bindings.get(self.address.rest)
        if binding is None:
            await trio.lowlevel.checkpoint()
            return
        try:
            await binding.send.send(_END)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


class _InprocReceiver(Receiver):
    def __init__(self, transport: InprocTransport, address: Address, binding: _Binding,
                 decoder: Decoder, senders: int | None) -> None:
        self.address = address
        self.dropped = DropCounter(str(address))
        self._transport = transport
        self._binding = binding
        self._decoder = decoder
        self._ends_left = math.inf if senders is None else senders

    async def receive(self) -> Any:
        while True:
            if self._ends_left <= 0:
                await trio.lowlevel.checkpoint()
                raise trio.EndOfChannel
            item = await self._binding.receive.receive()
            if item is _END:
                self._ends_left -= 1
                continue
            try:
                if isinstance(item, Frames):
                    return self._decoder.decode(item)
                return self._decoder.check(item)
            except CodecError as error:
                self.dropped.drop(error)
                if error.salvaged is not None:  # identified: its sender can be answered
                    return Refused(error.salvaged, error)

    async def aclose(self) -> None:
        self._transport._unbind(self.address, self._binding)
        await self._binding.receive.aclose()

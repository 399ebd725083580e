"""Channels between actors (inproc, ipc, tcp) and the msgspec codec.

Nothing here knows about language models.
"""

from .base import Address, AddressError, DropCounter, Frames, Receiver, Sender
from .codec import CodecError, Decoder, Encoder
from .hub import DEFAULT_CAPACITY, Hub, open_hub

__all__ = [
    "DEFAULT_CAPACITY",
    "Address",
    "AddressError",
    "CodecError",
    "Decoder",
    "DropCounter",
    "Encoder",
    "Frames",
    "Hub",
    "Receiver",
    "Sender",
    "open_hub",
]

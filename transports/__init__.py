"""Channels between actors (inproc, ipc, tcp) and the msgspec codec.

Nothing here knows about language models.
"""

from .base import Address, AddressError, DropCounter, Frames, InsecureBindError, Receiver, Sender
from .codec import DEFAULT_MAX_ARRAY_SIZE, Array, CodecError, Decoder, Encoder, Refused
from .config import DEFAULT_MAX_MESSAGE_BYTES, CurveConfig, HubOptions
from .hub import DEFAULT_CAPACITY, Hub, open_hub

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_MAX_ARRAY_SIZE",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Address",
    "AddressError",
    "Array",
    "CodecError",
    "CurveConfig",
    "Decoder",
    "DropCounter",
    "Encoder",
    "Frames",
    "Hub",
    "HubOptions",
    "InsecureBindError",
    "Receiver",
    "Refused",
    "Sender",
    "open_hub",
]

"""msgspec msgpack codec: one tagged union per channel, arrays out of band.

A message is encoded into a list of frames: frame 0 is the msgpack header;
every numpy array in the message travels as a frame of its own (no copy into
the header), referenced from the header by an extension object. The decoder
is built once per channel for its union type and rebuilds arrays as read-only
views of the received frames.

Arrays are bounded: a decoder refuses an array of more than ``max_array_size``
elements (any field), and a field declared
``Annotated[np.ndarray, Array(np.int32, ndim=1, max_size=N)]`` admits only
arrays of that dtype, number of dimensions and size (see ``_arrays``).

No pickle: anything msgspec cannot encode is refused at the sender.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
import typing
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from ._arrays import Array, ArrayMismatch, array_checks

__all__ = ["DEFAULT_MAX_ARRAY_SIZE", "Array", "CodecError", "Decoder", "Encoder", "Refused", "check_wire_type"]

DEFAULT_MAX_ARRAY_SIZE = 1 << 24  # elements of one array, any dtype (64 MiB of int32)

T = TypeVar("T")

_ARRAY_EXT = 1
_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(tuple[int, str, tuple[int, ...]])


class CodecError(Exception):
    """A frame that cannot become a message of the channel's type.

    ``kind`` is one of ``malformed`` (not msgpack), ``truncated``, ``invalid``
    (well-formed but not a member of the union: unknown tag, wrong field type,
    an array of the wrong dtype or shape), ``buffer`` (an out-of-band frame is
    missing or does not fit) and ``oversized`` (an array or a message larger
    than the receiver admits).
    """

    def __init__(self, kind: str, detail: str, salvaged: Any = None) -> None:
        super().__init__(f"{kind} frame: {detail}")
        self.kind = kind
        self.detail = detail
        self.salvaged = salvaged  # what the decoder's salvage type could still read of it, or None


@dataclass(frozen=True)
class Refused:
    """A message the receiver refused (``error``) but could identify (``salvaged``: an instance
    of its decoder's salvage type), handed on instead of dropped so that its sender can be
    answered (an error for that request) rather than left waiting."""

    salvaged: Any
    error: CodecError


class Encoder:
    """Encodes any msgspec-encodable message into frames. Not thread-safe."""

    def __init__(self) -> None:
        self._buffers: list[np.ndarray] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, msg: Any) -> list[Any]:
        self._buffers = buffers = []
        try:
            header = self._encoder.encode(msg)
        finally:
            self._buffers = []
        return [header, *buffers]

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:  # its raw buffer would hold object pointers
                raise TypeError(f"cannot encode a {obj.dtype} array (no pickle on the wire)")
            array = np.ascontiguousarray(obj).reshape(obj.shape)  # keeps 0-d arrays 0-d
            self._buffers.append(array)
            meta = (len(self._buffers) - 1, array.dtype.str, array.shape)
            return msgspec.msgpack.Ext(_ARRAY_EXT, _meta_encoder.encode(meta))
        raise TypeError(f"cannot encode {type(obj).__qualname__} (no pickle on the wire)")


class Decoder(Generic[T]):
    """Decodes frames into messages of one type (usually a tagged union).

    ``max_array_size``: the most elements of any one array; fields annotated
    with :class:`Array` are checked further. ``salvage``: a lenient type (a tagged
    struct or a union of them) to read what it can of a well-formed message that
    ``type_`` refuses (``invalid``, or an array that does not fit): the
    ``CodecError`` then carries it as ``salvaged``.
    """

    def __init__(self, type_: type[T], *, max_array_size: int = DEFAULT_MAX_ARRAY_SIZE,
                 salvage: Any = None) -> None:
        check_wire_type(type_)
        self.type = type_
        self.max_array_size = max_array_size
        self._check = array_checks(type_)
        self._frames: Sequence[Any] = ()
        self._decoder = msgspec.msgpack.Decoder(
            type_, ext_hook=self._ext_hook, dec_hook=_dec_hook
        )
        self._salvage = None if salvage is None else msgspec.msgpack.Decoder(salvage, ext_hook=_skip_ext)

    def decode(self, frames: Sequence[Any]) -> T:
        """Decode ``frames`` (bytes, memoryviews or zmq frames); raise CodecError."""
        if not frames:
            raise CodecError("truncated", "no frames")
        self._frames = frames
        try:
            msg = self._decoder.decode(_as_buffer(frames[0]))
            if self._check is not None:
                self._check(msg)
            return msg
        except ArrayMismatch as exc:
            raise CodecError(exc.kind, str(exc), self._salvaged(frames[0])) from None
        except _Oversized as exc:
            raise CodecError("oversized", str(exc)) from None
        except msgspec.ValidationError as exc:
            raise CodecError("invalid", str(exc), self._salvaged(frames[0])) from None
        except msgspec.DecodeError as exc:
            kind = "truncated" if "truncated" in str(exc) else "malformed"
            raise CodecError(kind, str(exc)) from None
        except _BufferError as exc:
            raise CodecError("buffer", str(exc)) from None
        except Exception as exc:  # e.g. invalid UTF-8 in a string: never crash a receiver
            raise CodecError("malformed", f"{type(exc).__name__}: {exc}") from None
        finally:
            self._frames = ()

    def _salvaged(self, header: Any) -> Any:
        if self._salvage is None:
            return None
        try:
            return self._salvage.decode(_as_buffer(header))
        except Exception:  # noqa: BLE001 - nothing to salvage: the message is dropped
            return None

    def check(self, msg: T) -> T:
        """Apply the Array checks to a message that did not come as frames (inproc)."""
        if self._check is not None:
            try:
                self._check(msg)
            except ArrayMismatch as exc:
                salvaged = None
                if self._salvage is not None:
                    salvaged = self._salvaged(msgspec.msgpack.encode(msg, enc_hook=lambda obj: None))
                raise CodecError(exc.kind, str(exc), salvaged) from None
        return msg

    def decode_raw(self, raw: msgspec.Raw, frames: Sequence[Any]) -> T:
        """Decode a ``msgspec.Raw`` taken from an envelope received in ``frames``."""
        return self.decode([raw, *frames[1:]])

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _ARRAY_EXT:
            raise _BufferError(f"unknown extension type {code}")
        try:
            index, dtype, shape = _meta_decoder.decode(data)
            if index < 0 or any(n < 0 for n in shape):
                raise ValueError(f"bad reference {index} {shape}")
            if (size := math.prod(shape)) > self.max_array_size:
                raise _Oversized(f"an array of {size} elements, more than {self.max_array_size}")
            buffer = _as_buffer(self._frames[index + 1])
            array = np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
            array.flags.writeable = False  # a view of the frame, maybe of the sender's array
            return array
        except (IndexError, ValueError, TypeError, OverflowError, msgspec.DecodeError) as exc:
            raise _BufferError(f"out-of-band array: {exc}") from None


def _skip_ext(code: int, data: memoryview) -> None:
    return None  # salvage reads no array


class _BufferError(Exception):
    pass


class _Oversized(Exception):
    pass


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise TypeError(f"expected {type_.__qualname__}, got {type(obj).__qualname__}")


def _as_buffer(frame: Any) -> Any:
    # zmq.Frame exposes its bytes without a copy through .buffer
    return frame.buffer if hasattr(frame, "buffer") else frame


def check_wire_type(type_: Any) -> None:
    """Refuse a channel type that msgspec would decode ambiguously or slowly.

    Every struct of a union must be tagged, and all must agree on
    ``array_like`` (msgspec cannot mix the two in one union).
    """
    is_union = typing.get_origin(type_) in (typing.Union, types.UnionType)  # Union[A, B] or A | B
    members = typing.get_args(type_) if is_union else (type_,)
    structs = [m for m in members if isinstance(m, type) and issubclass(m, msgspec.Struct)]
    if len(structs) > 1:
        untagged = [s.__qualname__ for s in structs if s.__struct_config__.tag is None]
        if untagged:
            raise TypeError(f"union members must be tagged structs: {untagged}")
        shapes = {s.__struct_config__.array_like for s in structs}
        if len(shapes) > 1:
            raise TypeError("union members must all be array_like (or all not)")

"""Typed array fields: ``Annotated[np.ndarray, Array(...)]``, checked as frames decode.

msgspec hands a custom type's ``dec_hook`` the bare type (``np.ndarray``),
never the ``Annotated`` metadata, and an out-of-band array is rebuilt before
msgspec knows which field it is for. So the constraints are read from the
channel's type once, when its Decoder is built (:func:`array_checks`), into
a small tree of checks that walks only the fields that can hold a
constrained array; the decoder runs it on each decoded message. A message
type without constrained arrays costs nothing (no check is built).

A check raises :class:`ArrayMismatch`, naming the field (``$.input_ids``,
``$.body.chunks[3]``); the decoder turns it into a CodecError.
"""

from __future__ import annotations

import collections.abc
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

__all__ = ["Array", "ArrayMismatch", "array_checks"]

Check = Callable[[Any], None]
_SEQUENCES = (list, set, frozenset, collections.abc.Sequence, collections.abc.Set)


@dataclass(frozen=True)
class Array:
    """What an ``np.ndarray`` field may hold; a frame with anything else is dropped.

    ``dtype``: the exact dtype, in native byte order (``np.int32`` refuses
    ``>i4`` and ``int64``); ``ndim``: the number of dimensions; ``max_size``:
    the most elements. ``None`` leaves that property free. Use it as
    ``Annotated[np.ndarray, Array(np.int32, ndim=1)]``.
    """

    dtype: Any = None
    ndim: int | None = None
    max_size: int | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None:
            dtype = np.dtype(self.dtype)
            if dtype.hasobject:
                raise TypeError("Array(dtype=object) cannot travel (no pickle on the wire)")
            object.__setattr__(self, "dtype", dtype)
        if self.ndim is not None and not 0 <= self.ndim <= 64:
            raise ValueError(f"Array(ndim={self.ndim}): expected 0..64")
        if self.max_size is not None and self.max_size < 0:
            raise ValueError(f"Array(max_size={self.max_size}): expected >= 0")

    def check(self, value: Any) -> None:
        """Raise ArrayMismatch unless ``value`` is an array this spec admits."""
        if not isinstance(value, np.ndarray):
            raise ArrayMismatch(f"expected an array, got {type(value).__qualname__}")
        if (self.dtype is not None and value.dtype != self.dtype) or (
                self.ndim is not None and value.ndim != self.ndim):
            raise ArrayMismatch(f"expected an array of {self._describe()}, got dtype {value.dtype.str}"
                                f" shape {value.shape}")
        if self.max_size is not None and value.size > self.max_size:
            raise ArrayMismatch(f"an array of {value.size} elements, more than {self.max_size}",
                                kind="oversized")

    def _describe(self) -> str:
        wanted = [] if self.dtype is None else [f"dtype {self.dtype.str}"]
        return ", ".join(wanted + ([] if self.ndim is None else [f"ndim {self.ndim}"]))


class ArrayMismatch(Exception):
    """A decoded array its field's Array spec refuses; ``path`` names the field."""

    def __init__(self, detail: str, *, kind: str = "invalid") -> None:
        super().__init__(detail)
        self.detail = detail
        self.kind = kind  # invalid (dtype, ndim) or oversized (max_size)
        self.path: list[str] = []

    def __str__(self) -> str:
        return f"{self.detail} - at `${''.join(self.path)}`"


def array_checks(type_: Any) -> Check | None:
    """The check of every constrained array a message of ``type_`` can hold, or None."""
    return _Builder().build(type_)


class _Builder:
    def __init__(self) -> None:
        self._structs: dict[Any, list[Check | None]] = {}  # a box per struct type (recursive types)

    def build(self, type_: Any) -> Check | None:
        origin, args = typing.get_origin(type_), typing.get_args(type_)
        if origin is Annotated:
            specs = [meta for meta in type_.__metadata__ if isinstance(meta, Array)]
            if not specs:
                return self.build(args[0])
            if args[0] is not np.ndarray or len(specs) > 1:
                raise TypeError(f"{type_}: one Array(...) annotates np.ndarray, nothing else")
            return specs[0].check
        if origin in (typing.Union, types.UnionType):
            return self._union(type_, args)
        struct = origin if isinstance(origin, type) and issubclass(origin, msgspec.Struct) else type_
        if isinstance(struct, type) and issubclass(struct, msgspec.Struct):
            return self._struct(type_)
        if origin in _SEQUENCES and len(args) == 1:
            return _items(self.build(args[0]))
        if origin is tuple and len(args) == 2 and args[1] is ...:  # tuple[A, ...]
            return _items(self.build(args[0]))
        if origin is tuple and args:  # tuple[A, B, C]
            return _positions([self.build(arg) for arg in args])
        if origin is dict and len(args) == 2:
            return _values(self.build(args[1]))
        return None

    def _struct(self, type_: Any) -> Check | None:
        box = self._structs.get(type_)
        if box is not None:  # met again while building it (a recursive type)
            return _deferred(box)
        box = self._structs[type_] = [None]
        fields = [(f.name, check) for f in msgspec.structs.fields(type_)
                  if (check := self.build(f.type)) is not None]
        if fields:
            box[0] = _fields(fields)
        return box[0]

    def _union(self, type_: Any, members: tuple[Any, ...]) -> Check | None:
        by_class: dict[type, Check] = {}
        for member in members:
            check = self.build(member)
            if check is None:
                continue
            cls = _runtime_class(member)
            if cls in by_class:
                raise TypeError(f"{type_}: two members decode to {cls.__qualname__} with array checks")
            by_class[cls] = check
        if not by_class:
            return None

        def check_member(value: Any) -> None:
            check = by_class.get(type(value))
            if check is not None:
                check(value)

        return check_member


def _runtime_class(type_: Any) -> type:
    """The class msgspec decodes ``type_`` into (for dispatch inside a union)."""
    while typing.get_origin(type_) is Annotated:
        type_ = typing.get_args(type_)[0]
    origin = typing.get_origin(type_)
    return origin if origin is not None else type_


def _deferred(box: list[Check | None]) -> Check:
    def check(value: Any) -> None:
        if box[0] is not None:
            box[0](value)

    return check


def _within(where: str, check: Check, value: Any) -> None:
    """``check(value)``, a mismatch's path prefixed with ``where`` (the field, index or key)."""
    try:
        check(value)
    except ArrayMismatch as exc:
        exc.path.insert(0, where)
        raise


def _fields(fields: list[tuple[str, Check]]) -> Check:
    def check(value: Any) -> None:
        for name, check_field in fields:
            _within(f".{name}", check_field, getattr(value, name))

    return check


def _items(check_item: Check | None) -> Check | None:
    if check_item is None:
        return None

    def check(value: Any) -> None:
        for index, item in enumerate(value):
            _within(f"[{index}]", check_item, item)

    return check


def _positions(checks: list[Check | None]) -> Check | None:
    if not any(checks):
        return None

    def check(value: Any) -> None:
        for index, (item, check_item) in enumerate(zip(value, checks)):
            if check_item is not None:
                _within(f"[{index}]", check_item, item)

    return check


def _values(check_value: Check | None) -> Check | None:
    if check_value is None:
        return None

    def check(value: Any) -> None:
        for key, item in value.items():
            _within(f"[{key!r}]", check_value, item)

    return check

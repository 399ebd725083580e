"""The msgspec codec: round trips, out-of-band arrays, and every way a frame can be bad."""

from __future__ import annotations

import random
import weakref
from typing import Annotated, Any, Generic, Optional, TypeVar, Union

import msgspec
import numpy as np
import pytest

from transports import Array
from transports.codec import CodecError, Decoder, Encoder, check_wire_type


class Generate(msgspec.Struct, tag="generate", array_like=True, gc=False):
    rid: str
    input_ids: list[int]
    max_new_tokens: int = 16
    stop: list[str] = []


class PackedGenerate(msgspec.Struct, tag="packed", array_like=True, gc=False):
    rid: str
    input_ids: np.ndarray


class Batch(msgspec.Struct, tag="batch", array_like=True, gc=False):
    rids: list[str]
    chunks: list[np.ndarray]
    finished: dict[str, str] = {}


class Abort(msgspec.Struct, tag="abort", array_like=True, gc=False):
    rid: str


class Envelope(msgspec.Struct, array_like=True, gc=False):
    dest: str
    body: msgspec.Raw


Message = Union[Generate, PackedGenerate, Batch, Abort]
_plain = msgspec.msgpack.Encoder()


@pytest.fixture
def encoder():
    return Encoder()


@pytest.fixture
def decoder():
    return Decoder(Message)


def as_bytes(frames):
    """What a socket delivers: each frame as its own bytes object."""
    return [bytes(memoryview(f)) for f in frames]


def byte_view(frame):
    return np.frombuffer(frame, dtype=np.uint8)


# -- round trips ---------------------------------------------------------------

STRUCTS = [
    Generate("r0", [1, 2, 3]),
    Generate("r-é-🚀", list(range(1000)), max_new_tokens=128, stop=["</s>", "\n\n"]),
    Generate("", []),
    Abort("r1"),
]


@pytest.mark.parametrize("msg", STRUCTS, ids=lambda m: type(m).__name__)
def test_struct_round_trip(encoder, decoder, msg):
    frames = encoder.encode(msg)
    assert len(frames) == 1
    assert decoder.decode(as_bytes(frames)) == msg


def test_tagged_union_wire_shape(encoder):
    """array_like + tag: a msgpack array led by the tag, no field names."""
    (header,) = encoder.encode(Abort("r1"))
    assert msgspec.msgpack.decode(header) == ["abort", "r1"]


ARRAYS = [
    np.arange(1000, dtype=np.int32),
    np.arange(12, dtype=np.int64).reshape(3, 4),
    np.linspace(0, 1, 24, dtype=np.float32).reshape(2, 3, 4),
    np.array([1.5, -2.0], dtype=np.float16),
    np.array([True, False, True]),
    np.arange(6, dtype=">u2").reshape(2, 3),  # non-native byte order survives
    np.zeros((0, 4), dtype=np.int32),
    np.array(7, dtype=np.int64),  # 0-d
]


@pytest.mark.parametrize("array", ARRAYS, ids=lambda a: f"{a.dtype.str}{list(a.shape)}")
def test_array_travels_out_of_band_and_decodes_as_a_view(encoder, decoder, array):
    frames = as_bytes(encoder.encode(PackedGenerate("r", array)))
    header, payload = frames
    assert len(payload) == array.nbytes
    assert len(header) < 40  # a reference, not the data
    if array.nbytes >= 16:
        assert array.tobytes() not in header
    msg = decoder.decode(frames)
    assert msg.input_ids.dtype == array.dtype
    assert msg.input_ids.shape == array.shape
    np.testing.assert_array_equal(msg.input_ids, array)
    if array.nbytes:
        assert np.shares_memory(msg.input_ids, byte_view(payload))  # no copy
    assert not msg.input_ids.flags.writeable


def test_unsent_frames_decode_read_only_so_the_sender_array_is_safe(encoder, decoder):
    """Frames handed over in process (no socket) are the sender's own arrays."""
    array = np.arange(8, dtype=np.int32)
    msg = decoder.decode(encoder.encode(PackedGenerate("r", array)))
    assert np.shares_memory(msg.input_ids, array)
    with pytest.raises(ValueError, match="read-only"):
        msg.input_ids[0] = 99
    assert array[0] == 0


def test_non_contiguous_array_is_sent_contiguous(encoder, decoder):
    array = np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2]
    frames = as_bytes(encoder.encode(PackedGenerate("r", array)))
    np.testing.assert_array_equal(decoder.decode(frames).input_ids, array)
    assert len(frames[1]) == array.nbytes


def test_arrays_nested_in_a_list_get_a_frame_each(encoder, decoder):
    chunks = [np.full(4, i, dtype=np.int32) for i in range(3)] + [np.zeros(2, np.float32)]
    msg = Batch(["a", "b", "c", "d"], chunks, {"b": "stop"})
    frames = as_bytes(encoder.encode(msg))
    assert len(frames) == 1 + len(chunks)
    got = decoder.decode(frames)
    assert got.rids == msg.rids and got.finished == msg.finished
    for out, sent, frame in zip(got.chunks, chunks, frames[1:], strict=True):
        np.testing.assert_array_equal(out, sent)
        assert out.dtype == sent.dtype
        assert np.shares_memory(out, byte_view(frame))


def test_decodes_from_memoryviews_without_copy(encoder, decoder):
    frames = [memoryview(f) for f in as_bytes(encoder.encode(PackedGenerate("r", ARRAYS[0])))]
    msg = decoder.decode(frames)
    assert np.shares_memory(msg.input_ids, np.asarray(frames[1]))


def test_decoder_accepts_zmq_like_frames(encoder, decoder):
    class Frame:  # zmq.Frame's shape: bytes behind .buffer
        def __init__(self, data):
            self.buffer = memoryview(data)

    frames = [Frame(f) for f in as_bytes(encoder.encode(PackedGenerate("r", ARRAYS[1])))]
    np.testing.assert_array_equal(decoder.decode(frames).input_ids, ARRAYS[1])


def test_encoder_is_reusable_and_forgets_old_buffers(encoder, decoder):
    ones, twos = np.ones(3, np.int32), np.full(2, 2, np.int64)
    first = encoder.encode(PackedGenerate("a", ones))
    second = encoder.encode(Abort("b"))
    third = encoder.encode(PackedGenerate("c", twos))
    assert (len(first), len(second), len(third)) == (2, 1, 2)
    for frames, rid, array in ((first, "a", ones), (third, "c", twos)):
        got = decoder.decode(as_bytes(frames))
        assert got.rid == rid
        np.testing.assert_array_equal(got.input_ids, array)
        assert got.input_ids.dtype == array.dtype
    assert decoder.decode(as_bytes(second)) == Abort("b")

    # forgotten: once the caller drops the frames, nothing in the encoder keeps the array alive
    array = np.arange(4, dtype=np.int32)
    alive = weakref.ref(array)
    frames = encoder.encode(PackedGenerate("d", array))
    del array, frames
    assert alive() is None


def test_raw_envelope_decoded_later(encoder, decoder):
    body = encoder.encode(PackedGenerate("r", np.arange(5, dtype=np.int32)))
    envelope_frames = encoder.encode(Envelope("scheduler", msgspec.Raw(body[0])))
    frames = as_bytes([envelope_frames[0], *body[1:]])  # arrays ride after the envelope
    envelope = Decoder(Envelope).decode(frames)
    assert envelope.dest == "scheduler"
    msg = decoder.decode_raw(envelope.body, frames)
    assert msg.rid == "r"
    np.testing.assert_array_equal(msg.input_ids, np.arange(5))
    assert np.shares_memory(msg.input_ids, byte_view(frames[1]))


def test_raw_envelope_with_bad_body_raises_codec_error(encoder, decoder):
    envelope = Decoder(Envelope).decode(encoder.encode(Envelope("x", msgspec.Raw(b"\xa1x"))))
    with pytest.raises(CodecError) as info:
        decoder.decode_raw(envelope.body, [b""])
    assert info.value.kind == "invalid"


# -- bad frames ----------------------------------------------------------------


def _ext(index, dtype, shape, code=1):
    return msgspec.msgpack.Ext(code, _plain.encode((index, dtype, shape)))


def _packed(*fields):
    return _plain.encode(["packed", *fields])


def _oob(ext, *payload):
    """A PackedGenerate header whose array is ``ext``, then the out-of-band frames."""
    return [_packed("r", ext), *payload]


BAD_FRAMES = {
    "malformed-opcode": ([b"\xc1"], "malformed", "malformed"),
    "empty-header": ([b""], "truncated", "truncated"),
    "truncated-header": ([_plain.encode(["generate", "r", [1, 2, 3]])[:-2]], "truncated", ""),
    "unknown-tag": ([_plain.encode(["nope", "r"])], "invalid", "$[0]"),
    "wrong-field-type": ([_plain.encode(["generate", "r", [1, 2, "3"]])], "invalid", "$[2][2]"),
    "wrong-top-type": ([_plain.encode({"rid": "r"})], "invalid", "array"),
    "missing-field": ([_plain.encode(["abort"])], "invalid", "at least length 2"),
    "list-where-array": ([_packed("r", [1, 2])], "invalid", "$[2]"),
    "ext-where-str": ([_packed(_ext(0, "<i4", (1,)), [1]), b"1234"], "invalid", "$[1]"),
    "missing-oob-frame": (_oob(_ext(0, "<i4", (2,))), "buffer", "out-of-band"),
    "oob-size-not-dtype": (_oob(_ext(0, "<i4", (2,)), b"1234567"), "buffer", "multiple"),
    "oob-size-not-shape": (_oob(_ext(0, "<i4", (3,)), b"12345678"), "buffer", "reshape"),
    "oob-negative-index": (_oob(_ext(-1, "|u1", (2,)), b"12"), "buffer", "bad reference"),
    "oob-negative-shape": (_oob(_ext(0, "|u1", (-1,)), b"12"), "buffer", "bad reference"),
    "oob-huge-shape": (_oob(_ext(0, "|u1", (2**63,)), b"12"), "oversized", "more than"),
    "oob-object-dtype": (_oob(_ext(0, "|O", (1,)), b"12345678"), "buffer", "out-of-band"),
    "oob-bad-dtype": (_oob(_ext(0, "not-a-dtype", (1,)), b"1"), "buffer", "out-of-band"),
    "oob-bad-meta": (_oob(msgspec.msgpack.Ext(1, b"\xc1"), b"1"), "buffer", "out-of-band"),
    "unknown-ext-code": (_oob(_ext(0, "<i4", (1,), code=9), b"1234"), "buffer", "9"),
    "invalid-utf8": ([b"\x92\xa5abort\xa2\xff\xfe"], "malformed", "utf-8"),
    "no-frames": ([], "truncated", "no frames"),
}


@pytest.mark.parametrize(("frames", "kind", "needle"), BAD_FRAMES.values(), ids=BAD_FRAMES)
def test_bad_frames_raise_codec_error(decoder, frames, kind, needle):
    with pytest.raises(CodecError) as info:
        decoder.decode(frames)
    assert info.value.kind == kind
    assert needle.lower() in str(info.value).lower()  # msgspec 0.23 says "UTF-8", 0.22 "utf-8"
    assert str(info.value).startswith(f"{kind} frame: ")


def test_field_path_names_the_element():
    decoder = Decoder(list[int])
    with pytest.raises(CodecError, match=r"Expected `int`, got `str` - at `\$\[2\]`") as info:
        decoder.decode([_plain.encode([1, 2, "x"])])
    assert info.value.kind == "invalid"


def test_codec_error_fields():
    error = CodecError("buffer", "gone")
    assert (error.kind, error.detail, str(error)) == ("buffer", "gone", "buffer frame: gone")


# -- what may be sent and what a channel type may be ------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    "value",
    [Opaque(), Abort(Opaque()), {1, 2, Opaque()}, np.int64(3), np.array([Opaque()], dtype=object)],
    ids=["object", "nested-object", "set-of-objects", "numpy-scalar", "object-array"],
)
def test_unencodable_is_refused_without_pickle(encoder, value):
    with pytest.raises(TypeError, match="no pickle"):
        encoder.encode(value)
    assert len(encoder.encode(Abort("after"))) == 1  # the encoder is still usable


class Untagged(msgspec.Struct, array_like=True):
    rid: str


class MapShaped(msgspec.Struct, tag="map"):
    rid: str


@pytest.mark.parametrize(
    "type_", [Union[Abort, Untagged], Abort | Untagged, Union[Abort, Generate, Untagged, None]]
)
def test_untagged_union_member_refused(type_):
    with pytest.raises(TypeError, match="tagged") as info:
        check_wire_type(type_)
    assert "Untagged" in str(info.value)
    with pytest.raises(TypeError):
        Decoder(type_)


@pytest.mark.parametrize("type_", [Union[Abort, MapShaped], Abort | MapShaped])
def test_mixed_array_like_refused(type_):
    with pytest.raises(TypeError, match="array_like"):
        check_wire_type(type_)


@pytest.mark.parametrize(
    "type_",
    [Message, Abort | Generate, Abort, Untagged, Untagged | None, list[int], Any, Envelope],
    ids=str,
)
def test_acceptable_wire_types(type_):
    check_wire_type(type_)
    Decoder(type_)


# -- fuzz ------------------------------------------------------------------------


def _valid_frame_sets():
    encoder = Encoder()
    messages = [
        *STRUCTS,
        PackedGenerate("r", np.arange(64, dtype=np.int32)),
        Batch(["a", "b"], [np.arange(4, dtype=np.int64), np.ones((2, 2), np.float32)], {"a": "x"}),
    ]
    return [as_bytes(encoder.encode(m)) for m in messages]


def _decode_or_codec_error(decoder, frames):
    try:
        decoder.decode(frames)
    except CodecError as exc:
        assert exc.kind in {"malformed", "truncated", "invalid", "buffer", "oversized"}


def test_fuzz_random_bytes_only_raise_codec_error(decoder):
    rng = random.Random(1234)
    for _ in range(2000):
        header = rng.randbytes(rng.randrange(0, 64))
        if rng.random() < 0.5:  # make it likelier to get past the first byte
            header = rng.choice([b"\x92", b"\x93", b"\x94", b"\xdc\x00\x03"]) + header
        frames = [header] + [rng.randbytes(rng.randrange(0, 32)) for _ in range(rng.randrange(3))]
        _decode_or_codec_error(decoder, frames)


def test_fuzz_truncated_and_corrupted_frames_only_raise_codec_error(decoder):
    rng = random.Random(5678)
    valid = _valid_frame_sets()
    for _ in range(2000):
        frames = list(rng.choice(valid))
        i = rng.randrange(len(frames))
        frame = bytearray(frames[i])
        if rng.random() < 0.5 and frame:
            frame = frame[: rng.randrange(len(frame))]
        else:
            for _ in range(rng.randrange(1, 4)):
                if frame:
                    frame[rng.randrange(len(frame))] = rng.randrange(256)
        frames[i] = bytes(frame)
        if rng.random() < 0.2:
            del frames[rng.randrange(1, len(frames)) if len(frames) > 1 else 0 :]
        _decode_or_codec_error(decoder, frames)


# -- typed arrays --------------------------------------------------------------

TokenIds = Annotated[np.ndarray, Array(np.int32, ndim=1, max_size=8)]
T = TypeVar("T")


class Typed(msgspec.Struct, tag="typed", array_like=True, gc=False):
    rid: str
    ids: TokenIds
    scores: Optional[Annotated[np.ndarray, Array(np.float32)]] = None
    chunks: list[Annotated[np.ndarray, Array(ndim=2)]] = []
    by_name: dict[str, TokenIds] = {}
    free: np.ndarray = np.zeros(0)  # no constraint but the decoder's size bound


class Wrapped(msgspec.Struct, Generic[T], tag="wrapped", array_like=True, gc=False):
    id: int
    body: T


def ids(*values, dtype=np.int32):
    return np.array(values, dtype=dtype)


GOOD_TYPED = [
    Typed("a", ids(1, 2, 3)),
    Typed("b", ids(), scores=np.ones(3, np.float32), chunks=[np.zeros((2, 2), np.int8)],
          by_name={"x": ids(7)}, free=np.zeros((2, 2, 2))),
    Typed("c", ids(*range(8))),  # max_size is inclusive
]


@pytest.mark.parametrize("msg", GOOD_TYPED, ids=lambda m: m.rid)
def test_typed_array_fields_admit_matching_arrays(encoder, msg):
    decoder = Decoder(Typed | Abort)
    got = decoder.decode(as_bytes(encoder.encode(msg)))
    np.testing.assert_array_equal(got.ids, msg.ids)
    assert got.ids.dtype == np.int32


BAD_TYPED = {
    "wrong-dtype": (Typed("r", ids(1, 2, dtype=np.int64)), "invalid", "$.ids", "dtype <i8"),
    "wrong-ndim": (Typed("r", np.zeros((2, 3), np.int32)), "invalid", "$.ids", "shape (2, 3)"),
    "0-d": (Typed("r", np.array(5, np.int32)), "invalid", "$.ids", "ndim 1"),
    "byte-swapped": (Typed("r", ids(1, dtype=">i4")), "invalid", "$.ids", "dtype >i4"),
    "too-many": (Typed("r", ids(*range(9))), "oversized", "$.ids", "9 elements, more than 8"),
    "optional-field": (Typed("r", ids(1), scores=np.ones(2)), "invalid", "$.scores", "<f8"),
    "in-a-list": (Typed("r", ids(1), chunks=[np.zeros((1, 1)), np.zeros(3)]), "invalid",
                  "$.chunks[1]", "ndim 2"),
    "in-a-dict": (Typed("r", ids(1), by_name={"k": ids(1, dtype=np.uint32)}), "invalid",
                  "$.by_name['k']", "<u4"),
}


@pytest.mark.parametrize(("msg", "kind", "path", "needle"), BAD_TYPED.values(), ids=BAD_TYPED)
def test_typed_array_fields_refuse_other_arrays(encoder, msg, kind, path, needle):
    decoder = Decoder(Typed | Abort)
    with pytest.raises(CodecError) as info:
        decoder.decode(as_bytes(encoder.encode(msg)))
    assert info.value.kind == kind
    assert f"at `{path}`" in str(info.value) and needle in str(info.value)
    assert decoder.decode(as_bytes(encoder.encode(Abort("next")))) == Abort("next")  # still usable
    with pytest.raises(CodecError):  # the same check for an object that came unencoded (inproc)
        decoder.check(msg)


def test_typed_arrays_inside_a_generic_envelope_are_checked(encoder):
    decoder = Decoder(Union[Abort, Wrapped[Typed | Abort]])
    frames = as_bytes(encoder.encode(Wrapped(1, Typed("r", np.zeros((1, 1), np.int32)))))
    with pytest.raises(CodecError, match=r"at `\$\.body\.ids`"):
        decoder.decode(frames)
    assert decoder.decode(as_bytes(encoder.encode(Wrapped(2, Abort("x"))))).body == Abort("x")


def test_decoder_bounds_every_array_by_elements(encoder):
    decoder = Decoder(Typed | Abort, max_array_size=10)
    frames = as_bytes(encoder.encode(Typed("r", ids(1), free=np.zeros(11, np.uint8))))
    with pytest.raises(CodecError, match="11 elements, more than 10") as info:
        decoder.decode(frames)
    assert info.value.kind == "oversized"
    assert len(decoder.decode(as_bytes(encoder.encode(Typed("r", ids(1), free=np.zeros(10))))).free) == 10


def test_types_without_array_constraints_build_no_check():
    assert Decoder(Message)._check is None
    assert Decoder(Typed)._check is not None


@pytest.mark.parametrize(
    "type_",
    [Annotated[list[int], Array(np.int32)], Annotated[np.ndarray, Array(np.int32), Array(ndim=1)]],
    ids=["not-an-ndarray", "two-specs"],
)
def test_misplaced_array_spec_is_refused(type_):
    with pytest.raises(TypeError, match="Array"):
        Decoder(type_)


def test_array_spec_arguments_are_checked():
    with pytest.raises(TypeError, match="no pickle"):
        Array(object)
    with pytest.raises(ValueError, match="ndim"):
        Array(ndim=-1)
    assert Array("int32").dtype == np.dtype(np.int32)


class GenerateId(msgspec.Struct, tag="generate", array_like=True, gc=False):
    """A salvage type: what a receiver can still read of a refused Generate."""

    rid: str


def test_a_refused_message_that_the_salvage_type_reads_carries_its_identity(encoder):
    decoder = Decoder(Union[Generate, Abort], salvage=GenerateId)
    frames = [msgspec.msgpack.encode(["generate", "r1", [1, 2], "many"])]  # max_new_tokens: not an int
    strict = Decoder(Union[Generate, Abort])
    for d, salvaged in ((strict, None), (decoder, GenerateId("r1"))):
        with pytest.raises(CodecError) as refused:
            d.decode(frames)
        assert refused.value.kind == "invalid" and refused.value.salvaged == salvaged
    with pytest.raises(CodecError) as unreadable:  # a rid that is not text: nothing to salvage
        decoder.decode([msgspec.msgpack.encode(["generate", 5, [1]])])
    assert unreadable.value.salvaged is None


async def test_an_inproc_receiver_hands_on_a_refused_message_it_can_identify(encoder):
    from transports import Frames, Refused, open_hub

    async with open_hub() as hub:
        inbox = await hub.bind("inproc://salvage", Decoder(Union[Generate, Abort], salvage=GenerateId))
        sender = await hub.connect("inproc://salvage")
        await sender.send(Frames([msgspec.msgpack.encode(["generate", "r1", [1], "many"])]))
        await sender.send(Abort("r2"))
        refused = await inbox.receive()
        assert isinstance(refused, Refused) and refused.salvaged == GenerateId("r1")
        assert refused.error.kind == "invalid" and inbox.dropped.counts["invalid"] == 1
        assert await inbox.receive() == Abort("r2")

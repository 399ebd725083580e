"""A hostile or buggy peer: typed arrays, message size bounds, tcp binds without CURVE.

Each bad input is dropped and counted by the receiver, which goes on serving
the well-behaved; everything goes through real sockets.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import numpy as np
import pytest
import trio
import trio.testing
import zmq

from transports import Array, CurveConfig, Encoder, Frames, InsecureBindError, open_hub
from transports import _zmqreceiver

from .conftest import Note
from .monitors import events_of


class Generate(msgspec.Struct, tag=True, array_like=True, gc=False):
    rid: int
    input_ids: Annotated[np.ndarray, Array(np.int32, ndim=1, max_size=1000)]


Wire = Note | Generate


# -- typed arrays ------------------------------------------------------------------

BAD_GENERATES = [
    Generate(1, np.zeros((2, 3), np.int32)),  # 2-D: the scheduler's crash
    Generate(2, np.arange(3, dtype=np.int64)),
    Generate(3, np.arange(3, dtype=">i4")),
    Generate(4, np.zeros(1001, np.int32)),
]


async def test_arrays_their_field_refuses_are_dropped_on_every_scheme(make_address, scheme):
    """From a hub's own sender (it encodes whatever it is given) and, inproc, as objects."""
    async with open_hub() as hub:
        address = make_address()
        receiver = await hub.bind(address, Wire)
        async with await hub.connect(address) as sender:
            for msg in BAD_GENERATES:
                await sender.send(msg)
            await sender.send(Generate(5, np.arange(4, dtype=np.int32)))
            await sender.send(Note(0, 6))
            with trio.fail_after(5):
                good = await receiver.receive()
                assert good.rid == 5 and good.input_ids.tolist() == [0, 1, 2, 3]
                assert await receiver.receive() == Note(0, 6)
        assert dict(receiver.dropped.counts) == {"invalid": 3, "oversized": 1}
        await receiver.aclose()


async def test_arrays_their_field_refuses_are_dropped_when_injected_as_frames():
    async with open_hub() as hub:
        receiver = await hub.bind("inproc://typed", Wire)
        async with await hub.connect("inproc://typed") as sender:
            for msg in BAD_GENERATES:
                await sender.send(Frames(Encoder().encode(msg)))
            await sender.send(Note(0, 1))
            assert await receiver.receive() == Note(0, 1)
        assert dict(receiver.dropped.counts) == {"invalid": 3, "oversized": 1}
        await receiver.aclose()


async def test_a_raw_peer_sending_a_2d_array_does_not_reach_the_receiver(wire_address, raw_dealer):
    async with open_hub() as hub:
        receiver = await hub.bind(wire_address, Wire)
        peer = raw_dealer(wire_address)
        header, payload = Encoder().encode(Generate(0, np.arange(4, dtype=np.int32)))
        _, wide = Encoder().encode(Generate(0, np.arange(4, dtype=np.int64)))
        bad_header, _ = Encoder().encode(Generate(1, np.zeros((2, 2), np.int32)))
        peer.send_multipart([bad_header, payload])  # the header says 2x2 of the right bytes
        peer.send_multipart([header, wide])  # 32 bytes where 16 are declared: does not fit
        peer.send_multipart([header, payload])
        with trio.fail_after(5):
            got = await receiver.receive()
        assert got.rid == 0 and got.input_ids.shape == (4,)
        assert dict(receiver.dropped.counts) == {"invalid": 1, "buffer": 1}
        await receiver.aclose()


# -- message size ----------------------------------------------------------------------

LIMIT = 64 << 10


async def test_an_oversized_frame_disconnects_its_peer_and_others_are_served(wire_address, raw_dealer):
    async with open_hub(max_message_bytes=LIMIT) as hub:
        receiver = await hub.bind(wire_address, Wire)
        async with events_of(receiver._sock, zmq.EVENT_DISCONNECTED) as next_disconnect:
            peer = raw_dealer(wire_address)
            peer.send_multipart(Encoder().encode(Note(1, 1)))
            with trio.fail_after(5):
                assert await receiver.receive() == Note(1, 1)  # connected
                peer.send_multipart(Encoder().encode(Note(1, 2, b"x" * LIMIT)))  # header over the bound
                assert (await next_disconnect())[0] == zmq.EVENT_DISCONNECTED  # libzmq cut the peer off
                async with await hub.connect(wire_address) as sender:
                    await sender.send(Note(2, 1, b"y" * (LIMIT - 100)))
                    assert await receiver.receive() == Note(2, 1, b"y" * (LIMIT - 100))
                peer.send_multipart(Encoder().encode(Note(1, 3)))  # the peer reconnects
                assert await receiver.receive() == Note(1, 3)  # ...and its big note never came
        assert not receiver.dropped.counts
        await receiver.aclose()


async def test_a_message_whose_frames_add_up_past_the_bound_is_dropped(wire_address, raw_dealer, monkeypatch):
    monkeypatch.setattr(_zmqreceiver, "MAX_FRAMES", 8)
    async with open_hub(max_message_bytes=LIMIT) as hub:
        receiver = await hub.bind(wire_address, Wire)
        peer = raw_dealer(wire_address)
        header, payload = Encoder().encode(Generate(0, np.arange(4, dtype=np.int32)))
        chunk = b"z" * (LIMIT // 2 + 1)  # each frame within the bound, the message not
        peer.send_multipart([header, chunk, chunk])
        peer.send_multipart([header] + [payload] * 9)  # too many frames
        peer.send_multipart([header, payload])
        with trio.fail_after(5):
            got = await receiver.receive()
        assert got.rid == 0 and got.input_ids.tolist() == [0, 1, 2, 3]
        assert dict(receiver.dropped.counts) == {"oversized": 2}
        await receiver.aclose()


async def test_a_dropped_message_leaves_no_receive_stranded(wire_address, raw_dealer):
    """The owner drops the only message a waiting receive was woken for, and reads on."""
    async with open_hub(max_message_bytes=LIMIT) as hub:
        receiver = await hub.bind(wire_address, Wire)
        dropped = trio.Event()
        count = receiver.dropped.count

        def count_and_tell(kind: str, detail: str) -> None:
            count(kind, detail)
            dropped.set()

        receiver.dropped.count = count_and_tell
        peer = raw_dealer(wire_address)
        header, payload = Encoder().encode(Generate(0, np.arange(4, dtype=np.int32)))
        got = []

        async def receive_one():
            got.append(await receiver.receive())

        with trio.fail_after(5):
            await trio.testing.wait_all_tasks_blocked()  # the owner waits on the socket
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_one)
                await trio.testing.wait_all_tasks_blocked()  # ...and receive on the owner
                peer.send_multipart([header, b"z" * (LIMIT // 2 + 1), b"z" * (LIMIT // 2 + 1)])
                await dropped.wait()  # the owner took it and dropped it
                peer.send_multipart([header, payload])
        assert got[0].rid == 0 and dict(receiver.dropped.counts) == {"oversized": 1}
        await receiver.aclose()


async def test_the_bounds_hold_when_the_receiving_task_reads_the_socket_itself(wire_address, raw_dealer,
                                                                               monkeypatch):
    """A receive coming back right after the owner fed it reads the socket in the owner's place."""
    monkeypatch.setattr(_zmqreceiver, "MAX_FRAMES", 8)
    async with open_hub(max_message_bytes=LIMIT) as hub:
        receiver = await hub.bind(wire_address, Wire)
        peer = raw_dealer(wire_address)
        header, payload = Encoder().encode(Generate(0, np.arange(4, dtype=np.int32)))
        peer.send_multipart(Encoder().encode(Note(0, 1)))
        with trio.fail_after(5):
            assert await receiver.receive() == Note(0, 1)  # the owner fed us and parked
            # sent with no checkpoint in between: the next receive holds the socket and reads them
            peer.send_multipart([header, b"z" * (LIMIT // 2 + 1), b"z" * (LIMIT // 2 + 1)])
            peer.send_multipart([header] + [payload] * 9)
            peer.send_multipart([header, payload])
            got = await receiver.receive()
        assert got.rid == 0 and got.input_ids.tolist() == [0, 1, 2, 3]
        assert dict(receiver.dropped.counts) == {"oversized": 2}
        await receiver.aclose()


async def test_the_bound_is_set_on_every_receiving_socket(wire_address):
    async with open_hub(max_message_bytes=12345) as hub:
        receiver = await hub.bind(wire_address, Note)
        sender = await hub.connect(wire_address)
        assert receiver._sock.getsockopt(zmq.MAXMSGSIZE) == 12345
        assert 0 < sender._sock.getsockopt(zmq.MAXMSGSIZE) <= 64 << 10  # it receives acknowledgements
        await sender.aclose()
        await receiver.aclose()


# -- tcp binds without CURVE -----------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "*", "[::]", "192.0.2.1", "lo", "example.com"])
async def test_a_non_loopback_tcp_bind_without_curve_is_refused(host):
    async with open_hub() as hub:
        with pytest.raises(InsecureBindError, match="allow_insecure=True"):
            await hub.bind(f"tcp://{host}:0", Note)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "[::1]"])
async def test_loopback_tcp_binds_need_no_curve(host):
    async with open_hub() as hub:
        receiver = await hub.bind(f"tcp://{host}:0", Note)
        async with await hub.connect(receiver.address) as sender:
            await sender.send(Note(0, 1))
            with trio.fail_after(5):
                assert await receiver.receive() == Note(0, 1)
        await receiver.aclose()


async def test_a_non_loopback_tcp_bind_is_allowed_when_asked_or_with_curve():
    async with open_hub(allow_insecure=True) as hub:
        receiver = await hub.bind("tcp://0.0.0.0:0", Note)
        port = receiver.address.rest.rpartition(":")[2]
        async with await hub.connect(f"tcp://127.0.0.1:{port}") as sender:
            await sender.send(Note(0, 1))
            with trio.fail_after(5):
                assert await receiver.receive() == Note(0, 1)
        await receiver.aclose()
    async with open_hub(curve=CurveConfig.generate()) as hub:
        receiver = await hub.bind("tcp://0.0.0.0:0", Note)
        await receiver.aclose()

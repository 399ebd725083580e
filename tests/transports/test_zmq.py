"""What only the ZeroMQ schemes have: the wire, raw peers, addresses, CURVE, aborts."""

from __future__ import annotations

from typing import Union

import msgspec
import numpy as np
import pytest
import trio
import trio.testing
import zmq
import zmq.auth

from transports import Address, AddressError, Decoder, Encoder, open_hub
from transports.zmq import CurveConfig, ZmqTransport

from .conftest import Note
from .monitors import ADMITTED, events_of


class Tensor(msgspec.Struct, tag=True, array_like=True, gc=False):
    name: str
    data: np.ndarray


Wire = Union[Note, Tensor]


async def test_arrays_travel_out_of_band(wire_address):
    async with open_hub() as hub:
        receiver = await hub.bind(wire_address, Wire)
        async with await hub.connect(wire_address) as sender:
            data = np.arange(100_000, dtype=np.int32).reshape(100, 1000)
            await sender.send(Tensor("w", data))
            got = await receiver.receive()
        assert got.name == "w" and got.data.shape == (100, 1000)
        np.testing.assert_array_equal(got.data, data)
        assert not got.data.flags.writeable  # a view of the received frame
        await receiver.aclose()


async def test_malformed_frames_from_a_raw_peer_are_counted_and_dropped(wire_address, raw_dealer):
    async with open_hub() as hub:
        receiver = await hub.bind(wire_address, Wire)
        peer = raw_dealer(wire_address)
        header, array = Encoder().encode(Tensor("t", np.arange(4)))
        peer.send(b"\xc1")  # not msgpack
        peer.send(b"\x93\xa4Note\x01")  # truncated
        peer.send(b"\x93\xa4Nope\x01\x02")  # unknown tag
        peer.send(header)  # its out-of-band frame is missing
        peer.send_multipart([b"\x94\xa4Note\x00\x07\xc4\x00", b"stray"])  # an extra frame: ignored
        peer.send_multipart(Encoder().encode(Note(0, 9)))
        with trio.fail_after(5):
            assert (await receiver.receive()).seq == 7
            assert (await receiver.receive()).seq == 9
        assert dict(receiver.dropped.counts) == {
            "malformed": 1, "truncated": 1, "invalid": 1, "buffer": 1,
        }
        peer.send_multipart([header, array])
        with trio.fail_after(5):
            assert (await receiver.receive()).data.tolist() == [0, 1, 2, 3]
        await receiver.aclose()


async def test_port_zero_picks_a_free_port_and_binds_the_host_given():
    async with open_hub() as hub:
        receiver = await hub.bind("tcp://127.0.0.1:0", Note)
        assert receiver.address.scheme == "tcp"
        host, port = receiver.address.rest.split(":")
        assert host == "127.0.0.1" and int(port) > 0
        async with await hub.connect(receiver.address) as sender:
            await sender.send(Note(0, 1))
        assert (await receiver.receive()).seq == 1
        await receiver.aclose()


async def test_binding_a_bound_address_again_fails(wire_address):
    async with open_hub() as hub:
        receiver = await hub.bind(wire_address, Note)
        with pytest.raises(OSError):
            await hub.bind(wire_address, Note)
        await receiver.aclose()


async def test_bad_addresses_are_address_errors():
    async with open_hub() as hub:
        with pytest.raises(AddressError):
            await hub.connect("tcp://*:5555")  # a connect needs a host
    async with open_hub(allow_insecure=True) as hub:  # else refused before it is looked up
        with pytest.raises(AddressError, match="no-such-interface"):
            await hub.bind("tcp://no-such-interface.invalid:5555", Note)


async def test_close_waits_until_a_full_receiver_has_taken_everything(tmp_path):
    address = f"ipc://{tmp_path}/full.sock"
    count, capacity = 3000, 4
    async with open_hub() as hub:
        receiver = await hub.bind(address, Note, capacity=capacity, senders=1)
        sender = await hub.connect(address, capacity=count)  # every send returns at once: the close is what waits
        all_sent, closed = trio.Event(), trio.Event()

        async def send_all_then_close():
            for seq in range(count):
                await sender.send(Note(0, seq, b"x" * 200))
            all_sent.set()
            await sender.aclose()
            closed.set()

        got: list[int] = []
        unread_when_closed = None
        with trio.fail_after(10):  # a bound that fails; the waits are on events
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_all_then_close)
                await trio.testing.wait_all_tasks_blocked()  # nobody reads: the close waits
                assert all_sent.is_set() and not closed.is_set()
                async for note in receiver:
                    got.append(note.seq)
                    if closed.is_set() and unread_when_closed is None:
                        unread_when_closed = count - len(got)
        assert closed.is_set()
        assert got == list(range(count))
        # acknowledged once the receiving process held everything: at most a channel's worth unread
        assert unread_when_closed is None or unread_when_closed <= capacity
        await receiver.aclose()


async def test_cancelled_close_without_a_receiver_abandons_promptly(wire_address):
    async with open_hub() as hub:
        sender = await hub.connect(wire_address)
        await sender.send(Note(0, 1))
        with trio.fail_after(10):  # a bound that fails; the waits are on events
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender.aclose)
                await trio.testing.wait_all_tasks_blocked()  # waiting for an acknowledgement nobody sends
                assert not sender.finished.is_set()
                nursery.cancel_scope.cancel()
        # abandoned at once, with no word from the wire: the owner has closed the socket
        await trio.testing.wait_all_tasks_blocked()
        assert sender.finished.is_set()
        with pytest.raises(trio.ClosedResourceError):
            await sender.send(Note(0, 2))


async def test_closing_the_hub_ends_open_channels(wire_address):
    async with open_hub() as hub:
        receiver = await hub.bind(wire_address, Note)
        sender = await hub.connect(wire_address)
        await sender.send(Note(0, 1))
    with pytest.raises(trio.BrokenResourceError):
        while True:
            await receiver.receive()
    with pytest.raises(trio.BrokenResourceError):
        await sender.send(Note(0, 2))


async def test_a_sender_blocked_on_a_full_receiver_can_be_cancelled(tmp_path):
    address = f"ipc://{tmp_path}/cancel.sock"
    limit = 50_000  # far more than the channels and the wire hold
    async with open_hub() as hub:
        receiver = await hub.bind(address, Note, capacity=1)
        sender = await hub.connect(address, capacity=1)
        sent = 0
        cancelled_in_send = False

        async def produce():
            nonlocal sent, cancelled_in_send
            while sent < limit:
                try:
                    await sender.send(Note(0, sent))
                except trio.Cancelled:
                    cancelled_in_send = True
                    raise
                sent += 1

        with trio.fail_after(10):  # a bound that fails; the waits are on events
            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                await trio.testing.wait_all_tasks_blocked()  # nobody reads: the producer is stuck in a send
                assert sent < limit
                nursery.cancel_scope.cancel()
            assert cancelled_in_send
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sender.send, Note(1, 0))  # the sender still works
                for seq in range(sent):  # every send that returned is delivered, in order
                    assert (await receiver.receive()).seq == seq
                assert await receiver.receive() == Note(1, 0)  # ...and the cancelled one is not
            await sender.aclose()
        await receiver.aclose()


@pytest.fixture
def curve_keys(tmp_path):
    keys = {}
    for name in ("server", "client", "intruder"):
        (tmp_path / name).mkdir()
        keys[name] = zmq.auth.create_certificates(tmp_path / name, name)  # (public, secret)
    authorized = tmp_path / "server" / "authorized"
    authorized.mkdir()
    (authorized / "client.key").write_bytes((tmp_path / "client" / "client.key").read_bytes())
    return keys, authorized


@pytest.mark.parametrize(
    ("candidate", "refusal"),
    [
        # a valid handshake whose key the ZAP handler does not know: ZAP status 400
        ("intruder", (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)),
        # encrypted for another server key: the receiver cannot open its HELLO
        ("wrong-server-key", (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)),
        # no CURVE at all (NULL mechanism)
        ("no-curve", (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)),
    ],
    ids=["intruder", "wrong-server-key", "no-curve"],
)
async def test_curve_admits_only_authorized_senders(curve_keys, candidate, refusal):
    keys, authorized = curve_keys
    server = CurveConfig(secret_file=keys["server"][1], authorized_dir=authorized)

    def client(name: str, server_public: str | None = None) -> CurveConfig:
        return CurveConfig(secret_file=keys[name][1],
                           server_public_file=server_public or keys["server"][0])

    candidates = {
        "intruder": client("intruder"),
        "wrong-server-key": client("client", server_public=keys["intruder"][0]),
        "no-curve": None,
    }
    async with trio.open_nursery() as nursery:
        transport = ZmqTransport(nursery, "tcp")
        receiver = await transport.bind(Address.parse("tcp://127.0.0.1:0"), Decoder(Note),
                                        capacity=8, senders=None, curve=server)
        async with events_of(receiver._sock) as next_outcome:
            with trio.fail_after(10):  # a bound that fails; every wait below is on an event
                refused = await transport.connect(receiver.address, capacity=8, curve=candidates[candidate])
                await refused.send(Note(1, 1))
                assert await next_outcome() == refusal  # the receiver refused it

                admitted = await transport.connect(receiver.address, capacity=8, curve=client("client"))
                await admitted.send(Note(0, 2))
                while (outcome := await next_outcome()) != ADMITTED:
                    assert outcome == refusal  # the refused sender retrying, refused again
                # delivered, and the refused sender's earlier note was not
                assert await receiver.receive() == Note(0, 2)
                await admitted.aclose()
            with trio.move_on_after(0):
                await refused.aclose()  # never acknowledged: a cancelled close abandons it
        await transport.aclose()


async def test_messages_sent_right_after_a_rebind_are_never_lost(wire_address):
    # libzmq destroys a closed socket in its I/O thread; a message written
    # into one of its connections meanwhile was lost (13% of rebinds)
    async with open_hub() as hub:
        sender = await hub.connect(wire_address)
        for round_ in range(30):
            receiver = await hub.bind(wire_address, Note)
            await sender.send(Note(0, round_))
            with trio.fail_after(5):
                assert (await receiver.receive()).seq == round_
            await receiver.aclose()
        receiver = await hub.bind(wire_address, Note)
        await sender.aclose()
        await receiver.aclose()


async def test_receiver_closed_after_the_hub_raises_closed_resource(wire_address):
    async with open_hub() as hub:
        receiver = await hub.bind(wire_address, Note)
    await receiver.aclose()
    await receiver.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await receiver.receive()


async def test_curve_configured_on_the_hub_secures_its_tcp_channels(curve_keys):
    keys, authorized = curve_keys
    server = CurveConfig(secret_file=keys["server"][1], authorized_dir=authorized)
    client = CurveConfig(secret_file=keys["client"][1], server_public_file=keys["server"][0])
    async with open_hub(curve=server) as server_hub, open_hub(curve=client) as client_hub:
        receiver = await server_hub.bind("tcp://127.0.0.1:0", Note)
        async with await client_hub.connect(receiver.address) as sender:
            await sender.send(Note(0, 5))
            with trio.fail_after(5):
                assert (await receiver.receive()).seq == 5
        with pytest.raises(ValueError, match="server_public_file"):
            await server_hub.connect(receiver.address)  # its config has no server key
        await receiver.aclose()

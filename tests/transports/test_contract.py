"""The transport contract, written once and run on every scheme."""

import random

import pytest
import trio
import trio.testing

from transports import Frames

from .conftest import Note


async def test_order_kept_and_nothing_lost(hub, make_address):
    address = make_address()
    receiver = await hub.bind(address, Note, capacity=8)
    sender = await hub.connect(address)
    count = 2000
    got = []
    async with trio.open_nursery() as nursery:

        async def produce():
            for seq in range(count):
                await sender.send(Note(0, seq))

        nursery.start_soon(produce)
        for _ in range(count):
            got.append((await receiver.receive()).seq)
    assert got == list(range(count))
    await sender.aclose()
    await receiver.aclose()


async def test_many_senders_each_in_order(hub, make_address):
    address = make_address()
    receiver = await hub.bind(address, Note, capacity=16)
    per_sender, senders = 300, 4
    seen: dict[int, list[int]] = {i: [] for i in range(senders)}
    async with trio.open_nursery() as nursery:
        for i in range(senders):

            async def produce(i=i):
                async with await hub.connect(address) as sender:
                    for seq in range(per_sender):
                        await sender.send(Note(i, seq))

            nursery.start_soon(produce)
        for _ in range(per_sender * senders):
            note = await receiver.receive()
            seen[note.sender].append(note.seq)
    assert all(seqs == list(range(per_sender)) for seqs in seen.values())
    await receiver.aclose()


async def test_full_receiver_blocks_the_sender(hub, make_address):
    address = make_address()
    receiver = await hub.bind(address, Note, capacity=4)
    sender = await hub.connect(address, capacity=4)
    sent = 0
    limit = 50_000

    async def produce():
        nonlocal sent
        for seq in range(limit):
            await sender.send(Note(0, seq, b"x" * 100))
            sent += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        # Nobody reads. Every task blocked means the producer waits inside a
        # send (its only wait) long before the limit; a sender that never
        # blocked would have run to the limit first.
        await trio.testing.wait_all_tasks_blocked()
        assert sent < limit
        for seq in range(limit):  # blocked, not dropping: everything comes, in order
            assert (await receiver.receive()).seq == seq
    assert sent == limit  # ...and the blocked send completed once the receiver read
    await sender.aclose()
    await receiver.aclose()


async def test_closed_ends_raise_closed_resource(hub, make_address):
    address = make_address()
    receiver = await hub.bind(address, Note)
    sender = await hub.connect(address)
    await sender.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await sender.send(Note(0, 0))
    await receiver.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await receiver.receive()


async def test_orderly_close_delivers_everything_then_ends(hub, make_address):
    address = make_address()
    receiver = await hub.bind(address, Note, capacity=8, senders=2)
    async with trio.open_nursery() as nursery:
        for i in range(2):

            async def produce(i=i):
                async with await hub.connect(address) as sender:
                    for seq in range(100):
                        await sender.send(Note(i, seq))

            nursery.start_soon(produce)
        got = [note async for note in receiver]
    assert sorted((n.sender, n.seq) for n in got) == [(i, s) for i in range(2) for s in range(100)]
    with pytest.raises(trio.EndOfChannel):
        await receiver.receive()
    await receiver.aclose()


async def test_cancelled_receive_never_loses_a_message(hub, make_address):
    address = make_address()
    receiver = await hub.bind(address, Note, capacity=4)
    sender = await hub.connect(address)
    rng = random.Random(7)
    count = 500
    got = []

    async def cancel_after(scope, checkpoints):
        for _ in range(checkpoints):
            await trio.lowlevel.checkpoint()
        scope.cancel()

    async with trio.open_nursery() as nursery:

        async def produce():
            for seq in range(count):
                await sender.send(Note(0, seq))
                if rng.random() < 0.1:
                    await trio.sleep(0)

        nursery.start_soon(produce)
        with trio.fail_after(10):  # a bound that fails if the last message is the one lost
            while not got or got[-1] != count - 1:  # a lost message shows in the list below
                with trio.CancelScope() as scope:
                    when = rng.random()
                    if when < 0.3:
                        scope.cancel()  # cancelled at the first checkpoint
                    elif when < 0.7:  # cancelled inside receive: waiting, or just after taking a message
                        nursery.start_soon(cancel_after, scope, rng.randrange(4))
                    got.append((await receiver.receive()).seq)
    assert got == list(range(count))
    await sender.aclose()
    await receiver.aclose()


async def test_sender_waits_for_a_receiver_bound_later(hub, make_address):
    address = make_address()
    sender = await hub.connect(address)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.send, Note(0, 1))
        await trio.testing.wait_all_tasks_blocked()
        receiver = await hub.bind(address, Note)
        assert (await receiver.receive()).seq == 1
    await sender.aclose()
    await receiver.aclose()


async def test_receiver_bound_again_is_reached_by_old_senders(hub, make_address):
    address = make_address()
    sender = await hub.connect(address)
    receiver = await hub.bind(address, Note)
    await sender.send(Note(0, 1))
    assert (await receiver.receive()).seq == 1
    await receiver.aclose()
    receiver = await hub.bind(address, Note)
    await sender.send(Note(0, 2))
    assert (await receiver.receive()).seq == 2
    await sender.aclose()
    await receiver.aclose()


async def test_undecodable_frame_is_counted_and_dropped(hub, make_address):
    address = make_address()
    receiver = await hub.bind(address, Note)
    sender = await hub.connect(address)
    await sender.send(Frames([b"\xc1"]))
    await sender.send(Frames([b"\x93\xa4Note\x01"]))  # truncated
    await sender.send(Frames([b"\x93\xa4Nope\x01\x02"]))  # unknown tag
    await sender.send(Note(0, 9))
    assert (await receiver.receive()).seq == 9
    assert dict(receiver.dropped.counts) == {"malformed": 1, "truncated": 1, "invalid": 1}
    await sender.aclose()
    await receiver.aclose()

"""The ZeroMQ receiver's hand-off: a receiving task reads the socket itself while the owner is idle.

These pin what the shortcut must keep: several tasks receiving at once,
cancelled receives, and the owner taking the socket back (so end-of-stream
acknowledgements still go out) once nobody is in ``receive``.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from transports import open_hub

from .conftest import Note, free_tcp_port


@pytest.fixture(params=["ipc", "tcp"])
def wire_address(request, tmp_path):
    if request.param == "ipc":
        return f"ipc://{tmp_path}/handoff.sock"
    return f"tcp://127.0.0.1:{free_tcp_port()}"


async def test_several_tasks_receiving_at_once_get_everything_once(wire_address):
    count = 2000
    async with open_hub() as hub:
        receiver = await hub.bind(wire_address, Note, capacity=8)
        sender = await hub.connect(wire_address, capacity=8)
        got: list[list[int]] = [[], [], []]
        all_in = trio.Event()

        async def consume(mine: list[int]) -> None:
            async for note in receiver:
                mine.append(note.seq)
                if sum(map(len, got)) == count:
                    all_in.set()
                if note.seq % 7 == 0:
                    await trio.lowlevel.checkpoint()  # let the owner and the others in

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for mine in got:
                    nursery.start_soon(consume, mine)
                for seq in range(count):
                    await sender.send(Note(0, seq))
                    if seq % 50 == 0:
                        await trio.testing.wait_all_tasks_blocked()  # the tasks wait on the socket
                await all_in.wait()
                nursery.cancel_scope.cancel()
            await sender.aclose()
        assert sorted(seq for mine in got for seq in mine) == list(range(count))
        for mine in got:  # each task takes one sender's messages in order
            assert mine == sorted(mine)
        await receiver.aclose()


async def test_end_of_stream_is_acknowledged_after_the_reader_walked_away(wire_address):
    async with open_hub() as hub:
        receiver = await hub.bind(wire_address, Note, senders=1)
        sender = await hub.connect(wire_address)
        with trio.fail_after(10):
            for seq in range(3):
                async with trio.open_nursery() as nursery:
                    # the receive waits on the socket itself before the message comes
                    nursery.start_soon(sender.send, Note(0, seq))
                    assert (await receiver.receive()).seq == seq
            # nobody is in receive now: the owner must take the end-of-stream
            await sender.aclose()
        with trio.fail_after(10):
            with pytest.raises(trio.EndOfChannel):
                await receiver.receive()
        await receiver.aclose()


async def test_a_cancelled_wait_on_the_socket_hands_it_back(wire_address):
    async with open_hub() as hub:
        receiver = await hub.bind(wire_address, Note)
        sender = await hub.connect(wire_address)
        with trio.fail_after(10):
            for seq in range(20):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(receiver.receive)  # nothing sent yet: it waits
                    await trio.testing.wait_all_tasks_blocked()
                    nursery.cancel_scope.cancel()
                await sender.send(Note(0, seq))
                assert (await receiver.receive()).seq == seq
            await sender.aclose()
        await receiver.aclose()

"""A million messages over ipc between two OS processes, both sides stalling at random.

Run as a module, this file is the child: it sends ``COUNT`` notes and closes
in order. The test is the parent: it receives, checks order, and stalls.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import trio

from transports import open_hub

from .conftest import Note

COUNT = 1_000_000
REPO = Path(__file__).resolve().parents[2]


async def send_all(address: str, count: int, seed: int) -> None:
    rng = random.Random(seed)
    async with open_hub() as hub:
        async with await hub.connect(address, capacity=256) as sender:
            for seq in range(count):
                await sender.send(Note(1, seq))
                if rng.random() < 1e-4:  # ~100 stalls of up to 20 ms
                    await trio.sleep(rng.random() * 0.02)


@pytest.mark.slow
async def test_a_million_messages_between_processes(tmp_path):
    address = f"ipc://{tmp_path}/stress.sock"
    rng = random.Random(11)
    async with open_hub() as hub:
        receiver = await hub.bind(address, Note, capacity=256, senders=1)
        child_argv = [sys.executable, "-m", "tests.transports.test_zmq_stress", address, str(COUNT)]
        with trio.fail_after(180):  # ~25 s on an idle 2-core machine; a hang fails
            async with trio.open_nursery() as nursery:
                child = await nursery.start(lambda task_status: trio.run_process(
                    child_argv, cwd=REPO, check=False, task_status=task_status))
                expected = 0
                async for note in receiver:
                    assert note.seq == expected
                    expected += 1
                    if rng.random() < 1e-4:
                        await trio.sleep(rng.random() * 0.02)
        assert expected == COUNT
        assert child.returncode == 0
        await receiver.aclose()


if __name__ == "__main__":
    trio.run(send_all, sys.argv[1], int(sys.argv[2]), 3)

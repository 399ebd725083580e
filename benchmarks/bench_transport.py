"""Transport throughput and round trip: tercet vs zmq.asyncio vs blocking pyzmq.

For each transport (inproc in one process; ipc and tcp between two
processes) and message size (100 B, 8 KiB): one-way messages per second
(N messages, then a flush the sink answers) and round-trip p50/p99 in µs
(ping, echo, one at a time).

- ``tercet``: this repo's transports; messages are msgspec structs, so the
  codec's cost is included.
- ``zmq_asyncio``: PUSH/PULL through ``zmq.asyncio`` under asyncio, raw bytes
  (what SGLang uses, minus its pickle).
- ``blocking``: PUSH/PULL with blocking pyzmq calls, raw bytes: the ceiling.
  Its inproc pair runs in two threads of one process.

    python benchmarks/bench_transport.py [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import trio
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transports import open_hub  # noqa: E402

IMPLS = ("tercet", "zmq_asyncio", "blocking")
TRANSPORTS = ("inproc", "ipc", "tcp")
SIZES = (100, 8192)
DATA, FLUSH, PING, STOP = 0, 1, 2, 3  # message kinds


class Msg(msgspec.Struct, tag=True, array_like=True, gc=False):
    kind: int
    body: bytes = b""


def raw(kind: int, size: int = 1) -> bytes:
    return bytes([kind]) + b"x" * (size - 1)


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples) * 1e6, samples[int(len(samples) * 0.99)] * 1e6


def plan(smoke: bool, size: int) -> tuple[int, int]:
    """(messages for throughput, pings for the round trip)."""
    if smoke:
        return 2000, 100
    return (200_000, 5000) if size <= 1024 else (40_000, 3000)


# ---- tercet (trio) ----------------------------------------------------------

async def tercet_sink(hub, data_address: str, back_address: str) -> None:
    receiver = await hub.bind(data_address, Msg, capacity=1024, senders=1)
    sender = await hub.connect(back_address)
    await sender.send(Msg(PING))  # ready
    async for msg in receiver:
        if msg.kind == FLUSH:
            await sender.send(Msg(FLUSH))
        elif msg.kind == PING:
            await sender.send(msg)
        elif msg.kind == STOP:
            break
    await sender.aclose()
    # Wait for the source's end-of-stream (it follows STOP): closing the
    # receiver before it arrives would leave the source's close waiting for an
    # acknowledgement forever.
    async for _ in receiver:
        pass
    await receiver.aclose()


async def tercet_source(hub, data_address: str, back_address: str, smoke: bool) -> list[dict]:
    back = await hub.bind(back_address, Msg, capacity=1024, senders=1)
    await back.receive()  # the sink is ready
    sender = await hub.connect(data_address)
    results = []
    for size in SIZES:
        count, pings = plan(smoke, size)
        data = Msg(DATA, b"x" * (size - 4))  # header + body ≈ size
        start = time.perf_counter()
        for _ in range(count):
            await sender.send(data)
        await sender.send(Msg(FLUSH))
        await back.receive()
        rate = count / (time.perf_counter() - start)
        ping, times = Msg(PING, data.body), []
        for _ in range(pings):
            start = time.perf_counter()
            await sender.send(ping)
            await back.receive()
            times.append(time.perf_counter() - start)
        results.append((size, rate, times))
    await sender.send(Msg(STOP))
    await sender.aclose()
    async for _ in back:  # until the sink's orderly close: it waits for our acknowledgement
        pass
    await back.aclose()
    return results


async def tercet_main(transport: str, data: str, back: str, smoke: bool, child: bool):
    async with open_hub() as hub:
        if child:
            return await tercet_sink(hub, data, back)
        if transport != "inproc":
            return await tercet_source(hub, data, back, smoke)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tercet_sink, hub, data, back)
            return await tercet_source(hub, data, back, smoke)


# ---- zmq.asyncio ------------------------------------------------------------

async def asyncio_sink(ctx, data_address: str, back_address: str) -> None:
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(data_address)
    push.connect(back_address)
    await push.send(raw(PING))
    while True:
        msg = await pull.recv()
        if msg[0] in (FLUSH, PING):
            await push.send(msg)
        elif msg[0] == STOP:
            break
    pull.close(linger=0)
    push.close(linger=1000)


async def asyncio_source(ctx, data_address: str, back_address: str, smoke: bool) -> list:
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(back_address)
    await pull.recv()
    push.connect(data_address)
    results = []
    for size in SIZES:
        count, pings = plan(smoke, size)
        data, ping = raw(DATA, size), raw(PING, size)
        start = time.perf_counter()
        for _ in range(count):
            await push.send(data)
        await push.send(raw(FLUSH))
        await pull.recv()
        rate = count / (time.perf_counter() - start)
        times = []
        for _ in range(pings):
            start = time.perf_counter()
            await push.send(ping)
            await pull.recv()
            times.append(time.perf_counter() - start)
        results.append((size, rate, times))
    await push.send(raw(STOP))
    push.close(linger=1000)
    pull.close(linger=0)
    return results


async def asyncio_main(transport: str, data: str, back: str, smoke: bool, child: bool):
    ctx = zmq.asyncio.Context()
    try:
        if child:
            return await asyncio_sink(ctx, data, back)
        if transport != "inproc":
            return await asyncio_source(ctx, data, back, smoke)
        sink = asyncio.ensure_future(asyncio_sink(ctx, data, back))
        await asyncio.sleep(0.01)  # inproc: bind before connect
        results = await asyncio_source(ctx, data, back, smoke)
        await sink
        return results
    finally:
        ctx.term()


# ---- blocking pyzmq ---------------------------------------------------------

def blocking_sink(ctx, data_address: str, back_address: str, bound: threading.Event) -> None:
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(data_address)
    bound.set()
    push.connect(back_address)
    push.send(raw(PING))
    while True:
        msg = pull.recv()
        if msg[0] in (FLUSH, PING):
            push.send(msg)
        elif msg[0] == STOP:
            break
    pull.close(linger=0)
    push.close(linger=1000)


def blocking_source(ctx, data_address: str, back_address: str, smoke: bool,
                    pull: zmq.Socket) -> list:
    pull.recv()
    push = ctx.socket(zmq.PUSH)
    push.connect(data_address)
    results = []
    for size in SIZES:
        count, pings = plan(smoke, size)
        data, ping = raw(DATA, size), raw(PING, size)
        start = time.perf_counter()
        for _ in range(count):
            push.send(data)
        push.send(raw(FLUSH))
        pull.recv()
        rate = count / (time.perf_counter() - start)
        times = []
        for _ in range(pings):
            start = time.perf_counter()
            push.send(ping)
            pull.recv()
            times.append(time.perf_counter() - start)
        results.append((size, rate, times))
    push.send(raw(STOP))
    push.close(linger=1000)
    pull.close(linger=0)
    return results


def blocking_main(transport: str, data: str, back: str, smoke: bool, child: bool):
    ctx = zmq.Context()
    try:
        if child:
            return blocking_sink(ctx, data, back, threading.Event())
        pull = ctx.socket(zmq.PULL)
        pull.bind(back)
        if transport != "inproc":
            return blocking_source(ctx, data, back, smoke, pull)
        bound = threading.Event()
        sink = threading.Thread(target=blocking_sink, args=(ctx, data, back, bound))
        sink.start()
        bound.wait()
        results = blocking_source(ctx, data, back, smoke, pull)
        sink.join()
        return results
    finally:
        ctx.term()


# ---- driver -----------------------------------------------------------------

def run_impl(impl: str, transport: str, data: str, back: str, smoke: bool, child: bool):
    if impl == "tercet":
        return trio.run(tercet_main, transport, data, back, smoke, child)
    if impl == "zmq_asyncio":
        return asyncio.run(asyncio_main(transport, data, back, smoke, child))
    return blocking_main(transport, data, back, smoke, child)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def addresses(transport: str, tmp: str, tag: str) -> tuple[str, str]:
    if transport == "inproc":
        prefix = "inproc://bench" if tag == "tercet" else "inproc://zbench"
        return f"{prefix}-data", f"{prefix}-back"
    if transport == "ipc":
        return f"ipc://{tmp}/{tag}-data.sock", f"ipc://{tmp}/{tag}-back.sock"
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def measure(impl: str, transport: str, smoke: bool, tmp: str) -> list[dict]:
    data, back = addresses(transport, tmp, impl)
    child = None
    if transport != "inproc":
        child = subprocess.Popen([sys.executable, __file__, "--child", impl, transport, data, back])
    try:
        results = run_impl(impl, transport, data, back, smoke, child=False)
    finally:
        if child is not None:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                raise
    rows = []
    for size, rate, times in results:
        p50, p99 = percentiles(times)
        rows.append({"impl": impl, "transport": transport, "size": size,
                     "msgs_per_s": round(rate), "rtt_p50_us": round(p50, 1),
                     "rtt_p99_us": round(p99, 1)})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'impl':<12} {'transport':<9} {'size':>6} {'msg/s':>10} {'rtt p50 µs':>11} {'p99 µs':>9}")
    for row in rows:
        print(f"{row['impl']:<12} {row['transport']:<9} {row['size']:>6} {row['msgs_per_s']:>10} "
              f"{row['rtt_p50_us']:>11} {row['rtt_p99_us']:>9}")
    print("\ntercet / zmq_asyncio")
    by_key = {(r["impl"], r["transport"], r["size"]): r for r in rows}
    for transport in TRANSPORTS:
        for size in SIZES:
            ours, theirs = by_key.get(("tercet", transport, size)), by_key.get(
                ("zmq_asyncio", transport, size))
            if ours and theirs:
                print(f"  {transport:<7} {size:>5} B: throughput x{ours['msgs_per_s'] / theirs['msgs_per_s']:.2f}, "
                      f"rtt p50 x{ours['rtt_p50_us'] / theirs['rtt_p50_us']:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds, tiny counts")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--impl", choices=IMPLS, action="append", help="only these (repeatable)")
    parser.add_argument("--transport", choices=TRANSPORTS, action="append")
    parser.add_argument("--child", nargs=4, metavar=("IMPL", "TRANSPORT", "DATA", "BACK"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        impl, transport, data, back = args.child
        run_impl(impl, transport, data, back, smoke=False, child=True)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as tmp:
        for transport in args.transport or TRANSPORTS:
            for impl in args.impl or IMPLS:
                rows.extend(measure(impl, transport, args.smoke, tmp))
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")
    main()

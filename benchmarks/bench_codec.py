"""msgspec (our Encoder/Decoder) vs pickle 5 on the messages the serving layer sends.

Each case times one encode + decode round trip of the same data both ways:

- msgspec: a tagged ``array_like=True, gc=False`` struct through
  ``transports.codec``; numpy arrays travel as separate frames (out of band).
- pickle: a plain ``@dataclass`` of the same shape (what SGLang's io_struct
  sends through ``send_pyobj``), ``pickle.dumps(protocol=5)`` / ``loads``,
  arrays in band. Pickle appears here only as the baseline: never on a wire.

Sizes are the bytes on the wire: all frames for msgspec, the pickle for pickle.
Timings are best-of-N of timeit loops, in µs per message.

    python -m benchmarks.bench_codec [--smoke] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import sys
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from transports.codec import Decoder, Encoder

# -- the messages, as the serving layer will send them ---------------------------


class SamplingParams(msgspec.Struct, array_like=True, gc=False):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = []


class Generate(msgspec.Struct, tag="generate", array_like=True, gc=False):
    """Tokenized request, ids as a list (one Python int each on decode)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = True


class PackedGenerate(msgspec.Struct, tag="packed_generate", array_like=True, gc=False):
    """Tokenized request, ids as one int32 buffer travelling out of band."""

    rid: str
    input_ids: np.ndarray
    sampling: SamplingParams
    stream: bool = True


class Abort(msgspec.Struct, tag="abort", array_like=True, gc=False):
    rid: str


ToScheduler = Generate | PackedGenerate | Abort


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    rid: str
    new_token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class BatchOutput(msgspec.Struct, tag="batch", array_like=True, gc=False):
    """One step's output as a list of per-request structs."""

    outputs: list[RequestOutput]


class ColumnBatchOutput(msgspec.Struct, tag="columns", array_like=True, gc=False):
    """The same as parallel lists, one entry per request."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finish_reasons: list[str | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]


class PackedBatchOutput(msgspec.Struct, tag="packed", array_like=True, gc=False):
    """Parallel columns with numbers packed: request i's new tokens are
    ``token_ids[offsets[i]:offsets[i + 1]]``; ``counts[i]`` is (prompt, completion);
    ``finished`` maps the few rids that ended this step to their reason."""

    rids: list[str]
    token_ids: np.ndarray  # int32, all new tokens of the step, request after request
    offsets: np.ndarray  # int32, len(rids) + 1
    counts: np.ndarray  # int32, shape (len(rids), 2)
    finished: dict[str, str]


class BytesBatchOutput(msgspec.Struct, tag="bytes", array_like=True, gc=False):
    """PackedBatchOutput with the small int32 columns as raw bytes inside the header:
    no out-of-band frame, no hook call; the receiver does ``np.frombuffer``."""

    rids: list[str]
    token_ids: bytes  # int32, native order
    offsets: bytes  # int32, len(rids) + 1
    counts: bytes  # int32, (prompt, completion) per request
    finished: dict[str, str]


FromScheduler = BatchOutput | ColumnBatchOutput | PackedBatchOutput | BytesBatchOutput


# -- the pickle baseline: the same shapes as dataclasses -----------------------------


@dataclass
class SamplingParamsDC:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] | None = None


@dataclass
class GenerateDC:
    rid: str
    input_ids: Any  # list[int] or np.ndarray
    sampling: SamplingParamsDC
    stream: bool = True


@dataclass
class AbortDC:
    rid: str


@dataclass
class RequestOutputDC:
    rid: str
    new_token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class BatchOutputDC:
    outputs: list[RequestOutputDC]


@dataclass
class ColumnBatchOutputDC:
    rids: list[str]
    new_token_ids: list[list[int]]
    finish_reasons: list[str | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]


@dataclass
class PackedBatchOutputDC:
    rids: list[str]
    token_ids: np.ndarray
    offsets: np.ndarray
    counts: np.ndarray
    finished: dict[str, str]


@dataclass
class BytesBatchOutputDC:
    rids: list[str]
    token_ids: bytes
    offsets: bytes
    counts: bytes
    finished: dict[str, str]


@dataclass
class Case:
    name: str
    msg: Any
    channel: Any  # the union type the receiving end decodes
    plain: Any  # the same data as dataclasses, for pickle


def make_cases(batch: int = 64, new_tokens: int = 4, prompt_len: int = 1000) -> list[Case]:
    rng = random.Random(0)
    rid = f"{rng.getrandbits(128):032x}"
    ids = [rng.randrange(49152) for _ in range(prompt_len)]
    stop = ["<|im_end|>"]
    sampling = SamplingParams(256, 0.7, 0.9, 40, stop)
    sampling_dc = SamplingParamsDC(256, 0.7, 0.9, 40, stop)
    packed_ids = np.array(ids, dtype=np.int32)

    rids = [f"{rng.getrandbits(128):032x}" for _ in range(batch)]
    tokens = [[rng.randrange(49152) for _ in range(new_tokens)] for _ in range(batch)]
    reasons = [("stop" if i % 16 == 3 else None) for i in range(batch)]  # a few end each step
    prompts = [rng.randrange(10, 2000) for _ in range(batch)]
    completions = [rng.randrange(1, 500) for _ in range(batch)]
    per_request = list(zip(rids, tokens, reasons, prompts, completions, strict=True))
    columns = (rids, tokens, reasons, prompts, completions)
    token_array = np.array(tokens, dtype=np.int32).reshape(-1)
    offsets = np.arange(0, batch * new_tokens + 1, new_tokens, dtype=np.int32)
    counts = np.array([prompts, completions], dtype=np.int32).T.copy()
    finished = {r: f for r, f in zip(rids, reasons, strict=True) if f is not None}
    packed = (rids, token_array, offsets, counts, finished)
    packed_bytes = (rids, token_array.tobytes(), offsets.tobytes(), counts.tobytes(), finished)

    return [
        Case(
            "generate, 1000 ids as list",
            Generate(rid, ids, sampling),
            ToScheduler,
            GenerateDC(rid, ids, sampling_dc),
        ),
        Case(
            "generate, 1000 ids packed int32",
            PackedGenerate(rid, packed_ids, sampling),
            ToScheduler,
            GenerateDC(rid, packed_ids, sampling_dc),
        ),
        Case(
            f"batch output {batch}x{new_tokens}, list of structs",
            BatchOutput([RequestOutput(*r) for r in per_request]),
            FromScheduler,
            BatchOutputDC([RequestOutputDC(*r) for r in per_request]),
        ),
        Case(
            f"batch output {batch}x{new_tokens}, parallel lists",
            ColumnBatchOutput(*columns),
            FromScheduler,
            ColumnBatchOutputDC(*columns),
        ),
        Case(
            f"batch output {batch}x{new_tokens}, packed arrays",
            PackedBatchOutput(*packed),
            FromScheduler,
            PackedBatchOutputDC(*packed),
        ),
        Case(
            f"batch output {batch}x{new_tokens}, packed bytes",
            BytesBatchOutput(*packed_bytes),
            FromScheduler,
            BytesBatchOutputDC(*packed_bytes),
        ),
        Case("abort", Abort(rid), ToScheduler, AbortDC(rid)),
    ]


# -- measuring -----------------------------------------------------------------------


def best_us(*fns: Callable[[], Any], repeat: int, min_time: float) -> list[float]:
    """Best-of-``repeat`` µs per call of each fn, each loop running at least
    ``min_time``. The fns' loops alternate, so a busy machine slows all alike."""
    timers, numbers = [timeit.Timer(fn) for fn in fns], []
    for timer in timers:
        number = 1
        while timer.timeit(number) < min_time:
            number *= 4
        numbers.append(number)
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, (timer, number) in enumerate(zip(timers, numbers, strict=True)):
            best[i] = min(best[i], timer.timeit(number) / number * 1e6)
    return best


def wire_bytes(frames: list[Any]) -> int:
    return sum(memoryview(frame).nbytes for frame in frames)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (msgspec.Struct, list, tuple, dict)) or hasattr(a, "__dataclass_fields__"):
        if type(a) is not type(b):
            return False
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(map(same, a, b))
        names = a.__struct_fields__ if isinstance(a, msgspec.Struct) else a.__dataclass_fields__
        return all(same(getattr(a, n), getattr(b, n)) for n in names)
    return a == b


def run_case(case: Case, *, repeat: int, min_time: float) -> dict[str, Any]:
    encoder, decoder = Encoder(), Decoder(case.channel)
    msg, plain = case.msg, case.plain
    frames = encoder.encode(msg)
    blob = pickle.dumps(plain, protocol=5)
    wire = [bytes(memoryview(f)) for f in frames]  # as a socket would deliver them
    assert same(decoder.decode(wire), msg), case.name
    assert same(pickle.loads(blob), plain), case.name

    def msgspec_round_trip():
        decoder.decode(encoder.encode(msg))

    def pickle_round_trip():
        pickle.loads(pickle.dumps(plain, protocol=5))

    msgspec_us, pickle_us = best_us(
        msgspec_round_trip, pickle_round_trip, repeat=repeat, min_time=min_time
    )
    return {
        "name": case.name,
        "msgspec_us": round(msgspec_us, 3),
        "pickle_us": round(pickle_us, 3),
        "speedup": round(pickle_us / msgspec_us, 2),
        "msgspec_bytes": wire_bytes(frames),
        "msgspec_frames": len(frames),
        "pickle_bytes": len(blob),
    }


def format_table(results: list[dict[str, Any]]) -> str:
    head = ("case", "msgspec µs", "pickle µs", "speedup", "msgspec B", "pickle B")
    rows = [
        (
            r["name"],
            f"{r['msgspec_us']:.2f}",
            f"{r['pickle_us']:.2f}",
            f"{r['speedup']:.1f}x",
            f"{r['msgspec_bytes']}",
            f"{r['pickle_bytes']}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]

    def line(row):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        return "  ".join(cells)

    return "\n".join([line(head), "  ".join("-" * w for w in widths), *map(line, rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a quick run (< 2 s) for the tests")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    repeat, min_time = (2, 0.002) if args.smoke else (15, 0.02)

    results = [run_case(c, repeat=repeat, min_time=min_time) for c in make_cases()]
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"smoke": args.smoke, "python": sys.version.split()[0],
                       "cases": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

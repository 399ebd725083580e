"""benchmarks/bench_serving.py: smoke sweep end to end, and failures counted."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import trio

from benchmarks import bench_serving as bench
from benchmarks._stub_openai import StubConfig, serve_stub

ROOT = pathlib.Path(__file__).resolve().parent.parent
STATS = {"mean", "std", "p50", "p99"}


def test_bench_serving_smoke(tmp_path):
    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_serving", "--smoke",
         "--json", str(out), "--plot", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stdout and "out tok/s" in proc.stdout  # the table header
    report = json.loads(out.read_text())
    assert report["args"]["smoke"] is True
    runs = report["runs"]
    assert [run["max_concurrency"] for run in runs] == [1, 4]
    for run in runs:
        assert run["failed"] == 0, run["errors"]
        assert run["completed"] == run["num_prompts"] > 0
        assert run["total_output_tokens"] == run["completed"] * report["args"]["output_len"]
        for key in ("request_throughput", "output_throughput", "total_token_throughput"):
            assert run[key] > 0, key
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert run[metric].keys() == STATS
            assert run[metric]["p99"] >= run[metric]["p50"] > 0, (metric, run[metric])
        assert run["e2e_ms"]["p50"] > run["ttft_ms"]["p50"]
    # beside its speed of light: the machine's figures and the tiny model's costs, measured before the sweep
    assert "GB/s" in proc.stdout and "bw bound" in proc.stdout and "% bound" in proc.stdout
    assert report["roofline"]["machine"]["bandwidth"] > 0 and report["roofline"]["costs"]["weight_bytes"] > 0
    assert report["roofline"]["costs"]["context_tokens"] == report["args"]["input_len"] + report["args"]["output_len"] // 2
    for run in runs:
        assert run["bounds"]["batch"] == run["max_concurrency"] and run["bounds"]["pct_of_bound"] > 0
    assert png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def run_against(nursery, stub: StubConfig, *extra: str) -> dict:
    url = await nursery.start(serve_stub, stub)
    args = bench.parse_args(["--base-url", url, "--input-len", "8", "--output-len", "8",
                             "--num-prompts", "12", "--warmup", "0", *extra])
    return (await bench.benchmark(args))["runs"][0]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_failures_are_counted(nursery, endpoint):
    # Every 2nd request the stub sees fails, in turn by HTTP 500, an error
    # event first, and an error event mid-stream. Completions: the token-id
    # probe is request 1, so 2..13 are measured; chat has no probe: 1..12.
    run = await run_against(nursery, StubConfig(fail_every=2),
                            "--max-concurrency", "3", "--endpoint", endpoint)
    assert run["failed"] == 6 and run["completed"] == run["num_prompts"] - 6
    assert any(e.startswith("HTTP 500") for e in run["errors"])
    assert any(e.startswith("error event") for e in run["errors"])
    assert sum(run["errors"].values()) == 6
    assert run["total_output_tokens"] == 8 * run["completed"]  # half-streams are not counted
    assert run["ttft_ms"]["p50"] > 0


async def test_all_failed_still_reports(nursery):
    run = await run_against(nursery, StubConfig(fail_every=1), "--model", "stub-model")
    assert run["completed"] == 0 and run["failed"] == 12
    assert run["ttft_ms"] == {"mean": None, "std": None, "p50": None, "p99": None}
    assert run["output_throughput"] == 0


async def test_refused_connection_is_a_failure():
    with trio.socket.socket() as probe:  # a port nothing listens on
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = bench.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                             "--num-prompts", "3", "--warmup", "0", "--output-len", "4"])
    run = (await bench.benchmark(args))["runs"][0]
    assert run["failed"] == 3 and run["completed"] == 0


async def test_several_tokens_per_chunk(nursery):
    # Chunks carry 4 tokens and usage: counts come from completion_tokens deltas.
    run = await run_against(nursery, StubConfig(tokens_per_chunk=4, token_s=0.004),
                            "--output-len", "16", "--max-concurrency", "2")
    assert run["failed"] == 0
    assert run["total_output_tokens"] == 16 * 12
    # SGLang's ITL: a chunk's gap shared by its 4 tokens (the first chunk's have TTFT), so
    # ITL is a quarter of the chunk gap, and they sum to the same time as TPOT's 15 gaps.
    assert run["tokens_per_chunk"] == 4
    assert run["itl_ms"]["p50"] == pytest.approx(run["chunk_gap_ms"]["p50"] / 4, rel=1e-6)
    assert run["itl_ms"]["mean"] == pytest.approx(run["chunk_gap_ms"]["mean"] / 4, rel=1e-6)
    assert run["itl_ms"]["mean"] * 12 == pytest.approx(run["tpot_ms"]["mean"] * 15, rel=1e-6)
    assert run["chunk_gap_ms"]["p50"] >= 0.004 * 4 * 1e3 * 0.9  # the stub waits token_s a token


async def test_usage_in_the_last_token_chunk_adds_no_tokens(nursery):
    # llama-server: a token a chunk, then an empty chunk with finish_reason and the whole usage. Those
    # tokens were counted as they came: the last chunk adds none (it once counted them all again, as
    # one gap and 7 zeros, and ITL p50 read 0).
    run = await run_against(nursery, StubConfig(usage_in_last_chunk=True, token_s=0.004), "--max-concurrency", "2")
    assert run["failed"] == 0 and run["total_output_tokens"] == 8 * 12
    assert run["tokens_per_chunk"] == 1
    assert run["itl_ms"]["p50"] == run["chunk_gap_ms"]["p50"] >= 0.004 * 1e3 * 0.9


async def test_poisson_rate_spreads_arrivals(nursery):
    run = await run_against(nursery, StubConfig(), "--request-rate", "200", "--seed", "3")
    assert run["failed"] == 0 and run["request_rate"] == 200.0


def test_response_reader_chunked_and_sized():
    class FakeStream:  # what trio.SocketStream offers the reader
        def __init__(self, pieces):
            self.pieces = list(pieces)

        async def receive_some(self, max_bytes):
            await trio.lowlevel.checkpoint()
            return self.pieces.pop(0) if self.pieces else b""

    async def read(head: bytes, pieces) -> tuple[bytes, str]:
        response = bench.Response(FakeStream(pieces), head)
        return await response.read_all(), response.state

    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel"
    body, state = trio.run(read, chunked, [b"lo\r\n", b"6;x=1\r\n world\r", b"\n0\r\n\r\n"])
    assert (body, state) == (b"hello world", "done")
    sized = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nab"
    assert trio.run(read, sized, [b"cd"]) == (b"abcd", "done")
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nxy"
    assert trio.run(read, closing, [b"z"]) == (b"xyz", "done")
    with pytest.raises(bench.HTTPProtocolError):
        trio.run(read, chunked, [b"lo\r\n"])  # cut inside the body


def test_the_shared_prefix_workload_and_its_cache_hit_rate():
    import numpy as np

    args = bench.parse_args(["--base-url", "http://x", "--input-len", "40", "--system-prompts", "3",
                             "--system-len", "32"])
    prompts = bench.make_prompts(np.random.default_rng(0), 60, args, text=False)
    assert {len(p) for p in prompts} == {40}
    assert len({tuple(p[:32]) for p in prompts}) == 3 and len({tuple(p[32:]) for p in prompts}) == 60
    again = bench.make_prompts(np.random.default_rng(1), 60, args, text=False)  # another run: the same systems
    assert {tuple(p[:32]) for p in again} == {tuple(p[:32]) for p in prompts}
    texts = bench.make_prompts(np.random.default_rng(0), 4, args, text=True)
    assert all(len(t.split()) == 40 for t in texts)
    results = [bench.Result(ok=True, prompt_tokens=40, cached_tokens=c, output_tokens=1) for c in (0, 32, 32, 16)]
    assert bench.summarize(results, 1.0, 0.1, 1, float("inf"))["cache_hit_rate"] == 80 / 160
    assert bench.summarize([bench.Result(ok=True, prompt_tokens=4, output_tokens=1)], 1.0, 0.1, 1,
                           float("inf"))["cache_hit_rate"] is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--base-url", "http://x", "--input-len", "8", "--system-prompts", "2", "--system-len", "8"])


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_the_lookup_workload_sends_prompts_that_hold_their_answer(nursery, endpoint):
    """--workload lookup (where n-gram speculative decoding pays): text prompts asking to repeat a
    passage of about --input-len tokens, shuffled per prompt."""
    args = bench.parse_args(["--base-url", "http://x", "--workload", "lookup", "--input-len", "64",
                             "--endpoint", endpoint])
    prompts = bench.make_prompts(np.random.default_rng(0), 3, args, text=False)
    assert len(set(prompts)) == 3 and all(isinstance(p, str) and "word for word" in p for p in prompts)
    assert all(sum(piece in p for piece in bench.PASSAGE_PIECES) == 4 for p in prompts)  # 64 / 16
    run = await run_against(nursery, StubConfig(), "--workload", "lookup", "--endpoint", endpoint)
    assert run["failed"] == 0 and run["completed"] == 12

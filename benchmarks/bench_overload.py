"""Health under overload: /health and /metrics while N streams arrive at once.

Starts ``tercet serve`` (the default topology) as a subprocess, probes
``/health`` and ``/metrics`` every 50 ms while the server is idle (the
baseline), then opens N streaming ``/generate`` requests at once (more than
the server admits: those past ``max_running + max_queued`` must get a fast
503 with Retry-After) and keeps probing until every stream has ended.

    python -m benchmarks.bench_overload [--model PATH] [--streams 600] \\
        [--output-len 32] [--max-queued 128] [--json out.json]
    python -m benchmarks.bench_overload --smoke   # tiny model, 120 streams

Figures: probe latency p50 / p99 / max idle and under load (the ratio of
the p99s is the comparison in the same run), streams completed (200 with
``[DONE]``), refused (503), dropped connections, and other failures. The
target: /health and /metrics p99 under load <= 100 ms, no dropped
connection, no failure other than a 503.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
TARGET_P99_S = 0.100


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values) or [float("nan")]
    return {"p50": ordered[len(ordered) // 2], "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
            "max": ordered[-1], "count": len(values)}


async def probe(client: httpx.AsyncClient, path: str, until: trio.Event, out: list[float], bad: list[str]) -> None:
    while not until.is_set():
        start = time.perf_counter()
        try:
            r = await client.get(path)
            if r.status_code != 200:
                bad.append(f"{path} {r.status_code}")
        except httpx.HTTPError as exc:
            bad.append(f"{path} {exc!r}")
        out.append(time.perf_counter() - start)
        await trio.sleep(0.05)


async def benchmark(args: argparse.Namespace) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "serving.cli", "serve", "--port", str(port), "--log-level", "warning",
               "--max-queued-requests", str(args.max_queued), "--dtype", args.dtype]
    if args.model:
        command += ["--model", args.model]
    server = await trio.lowlevel.open_process(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    report: dict = {"streams": args.streams, "output_len": args.output_len, "max_queued": args.max_queued,
                    "model": args.model or "SmolLM2-135M-Instruct", "dtype": args.dtype}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as health:
            with trio.fail_after(600):
                while True:
                    try:
                        if (await health.get("/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await trio.sleep(0.2)
            for phase in ("idle", "load"):
                latencies: dict[str, list[float]] = {"/health": [], "/metrics": []}
                bad: list[str] = []
                done = trio.Event()
                outcomes: dict[str, int] = {}
                async with trio.open_nursery() as nursery:
                    for path in latencies:
                        nursery.start_soon(probe, health, path, done, latencies[path], bad)
                    if phase == "idle":
                        await trio.sleep(args.idle_s)
                    else:
                        await run_streams(url, args, outcomes)
                    done.set()
                report[phase] = {path: percentiles(values) for path, values in latencies.items()}
                report[phase]["probe_failures"] = bad
                if phase == "load":
                    report["outcomes"] = outcomes
    finally:
        server.terminate()
        with trio.move_on_after(30):
            await server.wait()
        if server.returncode is None:
            server.kill()
            await server.wait()
    load, idle = report["load"], report["idle"]
    report["p99_ratio_load_over_idle"] = {path: load[path]["p99"] / max(idle[path]["p99"], 1e-6)
                                          for path in ("/health", "/metrics")}
    outcomes = report["outcomes"]
    report["dropped"] = outcomes.get("dropped", 0)
    report["target_met"] = (all(load[path]["p99"] <= TARGET_P99_S for path in ("/health", "/metrics"))
                            and not load["probe_failures"] and report["dropped"] == 0
                            and set(outcomes) <= {"completed", "refused 503"})
    return report


async def run_streams(url: str, args: argparse.Namespace, outcomes: dict[str, int]) -> None:
    limits = httpx.Limits(max_connections=args.streams + 10, max_keepalive_connections=args.streams + 10)

    def count(kind: str) -> None:
        outcomes[kind] = outcomes.get(kind, 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(i: int) -> None:
            body = {"text": f"Request {i}: tell me a story.", "stream": True,
                    "sampling_params": {"max_new_tokens": args.output_len, "ignore_eos": True}}
            try:
                async with client.stream("POST", "/generate", json=body) as r:
                    text = b"".join([part async for part in r.aiter_bytes()])
                if r.status_code == 503 and r.headers.get("retry-after"):
                    count("refused 503")
                elif r.status_code == 200 and text.endswith(b"data: [DONE]\n\n") and b'"error"' not in text:
                    count("completed")
                else:
                    count(f"failed {r.status_code}")
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
                count("dropped")

        async with trio.open_nursery() as nursery:
            for i in range(args.streams):
                nursery.start_soon(one, i)


def table(report: dict) -> str:
    rows = ["| probe | idle p50 / p99 / max ms | under load p50 / p99 / max ms | p99 ratio |", "|---|---|---|---|"]
    for path in ("/health", "/metrics"):
        i, lo = report["idle"][path], report["load"][path]
        rows.append(f"| {path} | {i['p50'] * 1e3:.1f} / {i['p99'] * 1e3:.1f} / {i['max'] * 1e3:.1f} | "
                    f"{lo['p50'] * 1e3:.1f} / {lo['p99'] * 1e3:.1f} / {lo['max'] * 1e3:.1f} | "
                    f"{report['p99_ratio_load_over_idle'][path]:.2f} |")
    rows.append("")
    rows.append(f"{report['streams']} streams at once ({report['model']}, {report['dtype']}, max_queued "
                f"{report['max_queued']}): {report['outcomes']}; probe failures: {report['load']['probe_failures']}")
    rows.append(f"target (p99 <= {TARGET_P99_S * 1e3:.0f} ms, nothing dropped, only 503 refusals): "
                f"{'met' if report['target_met'] else 'NOT met'}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model path (default: the embedded SmolLM2); tiny: a tiny random model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=600)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-queued", type=int, default=128)
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--json", help="write the report here")
    p.add_argument("--smoke", action="store_true", help="tiny model, 120 streams of 8 tokens (the tests run this)")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.dtype, args.streams, args.output_len, args.max_queued, args.idle_s = \
            "tiny", "float32", 120, 8, 32, 1.0
    report = trio.run(benchmark, args)
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

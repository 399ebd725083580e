"""Crash recovery under load: kill -9 the scheduler while N requests stream.

Starts ``tercet serve`` (the default topology: scheduler and detokenizer in
child processes over ipc) as a subprocess, runs N streaming ``/generate``
requests (random token-id prompts, greedy, EOS ignored) once without faults
as the baseline, flushes the prefix cache, runs the same requests again and
kill -9s the scheduler (pid from ``/server_info``) K times, at 1/(K+1),
2/(K+1), ... of all output tokens received.

    python -m benchmarks.bench_recovery [--model PATH] [--requests 16] \\
        [--output-len 256] [--kills 1] [--json out.json]
    python -m benchmarks.bench_recovery --smoke   # tiny model, float32
    python -m benchmarks.bench_recovery --dtype bfloat16 --deterministic both   # identity, mode off and on (on: the default)
    python -m benchmarks.bench_recovery --standby both --rounds 2   # restarts without and with a spare, alternated

Figures (times are this process's ``perf_counter``):

- model_load_s: a scheduler process alone, spawn -> ready (interpreter,
  imports, weights, KV cache), started with ``ProcessChild`` exactly as the
  supervisor starts one, before the server runs. The target is
  ``recovery_s <= model_load_s + 1``.
- recovery_s: per kill, the kill -> the first token of any request that
  arrives after /health first answered non-200 (a 5 ms poll from the kill
  on). Tokens the old scheduler had sent before it died can still arrive
  after the kill; they arrive before the server sees the crash, and are
  counted as ``tail_tokens``, not as recovery. Worst kill reported.
- restart_s: the server's own figure, crash -> restarted scheduler ready
  (mean of ``tercet_recovery_seconds``): what recovery costs server-side.
- resume_overhead_s: recovery_s - restart_s, what resuming adds once the
  new scheduler is ready (resubmit, prefill of prompt + output so far,
  detokenize, deliver).
- standby: whether the server kept a spare scheduler process
  (``supervision.standby``, the default: a restart runs in it, torch and
  transformers already imported). ``--standby both`` runs without and with,
  alternated ``--rounds`` times, and prints recovery_s with over without.
  A spare imports at the lowest CPU priority, in the time the server leaves
  idle, and is used only once it has (else the restart starts a fresh
  process): ``--idle S`` leaves the server S seconds idle between the
  fault-free run and the run with kills (default 0: busy from its start).
- max_gap_s: the longest time between two token-carrying events of one
  request, over all requests (time to first token not included).
- completed / failed: a request completes with HTTP 200, no error event,
  ``[DONE]`` and exactly output-len tokens.
- identical_to_fault_free: every request's final text and token ids equal
  the baseline's (exact only in float32; bf16 batches can round apart).

``--replicas N`` (N > 1, the replica-kill mode): N data-parallel replicas
routed round robin, and each kill is of replica 1's scheduler. /health
stays 200 throughout (the others serve), so instead of recovery_s:

- migration_s: per kill, the kill -> the first token after it of the stream
  that waited longest for one: the requests of the dead replica, resumed
  on another (the others' next tokens come a step after the kill). Worst
  kill reported; the target is migration_s < restart_s (no request waits
  for the dead replica to come back).
- migrated: requests resumed on another replica (the server's figure).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import trio
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_serving import HTTPProtocolError, RawHTTP  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = (3, 49152)  # SmolLM2's tokenizer (the tiny model shares it)


@dataclass
class Stream:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # one per event that carried tokens
    done: bool = False
    error: str = ""


class Progress:
    """Tokens received by all streams; ``wait_for(n)`` returns once n arrived."""

    def __init__(self) -> None:
        self.tokens = 0
        self.arrivals: list[float] = []  # every token-carrying event, all requests
        self._waiters: list[tuple[int, trio.Event]] = []

    def add(self, n: int, now: float) -> None:
        self.tokens += n
        self.arrivals.append(now)
        for waiter in [w for w in self._waiters if w[0] <= self.tokens]:
            waiter[1].set()
            self._waiters.remove(waiter)

    async def wait_for(self, n: int) -> None:
        if self.tokens < n:
            event = trio.Event()
            self._waiters.append((n, event))
            await event.wait()


def make_bodies(n: int, output_len: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(*VOCAB) for _ in range(rng.randint(8, 64))], "stream": True,
             "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}}
            for _ in range(n)]


async def stream_one(client: RawHTTP, body: dict, out: Stream, progress: Progress) -> None:
    response = None
    try:
        response = await client.request("POST", "/generate", msgspec.json.encode(body))
        if response.status != 200:
            out.error = f"HTTP {response.status}: {(await response.read_all())[:120]!r}"
            return
        buffer = b""
        while data := await response.read_some():
            now = time.perf_counter()
            *events, buffer = (buffer + data).split(b"\n\n")
            for event in events:
                payload = event.removeprefix(b"data: ").strip()
                if payload == b"[DONE]":
                    out.done = True
                    continue
                message = msgspec.json.decode(payload)
                if "error" in message:
                    out.error = f"error event: {str(message['error'])[:120]}"
                    return
                if not message["text"].startswith(out.text):
                    out.error = "the streamed text went back on itself"
                    return
                new = len(message["output_ids"]) - len(out.ids)
                out.text, out.ids = message["text"], message["output_ids"]
                if new > 0:
                    out.arrivals.append(now)
                    progress.add(new, now)
    except (OSError, trio.BrokenResourceError, HTTPProtocolError, msgspec.DecodeError, KeyError) as exc:
        out.error = f"{type(exc).__name__}: {str(exc)[:120]}"
    finally:
        if response is not None:
            await client.release(response)


async def run_streams(base_url: str, bodies: list[dict], progress: Progress,
                      task_status=trio.TASK_STATUS_IGNORED) -> list[Stream]:
    client = RawHTTP(base_url)
    streams = [Stream() for _ in bodies]
    task_status.started(streams)
    async with trio.open_nursery() as nursery:
        for body, out in zip(bodies, streams):
            nursery.start_soon(stream_one, client, body, out, progress)
    await client.aclose()
    return streams


async def status_of(client: RawHTTP, path: str) -> tuple[int, bytes]:
    response = await client.request("GET", path)
    try:
        return response.status, await response.read_all()
    finally:
        await client.release(response)


async def kill_and_watch(url: str, pid: int, timeout: float) -> dict:
    """kill -9 ``pid``; note when /health first answers non-200, then 200 again.

    A /health that reaches the server before it has seen the crash waits for
    the dead scheduler's answer (5 s), so a fresh probe starts every 50 ms."""
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    times: dict[str, float] = {}
    down = trio.Event()

    async def probe() -> None:
        client = RawHTTP(url)
        try:
            status, _ = await status_of(client, "/health")
        finally:
            await client.aclose()
        if status != 200 and not down.is_set():
            times["down"] = time.perf_counter()
            down.set()

    with trio.fail_after(timeout):
        async with trio.open_nursery() as nursery:
            while not down.is_set():
                nursery.start_soon(probe)
                with trio.move_on_after(0.05):
                    await down.wait()
            nursery.cancel_scope.cancel()
        control = RawHTTP(url)
        while (await status_of(control, "/health"))[0] != 200:
            await trio.sleep(0.005)
        times["up"] = time.perf_counter()
        await control.aclose()
    return {"pid": pid, "killed": killed, **times}


async def time_scheduler_start(topology) -> float:
    """A scheduler process alone, spawn -> ready: what a restart must at least pay."""
    from actors.process import ProcessChild
    from serving.runtime.specs import scheduler_config

    with tempfile.TemporaryDirectory(prefix="tercet-load-") as tmp:
        config = scheduler_config(topology, f"ipc://{tmp}/detokenizer")
        child = ProcessChild("serving.managers.scheduler:scheduler_child",
                             {"address": f"ipc://{tmp}/scheduler", "config": msgspec.to_builtins(config)},
                             name="scheduler")
        async with trio.open_nursery() as nursery:
            start = time.perf_counter()
            await nursery.start(child.run)
            elapsed = time.perf_counter() - start
            await child.stop()
    return elapsed


def write_config(args, tmp: Path) -> Path:
    data = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    data["model"].update(path=args.model, dtype=args.dtype or data["model"]["dtype"])
    data["server"]["port"] = args.port
    data["supervision"]["max_restarts"] = max(data["supervision"]["max_restarts"], args.kills + 1)
    data["supervision"]["quarantine_after"] = args.kills + 1  # kills from outside are no poison
    data["scheduler"]["enable_deterministic_inference"] = args.deterministic_now
    data["supervision"]["standby"] = args.standby_now
    # one token a step: a kill must land while the scheduler still has work (with n-gram drafts a tiny
    # model's streams can finish before the client has read half of them: nothing left to resume)
    data["scheduler"]["speculative"] = "none"
    if args.replicas > 1:
        data["scheduler"]["replicas"] = args.replicas
        data["router"] = {"policy": "round_robin"}  # the killed replica holds its share
    path = tmp / "bench-recovery.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def benchmark(args) -> dict:
    from serving.runtime.topology import load_topology

    with tempfile.TemporaryDirectory(prefix="tercet-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        config = write_config(args, tmp)
        topology = load_topology(config)
        report = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "dtype": topology.model.dtype,
                  "requests": args.requests, "output_len": args.output_len, "kills": args.kills,
                  "deterministic": args.deterministic_now, "standby": args.standby_now, "idle_s": args.idle,
                  "replicas": args.replicas}
        # (the replica-kill mode's target is the restart it need not wait for, not the model load)
        report["model_load_s"] = await time_scheduler_start(topology) if args.replicas == 1 else None
        log = (tmp / "server.log").open("wb")
        started = time.perf_counter()
        server = await trio.lowlevel.open_process(
            [sys.executable, "-m", "serving.cli", "serve", "--config", str(config), "--log-level", "warning"],
            cwd=ROOT, stdout=log, stderr=log)
        url = f"http://127.0.0.1:{args.port}"
        control = RawHTTP(url)
        try:
            with trio.fail_after(args.timeout):
                while True:
                    try:
                        if (await status_of(control, "/health"))[0] == 200:
                            break
                    except (OSError, HTTPProtocolError):
                        pass
                    if server.returncode is not None:
                        raise RuntimeError(f"the server exited with status {server.returncode}")
                    await trio.sleep(0.05)
            report["server_start_s"] = time.perf_counter() - started
            with trio.fail_after(args.timeout):
                report.update(await kill_phase(args, url, control))
        except BaseException:
            log.flush()
            print((tmp / "server.log").read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            await control.aclose()
            server.send_signal(signal.SIGINT)
            with trio.move_on_after(30):
                await server.wait()
            if server.returncode is None:
                server.kill()
                await server.wait()
            log.close()
    return report


async def kill_phase(args, url: str, control: RawHTTP) -> dict:
    bodies = make_bodies(args.requests, args.output_len, args.seed)
    baseline = await run_streams(url, bodies, Progress())
    if (status := (await status_of(control, "/flush_cache"))[0]) != 200:
        raise RuntimeError(f"/flush_cache answered {status}")
    await trio.sleep(args.idle)  # (the server idles: what a spare process needs to get warm)
    progress = Progress()
    total = args.requests * args.output_len
    kills = []
    victim = "scheduler" if args.replicas == 1 else "scheduler-1"
    async with trio.open_nursery() as nursery:
        streams = await nursery.start(run_streams, url, bodies, progress)
        for k in range(args.kills):
            info = msgspec.json.decode((await status_of(control, "/server_info"))[1])
            while victim not in info["pids"]:  # a replica killed before: back in the pool first
                await trio.sleep(0.05)
                info = msgspec.json.decode((await status_of(control, "/server_info"))[1])
            await progress.wait_for(total * (k + 1) // (args.kills + 1))
            if args.replicas == 1:
                kills.append(await kill_and_watch(url, info["pids"][victim], args.timeout))
            else:
                kills.append({"pid": info["pids"][victim], "killed": time.perf_counter()})
                os.kill(kills[-1]["pid"], signal.SIGKILL)
    while args.replicas > 1 and victim not in msgspec.json.decode((await status_of(control, "/server_info"))[1])[
            "pids"]:  # back in the pool: its restart time is known
        await trio.sleep(0.05)
    metrics = (await status_of(control, "/metrics"))[1].decode()
    info = msgspec.json.decode((await status_of(control, "/server_info"))[1])

    for kill in kills:
        if args.replicas == 1:
            after = [t for t in progress.arrivals if t > kill["down"]]
            kill["recovery_s"] = after[0] - kill["killed"] if after else None
            kill["tail_tokens"] = sum(kill["killed"] < t <= kill["down"] for t in progress.arrivals)
            kill["down_s"], kill["up_s"] = kill["down"] - kill["killed"], kill["up"] - kill["killed"]
        else:
            firsts = [next((t for t in s.arrivals if t > kill["killed"]), None) for s in streams]
            waited = [t - kill["killed"] for t in firsts if t is not None]
            kill["migration_s"] = max(waited) if waited else None
    ok = [s for s in streams if s.done and not s.error and len(s.ids) == args.output_len]
    gaps = [b - a for s in streams for a, b in zip(s.arrivals, s.arrivals[1:])]
    same = sum((s.text, s.ids) == (b.text, b.ids) for s, b in zip(streams, baseline))
    restart = {kind: float(value) for kind, value in
               re.findall(r"^tercet_recovery_seconds_(sum|count) (\S+)$", metrics, re.M)}
    timed = [k.get("recovery_s" if args.replicas == 1 else "migration_s") for k in kills]
    worst = None if None in timed or not kills else max(timed)
    return {
        "recovery_s": worst if args.replicas == 1 else None,
        "migration_s": worst if args.replicas > 1 else None,
        "migrated": info.get("migrated", 0),
        "max_gap_s": max(gaps, default=0.0),
        "completed": len(ok), "failed": len(streams) - len(ok),
        "errors": sorted({s.error for s in streams if s.error}),
        "identical_to_fault_free": same == len(streams), "identical_count": same,
        "baseline_failed": sum(not s.done or bool(s.error) for s in baseline),
        "restart_s": restart["sum"] / restart["count"] if restart.get("count") else None,
        "restarts": info["restarts"].get(victim, 0),
        "per_kill": [{k: v for k, v in kill.items() if k not in ("killed", "down", "up")} for kill in kills],
    }


def judge(report: dict) -> dict:
    recovery, load = report["recovery_s"], report["model_load_s"]
    restart = report["restart_s"]
    if report["replicas"] > 1:
        migration = report["migration_s"]
        return {"migration_over_restart": None if None in (migration, restart) else migration / restart,
                "target_met": migration is not None and report["failed"] == 0
                and (restart is None or migration < restart)}
    return {"recovery_over_load": None if recovery is None else recovery / load,
            "resume_overhead_s": None if None in (recovery, restart) else recovery - restart,
            "target_met": recovery is not None and recovery <= load + 1.0 and report["failed"] == 0}


def print_table(r: dict) -> None:
    def s(value, unit=" s"):
        return "-" if value is None else f"{value:.3f}{unit}"

    print(f"model {r['model']} ({r['dtype']}{', deterministic inference' if r['deterministic'] else ''}"
          f"{', a spare scheduler process' if r['standby'] else ', no spare process'}"
          f"{', idle %g s before the kills' % r['idle_s'] if r.get('idle_s') else ''}), "
          f"{r['requests']} streaming requests x {r['output_len']} tokens, {r['kills']} kill(s) -9 of "
          + ("the scheduler" if r["replicas"] == 1 else f"replica 1's scheduler of {r['replicas']} replicas"))
    if r["replicas"] > 1:
        for i, k in enumerate(r["per_kill"], 1):
            print(f"  kill {i} (pid {k['pid']}): kill -> the last stream's first token after it "
                  f"{s(k['migration_s'])}")
        rows = [
            ("server restart (crash -> scheduler ready, mean)", s(r["restart_s"])),
            ("migration (kill -> first token of a moved request)", s(r["migration_s"])),
            ("target migration < restart, failed = 0", "met" if r["target_met"] else "MISSED"),
            ("requests migrated", str(r["migrated"])),
        ]
    else:
        print(f"{'kill':>4} {'pid':>8} {'-> /health down':>16} {'-> /health 200':>15} {'-> first token':>15} "
              f"{'tail tokens':>11}")
        for i, k in enumerate(r["per_kill"], 1):
            print(f"{i:>4} {k['pid']:>8} {s(k['down_s']):>16} {s(k['up_s']):>15} {s(k['recovery_s']):>15} "
                  f"{k['tail_tokens']:>11}")
        rows = [
            ("model load (a scheduler process, spawn -> ready)", s(r["model_load_s"])),
            ("recovery (kill -> first resumed token, worst)", s(r["recovery_s"])),
            ("recovery - server restart (resume overhead)", s(r["resume_overhead_s"])),
            ("recovery / model load", s(r["recovery_over_load"], "")),
            ("target recovery <= load + 1 s, failed = 0", "met" if r["target_met"] else "MISSED"),
            ("server restart (crash -> scheduler ready, mean)", s(r["restart_s"])),
        ]
    rows += [
        ("server cold start (spawn -> /health 200)", s(r["server_start_s"])),
        ("longest client-visible gap", s(r["max_gap_s"])),
        ("completed / failed", f"{r['completed']} / {r['failed']}"),
        ("identical to the fault-free run", f"{r['identical_count']}/{r['requests']}"
                                            f" ({'yes' if r['identical_to_fault_free'] else 'NO'})"),
    ]
    for name, value in rows:
        print(f"  {name:<50} {value:>12}")
    for error in r["errors"]:
        print(f"  error: {error}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model path; default the embedded SmolLM2, 'tiny' for a tiny random model")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: the topology's")
    p.add_argument("--requests", type=int, help="concurrent streaming requests (default 16)")
    p.add_argument("--output-len", type=int, help="tokens per request (default 256)")
    p.add_argument("--kills", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, help="default: a free one")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds for the server start, and again for all the requests")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--deterministic", choices=["off", "on", "both"], default="on",
                   help="the server's deterministic inference (on by default; off: "
                        "--disable-deterministic-inference); both: one run each, identity compared")
    p.add_argument("--standby", choices=["off", "on", "both"], default="on",
                   help="supervision.standby: a spare scheduler process for restarts (on: the default); both: "
                        "a run without and one with, alternated --rounds times")
    p.add_argument("--rounds", type=int, default=1, help="with --standby both: off/on pairs (default 1)")
    p.add_argument("--idle", type=float, default=0.0,
                   help="seconds the server idles between the fault-free run and the run with kills")
    p.add_argument("--replicas", type=int, default=1,
                   help="N > 1: data-parallel replicas, and each kill is of replica 1 (the replica-kill mode)")
    p.add_argument("--smoke", action="store_true", help="tiny model in float32, 4 requests x 128 tokens")
    args = p.parse_args(argv)
    if args.standby == "both" and args.deterministic == "both":
        p.error("--standby both and --deterministic both: pick one to compare")
    if args.smoke:
        args.model, args.dtype = args.model or "tiny", args.dtype or "float32"
    args.requests = args.requests or (4 if args.smoke else 16)
    args.output_len = args.output_len or (128 if args.smoke else 256)
    if args.port is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            args.port = probe.getsockname()[1]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = [(d, args.standby) for d in (["off", "on"] if args.deterministic == "both" else [args.deterministic])]
    if args.standby == "both":
        runs = [(args.deterministic, s) for _ in range(args.rounds) for s in ("off", "on")]
    reports = {}
    for i, (deterministic, standby) in enumerate(runs):
        args.deterministic_now, args.standby_now = deterministic == "on", standby == "on"
        key = (f"standby {standby}" + (f" {i // 2 + 1}" if args.rounds > 1 else "") if args.standby == "both"
               else deterministic)
        report = reports[key] = trio.run(benchmark, args)
        report.update(judge(report))
        print_table(report)
    if args.deterministic == "both":
        print("identical to the fault-free run: " + ", ".join(
            f"deterministic {mode} {r['identical_count']}/{r['requests']}" for mode, r in reports.items()))
    if args.standby == "both":
        pairs = list(zip(list(reports.values())[::2], list(reports.values())[1::2]))
        for n, (off, on) in enumerate(pairs, 1):
            ratio = (None if None in (off["recovery_s"], on["recovery_s"]) else on["recovery_s"] / off["recovery_s"])
            print(f"round {n}: recovery without a spare {off['recovery_s'] or 0:.3f} s, with {on['recovery_s'] or 0:.3f}"
                  f" s ({'-' if ratio is None else f'{ratio:.2f}x'}); server restart {off['restart_s'] or 0:.3f} -> "
                  f"{on['restart_s'] or 0:.3f} s")
    if args.json:
        out = reports if len(reports) > 1 else next(iter(reports.values()))
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

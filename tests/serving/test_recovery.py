"""Crash recovery with real processes and sockets: kill or hang the scheduler
(or the detokenizer) while requests stream; every request completes with
exactly the text of a fault-free run."""

import json
import os
import random
import signal

from functools import partial

import httpx
import pytest
import trio

from ..conftest import child_pids, free_tcp_port, until_no_thread_niced
from .test_http import sse_events, start_server

pytestmark = pytest.mark.slow  # kills and restarts real child processes

N_REQUESTS = 32
# These tests kill the scheduler from outside, again and again: to the poison quarantine a kill
# that lands while a request is on probation looks like that request's crash, so it is off here
# (tests/serving/test_hostile.py tests it).
RECOVERY = {"model.dtype": "float32", "supervision.max_restarts": 20, "supervision.quarantine_after": 1000}


def requests_for(rng_seed, n=N_REQUESTS, **sampling):
    rng = random.Random(rng_seed)
    return [
        {"input_ids": [rng.randrange(3, 49152) for _ in range(rng.randint(4, 40))],
         "sampling_params": {"max_new_tokens": 96, "ignore_eos": True, "temperature": 0.0, **sampling},
         "rid": f"req-{rng_seed}-{i}"}
        for i in range(n)
    ]


async def run_all(client, bodies, stream, texts, progress=None, finishes=None):
    """Run ``bodies`` at once; ``texts[rid]``: (text, ids) each client received, ``finishes[rid]``
    (if given): its finish_reason; ``progress``: the rids in the order they ended."""
    async def one(body):
        r = await client.post("/generate", json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            assert r.text.endswith("data: [DONE]\n\n"), r.text[-500:]
            text, ids = "", []
            for block in r.text.split("\n\n"):
                if not block.startswith("data: {"):
                    assert block in ("", "data: [DONE]"), repr(block)
                    continue
                event = json.loads(block.removeprefix("data: "))
                assert event["text"].startswith(text), "a streamed text went back on itself"
                text, ids, finish = event["text"], event["output_ids"], event["meta_info"]["finish_reason"]
        else:
            text, ids, finish = r.json()["text"], r.json()["output_ids"], r.json()["meta_info"]["finish_reason"]
        texts[body["rid"]] = (text, ids)
        if finishes is not None:
            finishes[body["rid"]] = finish
        if progress is not None:
            progress.append(body["rid"])

    async with trio.open_nursery() as nursery:
        for body in bodies:
            nursery.start_soon(one, body)


@pytest.fixture(scope="module")
def runner(tiny_loaded):
    import torch

    from models.runner import ModelRunner

    return ModelRunner(tiny_loaded, dtype=torch.float32)


def runner_answers(runner, tokenizer, bodies):
    """{rid: (text, ids)}: the runner's own output for ``bodies``, decoded as the detokenizer does.
    Greedy requests with the same parameters run as one batch (in float32 the tiny model's greedy
    tokens do not depend on the batch: the server's batches show it); sampled ones alone."""
    from models.runner import generate
    from serving.managers.batching import to_model_sampling
    from serving.managers.messages import SamplingParams

    groups: dict[str, list[dict]] = {}
    for body in bodies:
        greedy = body["sampling_params"].get("temperature") == 0.0
        key = json.dumps(body["sampling_params"], sort_keys=True) if greedy else body["rid"]
        groups.setdefault(key, []).append(body)
    out = {}
    for group in groups.values():
        sampling = SamplingParams(**group[0]["sampling_params"])
        answers = generate(runner, [body["input_ids"] for body in group], sampling.max_new_tokens,
                           to_model_sampling(sampling))
        for body, ids in zip(group, answers):
            out[body["rid"]] = (tokenizer.decode(ids, skip_special_tokens=True), ids)
    return out


@pytest.fixture
def baseline(runner, tokenizer):
    """What a fault-free server answers: the runner's own output (the engine
    tests show the two agree), decoded as the detokenizer does."""
    return lambda bodies: runner_answers(runner, tokenizer, bodies)


async def wait_until_healthy(client, timeout=120):
    """Until /health is 200: the server is starting in another process."""
    with trio.fail_after(timeout):
        while True:
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.ConnectError:
                pass
            await trio.sleep(0.1)


def scheduler_pid(app):
    return app.state.server.runtime.supervisor.child("scheduler").pid


def assert_clean(app):
    engine = app.state.server.runtime
    assert engine.tokenizer_manager.rid_to_state == {}


def assert_drained(info, *, stale_outputs=False):
    """Nothing left downstream (``info``: /server_info): no request in the scheduler, every
    KV page free or in the prefix cache, and the detokenizer holds no request's state.
    Unless ``stale_outputs`` (the detokenizer restarted, so the scheduler's outputs for the
    requests it ran meanwhile met a detokenizer that did not know them; or a stop string
    ended a request the scheduler ran on for a step), every output the detokenizer got
    was for a request it knew."""
    assert info["requests_by_worker"] == {} and info["waiting"] == 0 and info["running"] == 0
    assert info["kv_pages_free"] + info["cached_pages"] == info["kv_pages_total"]
    detokenizer = info["detokenizer"]
    assert detokenizer.get("requests") == 0, detokenizer  # (an "error" key: it did not answer)
    if not stale_outputs:
        assert detokenizer["unknown_rids"] == 0, detokenizer


async def kill_scheduler_repeatedly(app, client, bodies, texts, kills=3, seed=2):
    """Kill -9 the scheduler ``kills`` times while ``bodies`` run (``texts``: what run_all
    collects), struck by progress, not by the clock: first in prefill, once the scheduler
    holds every request still in flight; then each time the clients received a few more
    tokens. Fewer kills if every request ended first; how many."""
    status = app.state.server.runtime.status
    tm = app.state.server.runtime.tokenizer_manager
    rng = random.Random(seed)

    def received():
        return sum(len(s.output_ids) for s in tm.rid_to_state.values()) + sum(len(ids) for _, ids in texts.values())

    first, count = status.starts.get("scheduler", 0), 0
    while count < kills and len(texts) < len(bodies):
        await status.started("scheduler", first + count)
        with trio.fail_after(120):
            if count == 0:
                while len(texts) < len(bodies):
                    in_flight = sum(state.finished is None for state in tm.rid_to_state.values())
                    arrived = len(tm.rid_to_state) + len(texts) == len(bodies)
                    info = (await client.get("/server_info")).json()
                    if arrived and info["running"] + info["waiting"] == in_flight:
                        break
                    await trio.sleep(0.001)
            else:
                target = received() + rng.randint(5, 60)
                while received() < target and len(texts) < len(bodies):
                    await trio.sleep(0.001)
        if len(texts) == len(bodies):
            break
        os.kill(scheduler_pid(app), signal.SIGKILL)
        count += 1
    return count


async def run_through_kills(app, client, bodies, stream, kills=3, rounds=3):
    """Run ``bodies`` while the scheduler is killed ``kills`` times (kill_scheduler_repeatedly).
    Where every request ended before the last kill (a host that starved this process while the
    scheduler's process ran on), the same bodies run again under new rids with the kills left, up
    to ``rounds`` times. The kills, and each round's texts keyed by the bodies' rids."""
    done, results = 0, []
    for round_ in range(rounds):
        suffix = f"-again-{round_}" if round_ else ""
        texts = {}
        renamed = [{**body, "rid": body["rid"] + suffix} for body in bodies]
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, renamed, stream, texts)
            done += await kill_scheduler_repeatedly(app, client, renamed, texts, kills=kills - done, seed=2 + round_)
        results.append({rid.removesuffix(suffix) if suffix else rid: text for rid, text in texts.items()})
        if done == kills:
            break
    return done, results


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_kill_9_the_scheduler_repeatedly_while_32_requests_run(nursery, baseline, stream):
    bodies = requests_for(1)
    expected = baseline(bodies)
    url, app = await start_server(nursery, "default", **RECOVERY)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        kills, rounds = await run_through_kills(app, client, bodies, stream)
        info = (await client.get("/server_info")).json()
    assert kills == 3 and info["restarts"]["scheduler"] == kills
    assert all(texts == expected for texts in rounds)
    assert_clean(app)
    assert_drained(info)


async def run_with_fault(nursery, bodies, fault, *, stale_outputs=False, **overrides):
    """Stream ``bodies`` through a default-topology server; ``fault(app, client)`` strikes
    once tokens are flowing. The texts the clients received, and the app (``stale_outputs``:
    see assert_drained)."""
    url, app = await start_server(nursery, "default", **RECOVERY, **overrides)
    tm = app.state.server.runtime.tokenizer_manager
    texts = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, bodies, True, texts)
            while not any(state.output_ids for state in tm.rid_to_state.values()):
                await trio.sleep(0.01)
            await fault(app, client)
        assert_drained((await client.get("/server_info")).json(), stale_outputs=stale_outputs)
    return texts, app


def tcp_links():
    """Overrides placing the scheduler and the detokenizer in child processes, every link over tcp (loopback)."""
    return {f"actors.{name}": {"process": process, "address": f"tcp://127.0.0.1:{free_tcp_port()}"}
            for name, process in (("scheduler", "child"), ("detokenizer", "child"), ("tokenizer", "main"))}


async def test_seeded_sampling_survives_kills_over_tcp(nursery, baseline):
    """Seeded sampling (temperature 0.8), every link over tcp: three kills -9 of the scheduler,
    the first in prefill, change no request's text."""
    bodies = requests_for(3, n=8, temperature=0.8, seed=11)
    expected = baseline(bodies)
    url, app = await start_server(nursery, "tcp", **RECOVERY, **tcp_links())
    assert all(a.startswith("tcp://127.0.0.1:") for a in app.state.server.runtime.addresses.values())
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        kills, rounds = await run_through_kills(app, client, bodies, True)
        info = (await client.get("/server_info")).json()
    assert kills == 3 and info["restarts"]["scheduler"] == kills
    assert all(texts == expected for texts in rounds)
    assert len({ids[0] for _, ids in rounds[0].values()}) > 1  # sampled, not one greedy answer
    assert_drained(info)


EOS_PROMPT = [12269]  # the tiny model answers it greedily with 18837, 18837, then its eos (2)


def token_stops(ids, *, max_new_tokens, stop_token_ids=(), min_new_tokens=0, eos=(2,)):
    """Where a greedy answer ``ids`` (generated without stopping) ends: the first eos or stop
    token once ``min_new_tokens`` were generated (it is part of the output), else the length."""
    for i, token in enumerate(ids[:max_new_tokens]):
        if i + 1 >= min_new_tokens and (token in eos or token in stop_token_ids):
            return ids[: i + 1], {"type": "stop", "matched": token}
    return ids[:max_new_tokens], {"type": "length", "matched": max_new_tokens}


def first_unique(text, start, length=3):
    """A substring of ``text`` from ``start`` on that occurs there first (a stop string that ends the text there)."""
    for k in range(start, len(text) - length):
        piece = text[k : k + length]
        if piece.strip() == piece and "\ufffd" not in piece and text.find(piece) == k:
            return k, piece
    raise AssertionError(f"no stop string to pick in {text!r}")


async def test_stops_eos_and_min_tokens_through_kills_equal_a_fault_free_run(nursery, runner, tokenizer):
    """Requests that end by a stop string (trimmed or kept), a stop token, the eos, and
    min_new_tokens past an earlier stop token or eos; none ignores the eos. Three kills -9
    of the scheduler change nothing a client receives: texts, ids and finish reasons equal a
    fault-free run's, which ends each request where its stop says."""
    from models.runner import generate

    prompts = [body["input_ids"] for body in requests_for(41, n=6)]
    refs = [generate(runner, [p], 96)[0] for p in prompts]
    eos_ref = generate(runner, [EOS_PROMPT], 60)[0]
    assert eos_ref[:3] == [18837, 18837, 2]  # (the tiny model's weights are seeded: this holds)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in refs]
    cut, stop = first_unique(texts[0], len(texts[0]) * 3 // 5)
    kept_cut, kept_stop = first_unique(texts[1], len(texts[1]) * 3 // 5)

    def body(rid, ids, **sampling):
        return {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 96, "temperature": 0.0, **sampling}}

    bodies = [
        body("stop-string", prompts[0], stop=[stop]),
        body("stop-string-kept", prompts[1], stop=[kept_stop], no_stop_trim=True),
        body("stop-token", prompts[2], stop_token_ids=[refs[2][60]]),
        body("min-tokens", prompts[3], stop_token_ids=[refs[3][3], refs[3][50]], min_new_tokens=51),
        body("eos", EOS_PROMPT),
        body("eos-min-tokens", EOS_PROMPT, min_new_tokens=30, max_new_tokens=60),
        body("plain", prompts[4]),
        body("seeded", prompts[5], temperature=0.8, seed=5),
    ]
    url, app = await start_server(nursery, "default", **RECOVERY)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        fault_free, fault_free_finishes = {}, {}
        await run_all(client, bodies, True, fault_free, finishes=fault_free_finishes)
        texts_after, finishes = {}, {}
        async with trio.open_nursery() as inner:
            inner.start_soon(partial(run_all, client, bodies, True, texts_after, finishes=finishes))
            kills = await kill_scheduler_repeatedly(app, client, bodies, texts_after)
        info = (await client.get("/server_info")).json()

    # the fault-free run ends each request where its stop says
    assert fault_free_finishes["stop-string"] == {"type": "stop", "matched": stop}
    assert fault_free["stop-string"][0] == texts[0][:cut]
    assert fault_free_finishes["stop-string-kept"] == {"type": "stop", "matched": kept_stop}
    assert fault_free["stop-string-kept"][0] == texts[1][: kept_cut + len(kept_stop)]
    for rid, ref, sampling in (("stop-token", refs[2], bodies[2]), ("min-tokens", refs[3], bodies[3]),
                               ("eos", eos_ref, bodies[4]), ("eos-min-tokens", eos_ref, bodies[5]),
                               ("plain", refs[4], bodies[6])):
        ids, finish = token_stops(ref, **{k: v for k, v in sampling["sampling_params"].items() if k != "temperature"})
        assert (fault_free[rid][1], fault_free_finishes[rid]) == (ids, finish), rid
    assert len(fault_free["min-tokens"][1]) == 51 and fault_free_finishes["min-tokens"]["type"] == "stop"
    assert fault_free["eos"][1] == [18837, 18837, 2]
    assert len(fault_free["eos-min-tokens"][1]) >= 30
    # and three kills change none of it
    assert kills == 3 and info["restarts"]["scheduler"] == kills
    assert texts_after == fault_free
    assert finishes == fault_free_finishes
    assert_drained(info, stale_outputs=True)  # the scheduler may have run a step past a stop string


async def test_detokenizer_kill_loses_and_repeats_nothing(nursery, baseline, tmp_path):
    """... and while it restarts, for longer than the output watchdog's timeout, the silence
    is not blamed on the scheduler."""
    async def kill_detokenizer(app, client):
        os.kill(app.state.server.runtime.supervisor.child("detokenizer").pid, signal.SIGKILL)

    slow = {"process": "child", "address": "ipc://{runtime_dir}/detokenizer",
            "target": "tests.serving.faults:slow_restarting_detokenizer_child",
            "args": {"delay": 3.0, "marker": str(tmp_path / "started")}}
    bodies = requests_for(4, n=16)
    texts, app = await run_with_fault(nursery, bodies, kill_detokenizer, stale_outputs=True, **{
        "actors.detokenizer": slow, "watchdogs.output_timeout": 1.5})
    assert texts == baseline(bodies)
    assert app.state.server.runtime.supervisor.restarts == {"scheduler": 0, "detokenizer": 1, "tokenizer": 0}
    assert_clean(app)


async def test_a_frozen_scheduler_is_killed_by_the_output_watchdog(nursery, baseline):
    async def freeze(app, client):
        os.kill(scheduler_pid(app), signal.SIGSTOP)  # hung: alive, silent
        with trio.fail_after(30):  # the output watchdog (8 s) notices and kills it
            while (await client.get("/health")).status_code == 200:
                await trio.sleep(0.05)
        assert (await client.get("/livez")).text == "OK"  # (liveness: the front end itself answers)

    bodies = requests_for(5, n=8)
    texts, app = await run_with_fault(nursery, bodies, freeze, **{"watchdogs.output_timeout": 8.0})
    assert texts == baseline(bodies)
    assert app.state.server.runtime.supervisor.restarts["scheduler"] == 1


async def test_a_step_that_never_returns_trips_the_step_watchdog(nursery, baseline, tmp_path):
    bodies = requests_for(6, n=8)
    expected = baseline(bodies)
    hang = {"process": "child", "address": "ipc://{runtime_dir}/scheduler",
            "target": "tests.serving.faults:hanging_scheduler_child",
            "args": {"steps": 5, "marker": str(tmp_path / "hung-once")}}
    url, app = await start_server(nursery, "default", **RECOVERY, **{"watchdogs.step_timeout": 2.0,
                                                                     "actors.scheduler": hang})
    texts = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await run_all(client, bodies, True, texts)
    assert texts == expected
    assert (tmp_path / "hung-once").exists()
    assert app.state.server.runtime.supervisor.restarts["scheduler"] == 1


async def test_past_the_restart_intensity_requests_fail_fast_and_the_server_exits_non_zero(tmp_path):
    """A real `tercet serve` process: two kills within the window of max_restarts=1."""
    import subprocess
    import sys

    from ..conftest import free_tcp_port

    port = free_tcp_port()
    config = tmp_path / "fragile.yaml"
    config.write_text(
        "model: {path: tiny, dtype: float32}\n"
        f"server: {{host: 127.0.0.1, port: {port}}}\n"
        "supervision: {max_restarts: 1, within: 600}\n"
        "actors:\n"
        "  scheduler:   {process: child, address: 'ipc://{runtime_dir}/scheduler'}\n"
        "  detokenizer: {process: child, address: 'ipc://{runtime_dir}/detokenizer'}\n"
        "  tokenizer:   {process: main, address: 'ipc://{runtime_dir}/tokenizer'}\n"
    )
    server = await trio.lowlevel.open_process([sys.executable, "-m", "serving.cli", "serve", "--config", str(config)],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await wait_until_healthy(client)
            results = {}

            streaming = trio.Semaphore(0)

            async def long_request(i):
                body = {"input_ids": [5 + i, 6, 7], "stream": i % 2 == 0,
                        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
                async with client.stream("POST", "/generate", json=body) as r:
                    text = ""
                    async for piece in r.aiter_text():  # read to the end
                        if not text and body["stream"]:
                            streaming.release()
                        text += piece
                results[i] = (r.status_code, text, trio.current_time())

            children = set()
            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(long_request, i)
                for _ in range(2):  # both streams are flowing
                    await streaming.acquire()
                for kill in range(2):
                    with trio.fail_after(60):  # wait for a serving scheduler
                        while (await client.get("/health")).status_code != 200:
                            await trio.sleep(0.1)
                    pids = (await client.get("/server_info")).json()["pids"]
                    children.update(pids.values(), child_pids(server.pid))  # (and the spares)
                    os.kill(pids["scheduler"], signal.SIGKILL)
                    failed_at = trio.current_time()
                    with trio.fail_after(10):  # the server has seen the death (before /health can be 200 again)
                        while (await client.get("/health")).status_code == 200:
                            await trio.sleep(0.01)
                with trio.fail_after(5):
                    while len(results) < 4:
                        await trio.sleep(0.01)
                health = await client.get("/health")
            assert health.status_code == 503 and "failed" in health.text
            assert all(t - failed_at < 1.0 for _, _, t in results.values()), (failed_at, results)
            for i, (status, text, _) in results.items():
                if i % 2:  # non-streaming: 503
                    assert status == 503 and "failed" in text, text
                else:  # streaming: an error event, then [DONE]
                    assert '"error"' in text and text.endswith("data: [DONE]\n\n"), text
        with trio.fail_after(30):
            code = await server.wait()
        assert code != 0
        for pid in children:  # no orphans
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        server.kill()
        await server.wait()


@pytest.mark.slow
async def test_smollm2_requests_survive_a_scheduler_kill(nursery):
    """The real model (float32, so a resumed prefill rounds as the decode did):
    a kill -9 in mid-decode changes no request's text."""
    url, app = await start_server(nursery, "default", **{
        "model.path": None, "model.dtype": "float32", "scheduler.enable_prefix_cache": False,
        "supervision.max_restarts": 20})
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]
    bodies = [{"text": p, "rid": f"smol-{i}", "sampling_params": {"max_new_tokens": 40, "temperature": 0.0,
                                                                  "ignore_eos": True}}
              for i, p in enumerate(prompts)]
    tm = app.state.server.runtime.tokenizer_manager
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        fault_free = {}
        await run_all(client, bodies, True, fault_free)
        standby = app.state.server.runtime.supervisor.child("scheduler").standby
        with trio.fail_after(120):
            assert await standby.until_warm()  # (it preloads in the time the server leaves idle)
        spare = standby.pid
        texts = {}
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, bodies, True, texts)
            while sum(len(state.output_ids) for state in tm.rid_to_state.values()) < 60:
                await trio.sleep(0.005)  # a third of the way into decoding
            os.kill(scheduler_pid(app), signal.SIGKILL)
        info = (await client.get("/server_info")).json()
    assert info["restarts"]["scheduler"] == 1
    # the restart ran in the spare process (supervision.standby), none of its threads at the spare's priority
    assert spare is not None and scheduler_pid(app) == spare
    await until_no_thread_niced(spare)
    assert texts == fault_free
    assert all(len(ids) == 40 for _, ids in texts.values())
    assert_drained(info)


async def test_resumed_requests_pass_the_queue_bound(nursery, baseline):
    """8 streams against 2 running and 6 queued: all 8 are resumed into the new scheduler."""
    bodies = requests_for(31, n=8)
    expected = baseline(bodies)
    url, app = await start_server(nursery, "default", **RECOVERY, **{
        "scheduler.max_running_requests": 2, "scheduler.max_queued_requests": 6})
    runtime = app.state.server.runtime
    texts = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, bodies[:2], True, texts)
            with trio.fail_after(60):
                while (await client.get("/server_info")).json()["running"] < 2:
                    await trio.sleep(0.005)
            inner.start_soon(run_all, client, bodies[2:], True, texts)
            with trio.fail_after(60):
                while (info := (await client.get("/server_info")).json())["waiting"] < 6:
                    await trio.sleep(0.005)
            assert info["running"] == 2  # and the queue is full
            os.kill(scheduler_pid(app), signal.SIGKILL)
            await runtime.status.started("scheduler", 2)
    assert texts == expected
    assert runtime.tokenizer_manager.resumed == 8


async def test_an_abort_while_the_scheduler_restarts_is_not_undone_by_the_resume(nursery):
    url, app = await start_server(nursery, "default", **RECOVERY)
    runtime = app.state.server.runtime
    tm = runtime.tokenizer_manager
    body = {"input_ids": [9, 10, 11], "rid": "doomed", "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async with trio.open_nursery() as inner:
            ended = {}

            async def long_stream():
                ended["response"] = await client.post("/generate", json=body)

            inner.start_soon(long_stream)
            while not (tm.rid_to_state and tm.rid_to_state["doomed"].output_ids):
                await trio.sleep(0.001)  # it streams
            os.kill(scheduler_pid(app), signal.SIGKILL)
            with trio.fail_after(10):
                while runtime.status.scheduler_running():
                    await trio.sleep(0.001)  # the supervisor saw the death: it restarts the scheduler
            r = await client.post("/abort_request", json={"rid": "doomed"})
            assert r.json() == {"rid": "doomed", "aborted": True}
        events = sse_events(ended["response"].text)
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        await runtime.status.started("scheduler", 2)
        info = (await client.get("/server_info")).json()
        assert tm.resumed == 0 and info["running"] == 0 and info["waiting"] == 0

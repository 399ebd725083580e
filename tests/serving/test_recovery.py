"""Crash recovery with real processes and sockets: kill or hang the scheduler
(or the detokenizer) while requests stream; every request completes with
exactly the text of a fault-free run."""

import json
import os
import random
import signal

import httpx
import pytest
import trio

from .test_http import start_server

N_REQUESTS = 32
RECOVERY = {"model.dtype": "float32", "supervision.max_restarts": 20}


def requests_for(seed, n=N_REQUESTS, **sampling):
    rng = random.Random(seed)
    return [
        {"input_ids": [rng.randrange(3, 49152) for _ in range(rng.randint(4, 40))],
         "sampling_params": {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0.0, **sampling},
         "rid": f"req-{seed}-{i}"}
        for i in range(n)
    ]


async def run_all(client, bodies, stream, texts, progress=None):
    async def one(body):
        r = await client.post("/generate", json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            text, ids = "", []
            for block in r.text.split("\n\n")[:-2]:
                event = json.loads(block.removeprefix("data: "))
                assert event["text"].startswith(text), "a streamed text went back on itself"
                text, ids = event["text"], event["output_ids"]
            assert r.text.endswith("data: [DONE]\n\n")
        else:
            text, ids = r.json()["text"], r.json()["output_ids"]
        texts[body["rid"]] = (text, ids)
        if progress is not None:
            progress.append(body["rid"])

    async with trio.open_nursery() as nursery:
        for body in bodies:
            nursery.start_soon(one, body)


async def baseline(nursery, bodies):
    url, _ = await start_server(nursery, "single-process", **{"model.dtype": "float32"})
    texts = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await run_all(client, bodies, False, texts)
    return texts


def scheduler_pid(app):
    return app.state.server.engine.supervisor.child("scheduler").pid


def assert_clean(app):
    engine = app.state.server.engine
    assert engine.tokenizer_manager.rid_to_state == {}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_kill_9_the_scheduler_repeatedly_while_32_requests_run(nursery, stream):
    bodies = requests_for(1)
    expected = await baseline(nursery, bodies)
    url, app = await start_server(nursery, "default", **RECOVERY)
    texts, done = {}, []
    rng = random.Random(2)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, bodies, stream, texts, done)
            kills = 0
            for at in (0.0, 0.3, 0.6):  # in prefill, then in decode
                await app.state.server.engine.started("scheduler", kills + 1)
                await trio.sleep(rng.uniform(0, 0.4) + at)
                if len(done) == len(bodies):
                    break
                os.kill(scheduler_pid(app), signal.SIGKILL)
                kills += 1
        info = (await client.get("/server_info")).json()
    assert kills >= 2 and info["restarts"]["scheduler"] == kills
    assert texts == expected
    assert_clean(app)


async def test_seeded_sampling_survives_kills(nursery):
    bodies = requests_for(3, n=8, temperature=0.8, seed=11)
    expected = await baseline(nursery, bodies)
    url, app = await start_server(nursery, "default", **RECOVERY)
    texts = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, bodies, True, texts)
            await trio.sleep(0.5)
            os.kill(scheduler_pid(app), signal.SIGKILL)
    assert texts == expected


async def test_detokenizer_kill_loses_and_repeats_nothing(nursery):
    bodies = requests_for(4, n=16)
    expected = await baseline(nursery, bodies)
    url, app = await start_server(nursery, "default", **RECOVERY)
    texts = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, bodies, True, texts)
            await trio.sleep(0.5)
            os.kill(app.state.server.engine.supervisor.child("detokenizer").pid, signal.SIGKILL)
    assert texts == expected
    assert_clean(app)


async def test_a_frozen_scheduler_is_killed_by_the_output_watchdog(nursery):
    bodies = requests_for(5, n=8)
    expected = await baseline(nursery, bodies)
    url, app = await start_server(nursery, "default", **RECOVERY, **{"watchdogs.output_timeout": 2.0})
    texts = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, bodies, True, texts)
            await trio.sleep(0.3)
            os.kill(scheduler_pid(app), signal.SIGSTOP)  # hung: alive, silent
            await trio.sleep(0.5)
            assert (await client.get("/health")).status_code == 503
    assert texts == expected
    assert app.state.server.engine.supervisor.restarts["scheduler"] == 1


async def test_a_step_that_never_returns_trips_the_step_watchdog(nursery, tmp_path):
    bodies = requests_for(6, n=8)
    expected = await baseline(nursery, bodies)
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
    assert app.state.server.engine.supervisor.restarts["scheduler"] == 1

"""Values derived from client input, through real HTTP on the default topology (scheduler and
detokenizer in child processes over ipc, the tiny model): a seed near 2**63 with n > 1, prompts x n
past the server's bound, and a message the scheduler's mailbox refuses. For each: the status, a
bound on the wait, /health under 1 s meanwhile, and nothing left running or restarted after."""

import httpx
import pytest
import trio

from serving.managers import inputs
from serving.managers.messages import DetokenizerInfoReq

from .test_hostile import health_latency_while
from .test_http import start_server

pytestmark = pytest.mark.slow  # a real server with child processes per test

BIG_SEED = 2**63 - 1
WAIT_S = 30  # the longest any case here may take (a lost request hung forever)


async def answered(client, path, body):
    """``path``'s answer to ``body`` (within ``WAIT_S``), and the slowest /health meanwhile."""
    with trio.fail_after(WAIT_S):
        slowest, r = await health_latency_while(client, lambda: client.post(path, json=body))
    assert slowest < 1.0, slowest
    return r


async def assert_nothing_left(client, runtime):
    """Nothing in flight anywhere (an abort's end reaches the detokenizer a moment after the client left)."""
    tm = runtime.tokenizer_manager
    with trio.fail_after(10):
        while (info := (await client.get("/server_info")).json())["waiting"] or info["running"] or \
                (await tm.call_detokenizer(DetokenizerInfoReq())).requests:
            await trio.sleep(0.05)
    assert runtime.status.restarts == {"scheduler": 0, "detokenizer": 0, "tokenizer": 0}
    assert not tm.rid_to_state and runtime.gate.readers == 0


@pytest.fixture
async def served(nursery):
    url, app = await start_server(nursery, "default", **{"model.dtype": "float32"})
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        yield client, app.state.server.runtime


async def test_a_seed_near_2_63_with_n_samples_every_sample(served):
    client, runtime = served
    body = {"text": "hi", "sampling_params": {"seed": BIG_SEED, "n": 2, "max_new_tokens": 4, "temperature": 1}}
    r = await answered(client, "/generate", body)
    assert r.status_code == 200, r.text
    first = [out["output_ids"] for out in r.json()]
    assert len(first) == 2 and all(len(ids) == 4 for ids in first)
    # the same seed samples the same (seed + k wraps like an int64: sample 1 is seeded -2**63)
    assert [out["output_ids"] for out in (await answered(client, "/generate", body)).json()] == first
    r = await answered(client, "/v1/completions", {"prompt": "hi", "seed": BIG_SEED, "n": 2, "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    await assert_nothing_left(client, runtime)


async def test_a_derived_value_the_wire_refuses_is_a_400_before_it_is_sent(served, monkeypatch):
    """With seeds derived as before (seed + k unbounded), the sender's wire check refuses sample 1."""
    client, runtime = served
    monkeypatch.setattr(inputs, "sample_seed", lambda seed, k: seed + k)
    body = {"text": "hi", "sampling_params": {"seed": BIG_SEED, "n": 2, "max_new_tokens": 4, "temperature": 1}}
    r = await answered(client, "/generate", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "sampling_params.seed" and "9223372036854775807" in error["message"], error
    r = await answered(client, "/v1/completions", {"prompt": "hi", "seed": BIG_SEED, "n": 2, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    await assert_nothing_left(client, runtime)


async def test_a_request_the_scheduler_mailbox_refuses_ends_with_an_error_not_in_silence(served, monkeypatch):
    """The sender's check off: the scheduler's mailbox refuses sample 1 and answers for its rid
    (it hung before: the client waited forever, and the output watchdog killed the scheduler)."""
    client, runtime = served
    monkeypatch.setattr(inputs, "sample_seed", lambda seed, k: seed + k)
    monkeypatch.setattr(runtime.tokenizer_manager._wire, "problem", lambda msg: None)
    body = {"text": "hi", "sampling_params": {"seed": BIG_SEED, "n": 2, "max_new_tokens": 4, "temperature": 1}}
    r = await answered(client, "/generate", body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "the scheduler refused this request" in message and "sampling_params.seed" in message, message
    stream = await answered(client, "/generate", {**body, "stream": True})
    assert stream.status_code in (200, 400) and "sampling_params.seed" in stream.text, stream.text
    await assert_nothing_left(client, runtime)


async def test_prompts_times_n_is_bounded_and_each_sample_counts_against_admission(nursery):
    url, app = await start_server(nursery, "default", **{
        "model.dtype": "float32", "server.max_samples": 8,
        "scheduler.max_running_requests": 2, "scheduler.max_queued_requests": 3})
    runtime = app.state.server.runtime
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        # the audit's amplifier: 256 prompts x n 128 (32,768 sub-requests) is refused at once
        r = await answered(client, "/generate", {"text": ["x"] * 256, "sampling_params": {"n": 128}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "sampling_params.n" and "server.max_samples" in error["message"], error
        r = await answered(client, "/generate", {"text": ["x"] * 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
        r = await answered(client, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        ok = await answered(client, "/generate", {"text": ["a"], "sampling_params": {"n": 3, "max_new_tokens": 2}})
        assert ok.status_code == 200 and len(ok.json()) == 3, ok.text
        # admission counts sub-requests: one long request in flight, then 5 more samples pass the bound of 5
        long = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        async with trio.open_nursery() as inner:
            inner.start_soon(lambda: client.post("/generate", json=long))
            with trio.fail_after(WAIT_S):
                while runtime.gate.readers < 1:
                    await trio.sleep(0.01)
            r = await answered(client, "/generate", {"text": "x", "sampling_params": {"n": 5, "max_new_tokens": 2}})
            assert r.status_code == 503 and "this one adds 5" in r.json()["error"]["message"], r.text
            r = await answered(client, "/generate", {"text": "x", "sampling_params": {"n": 3, "max_new_tokens": 2}})
            assert r.status_code == 200 and len(r.json()) == 3, r.text
            inner.cancel_scope.cancel()
        with trio.fail_after(WAIT_S):  # the long one's client left: it is aborted down to the scheduler
            while runtime.tokenizer_manager.rid_to_state or (await client.get("/server_info")).json()["running"]:
                await trio.sleep(0.02)
        await assert_nothing_left(client, runtime)

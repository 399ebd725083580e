"""The HTTP server through real HTTP on loopback (tiny model, one process)."""

import json
from functools import partial

import httpx
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from serving.cli import serving_app
from serving.runtime.topology import load_topology

from ..conftest import free_tcp_port


async def greedy_texts(client, body) -> set[str]:
    """The text a healthy server gives greedy `body`, computed from scratch and then with its
    prompt in the prefix cache: the same, the server being deterministic by default (outside that
    mode a cached prompt's last token attends as a decode row and a random model's near-tied bf16
    logits may flip). A set, for checks that compare what a request left behind."""
    first = (await client.post("/generate", json=body)).json()["text"]
    second = (await client.post("/generate", json=body)).json()["text"]
    assert first == second, "greedy text with the prompt cached differs from the one computed"
    return {first}


async def start_server(nursery, config="single-process", **overrides):
    topology = load_topology(config, {"model.path": "tiny", "server.port": free_tcp_port(), **overrides})
    hc = Config()
    hc.bind = [f"127.0.0.1:{topology.server.port}"]
    hc.accesslog = None
    hc.startup_timeout = 600  # child processes load the model before the server is ready
    app = serving_app(topology)
    await nursery.start(serve, app, hc)
    return f"http://127.0.0.1:{topology.server.port}", app


@pytest.fixture
async def server(nursery):
    url, app = await start_server(nursery)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        client.app = app
        yield client


@pytest.fixture(scope="module")
def tiny_runner(tiny_loaded):
    """The model runner of the servers here (the tiny model in the default dtype: bfloat16 where the
    CPU has bf16 units, else float32), for reference outputs."""
    from models.runner import ModelRunner

    return ModelRunner(tiny_loaded)


def greedy_reference(runner, tokenizer, ids, max_new_tokens):
    """(text, ids) of the runner's own greedy answer to ``ids``, ended at the eos as a server ends it."""
    from models.runner import generate

    out = generate(runner, [ids], max_new_tokens)[0]
    eos = next((i for i, t in enumerate(out) if t in runner.eos_token_ids), None)
    out = out if eos is None else out[: eos + 1]
    return tokenizer.decode(out, skip_special_tokens=True), out


async def metric(client, sample):
    """The value of one Prometheus sample (its name and labels, as printed) in /metrics."""
    text = (await client.get("/metrics")).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sample + " ")]
    assert len(values) == 1, (sample, text)
    return values[0]


async def wait_for_info(client, predicate, timeout=30):
    """Poll /server_info until ``predicate(info)``; the info. A 503 (no scheduler answers:
    it is restarting) is asked again."""
    with trio.fail_after(timeout):
        while True:
            r = await client.get("/server_info")
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200 and predicate(info := r.json()):
                return info
            await trio.sleep(0.01)


def sse_events(text):
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    blocks = text.split("\n\n")[:-1]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [json.loads(b[6:]) for b in blocks[:-1]]


async def test_native_generate_single_batch_and_stream(server):
    r = await server.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert r.status_code == 200
    body = r.json()
    assert len(body["output_ids"]) == 5 and isinstance(body["text"], str)
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "matched": 5}
    assert meta["completion_tokens"] == 5 and meta["prompt_tokens"] >= 1 and "cached_tokens" in meta

    # a batch answers each prompt as that prompt alone would be answered, in order
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    alone = [(await server.post("/generate", json={"input_ids": p, "sampling_params": greedy})).json()
             for p in ([5, 6, 7], [8, 9])]
    assert alone[0]["output_ids"] != alone[1]["output_ids"]  # a swap would show
    r = await server.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": greedy})
    assert [(x["index"], x["text"], x["output_ids"]) for x in r.json()] == \
        [(i, a["text"], a["output_ids"]) for i, a in enumerate(alone)]

    r = await server.post("/generate", json={"text": "Hello", "stream": True, "return_logprob": True,
                                             "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    events = sse_events(r.text)
    assert events[-1]["text"] == body["text"] and events[-1]["output_ids"] == body["output_ids"]
    assert len(events[-1]["meta_info"]["output_token_logprobs"]) == 5


async def test_openai_completions_and_chat(server):
    r = await server.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4,
                                                   "temperature": 0, "logprobs": 2})
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 4

    r = await server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "temperature": 0, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == body["choices"][0]["text"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4

    r = await server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_completion_tokens": 3, "n": 2, "seed": 3})
    body = r.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 6

    r = await server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 3, "stream": True, "logprobs": True,
                                                        "top_logprobs": 2})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len(events[0]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2

    r = await server.get("/v1/models")
    assert r.json()["data"][0]["id"] == "tiny"


def openai_stream(text):
    """The choices of an OpenAI SSE stream by index, each a list of its chunks' choice; the usage chunk's usage."""
    choices, usage = {}, None
    for event in sse_events(text):
        if not event["choices"]:
            usage = event["usage"]
        for choice in event["choices"]:
            choices.setdefault(choice["index"], []).append(choice)
    return choices, usage


async def test_openai_stop_n_and_usage(server):
    """``stop`` (a string or a list) cuts the answer before it with finish_reason stop; with
    ``n`` each streamed choice carries its own index and the n samples differ (temperature > 0);
    usage counts each prompt once, however many samples it has (as OpenAI and vLLM do)."""
    base = {"prompt": "Hello", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = (await server.post("/v1/completions", json=base)).json()["choices"][0]["text"]
    start = next(k for k in range(len(full) // 2, len(full) - 2)
                 if full[k : k + 2].strip() == full[k : k + 2] and full.find(full[k : k + 2]) == k)
    stop = full[start : start + 2]
    for form in (stop, ["never in this text", stop]):
        choice = (await server.post("/v1/completions", json={**base, "stop": form})).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (full[:start], "stop"), form
    choices, _ = openai_stream((await server.post("/v1/completions", json={**base, "stop": stop, "stream": True})).text)
    assert "".join(c["text"] for c in choices[0]) == full[:start] and choices[0][-1]["finish_reason"] == "stop"

    messages = [{"role": "user", "content": "Hi"}]
    one = (await server.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6})).json()["usage"]
    chat = {"messages": messages, "max_tokens": 6, "n": 3, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    whole = (await server.post("/v1/chat/completions", json=chat)).json()
    answers = [c["message"]["content"] for c in whole["choices"]]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2] and len(set(answers)) == 3
    assert whole["usage"]["prompt_tokens"] == one["prompt_tokens"]  # the prompt once, not 3 times
    assert whole["usage"]["completion_tokens"] == 18
    r = await server.post("/v1/chat/completions", json={**chat, "stream": True, "stream_options": {"include_usage": True}})
    choices, usage = openai_stream(r.text)
    assert sorted(choices) == [0, 1, 2]
    assert ["".join(c["delta"].get("content", "") for c in choices[i]) for i in range(3)] == answers
    assert all(choices[i][0]["delta"]["role"] == "assistant" and choices[i][-1]["finish_reason"] == "length"
               for i in range(3))
    assert usage == whole["usage"]

    # two prompts, two samples each: choice index = prompt * n + sample; each prompt counted once
    prompts = ["Hello", "Bonjour tout le monde"]
    alone = [(await server.post("/v1/completions", json={"prompt": p, "max_tokens": 2})).json()["usage"]
             for p in prompts]
    batch = {"prompt": prompts, "max_tokens": 3, "n": 2, "temperature": 0.8, "seed": 5, "ignore_eos": True}
    whole = (await server.post("/v1/completions", json=batch)).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert whole["usage"]["prompt_tokens"] == alone[0]["prompt_tokens"] + alone[1]["prompt_tokens"]
    assert whole["usage"]["completion_tokens"] == 12
    r = await server.post("/v1/completions", json={**batch, "stream": True, "stream_options": {"include_usage": True}})
    choices, usage = openai_stream(r.text)
    assert ["".join(c["text"] for c in choices[i]) for i in range(4)] == [c["text"] for c in whole["choices"]]
    assert usage == whole["usage"]
    assert all("usage" not in event for event in sse_events(r.text) if event["choices"])

    # vLLM's continuous_usage_stats: every chunk has its choice's usage so far, the chunk's own tokens
    # counted (what a load generator reads tokens per chunk from); the last, the request's
    r = await server.post("/v1/completions", json={**batch, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(r.text)
    assert events[-1]["usage"] == whole["usage"] and not events[-1]["choices"]
    for index in range(4):
        mine = [event for event in events[:-1] if event["choices"][0]["index"] == index]
        counts = [event["usage"]["completion_tokens"] for event in mine]
        assert all(event["usage"]["prompt_tokens"] == alone[index // 2]["prompt_tokens"] for event in mine)
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 3
        assert all(count > before for before, count, event in zip(counts, counts[1:], mine[1:])
                   if event["choices"][0]["text"])  # text comes with its tokens
    for hostile in ({"continuous_usage_stats": "yes"}, {"continuous_usage_stats": [True]}, {"usage_every": True}):
        r = await server.post("/v1/completions", json={**batch, "stream": True, "stream_options": hostile})
        assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"], r.text


async def test_admin_routes(server):
    assert (await server.get("/health")).text == "OK"
    assert (await server.get("/livez")).text == "OK"
    assert (await server.get("/health_generate")).status_code == 200  # (it fails when generation does:
    info = (await server.get("/server_info")).json()  # test_overload_is_503_with_retry_after)
    assert info["running"] == 0 and info["kv_pages_total"] > 0
    assert (await server.post("/abort_request", json={"rid": "nope"})).json() == {"rid": "nope", "aborted": False}

    # /flush_cache empties the prefix cache: a repeated prompt hits it before, not after
    body = {"input_ids": list(range(100, 140)), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}

    async def cached():
        return (await server.post("/generate", json=body)).json()["meta_info"]["cached_tokens"]

    assert await cached() == 0 and await cached() > 0
    assert (await server.post("/flush_cache")).status_code == 200
    assert await cached() == 0

    # /metrics: the figures move as requests run
    names = ['tercet_requests_total{finish_reason="length"}', "tercet_prompt_tokens_total",
             "tercet_generation_tokens_total", "tercet_time_to_first_token_seconds_count",
             "tercet_e2e_request_latency_seconds_count"]
    before = [await metric(server, name) for name in names]
    for prompt in ([5, 6, 7], [8, 9]):
        r = await server.post("/generate", json={"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 4, "ignore_eos": True}})
        assert r.status_code == 200
    after = [await metric(server, name) for name in names]
    assert [b - a for a, b in zip(before, after)] == [2, 5, 8, 2, 2]
    with trio.fail_after(30):  # the monitor may have looked while the last one ran
        while await metric(server, "tercet_num_running_reqs") != 0:
            await trio.sleep(0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(server.post, "/generate", json={"input_ids": [5], "rid": "long", "sampling_params": LONG}))
        with trio.fail_after(30):  # the scheduler's figures, as the monitor last saw them (each second)
            while await metric(server, "tercet_num_running_reqs") != 1:
                await trio.sleep(0.05)
        assert (await server.post("/abort_request", json={"rid": "long"})).json()["aborted"] is True
    with trio.fail_after(30):
        while await metric(server, "tercet_num_running_reqs") != 0:
            await trio.sleep(0.05)
    assert await metric(server, 'tercet_requests_total{finish_reason="abort"}') == 1


async def assert_held_until_continued(pauser, asker, continuer):
    """Paused through ``pauser``, a request through ``asker`` waits until ``continuer`` (a client
    of the asker's worker, free for other requests) continues."""
    assert (await pauser.post("/pause_generation")).json() == {"paused": True}
    done = trio.Event()

    async def ask():
        r = await asker.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        info = await wait_for_info(continuer, lambda info: info["admitting"] == 1)  # it arrived, and waits
        assert not done.is_set() and info["running"] == info["waiting"] == 0  # the scheduler never saw it
        assert (await continuer.post("/continue_generation")).json() == {"paused": False}
        await done.wait()


async def test_pause_holds_new_requests_until_continue(server):
    await assert_held_until_continued(server, server, server)


async def test_while_paused_an_abort_or_a_client_leaving_ends_a_waiting_request_unrun(server):
    """Requests held by a pause: /abort_request of their rid ends them at once (finish reason
    abort, nothing generated, whole or streamed), and one whose client leaves is dropped (499);
    none of them runs after /continue_generation."""
    tm = server.app.state.server.runtime.tokenizer_manager
    assert (await server.post("/pause_generation")).status_code == 200
    results = {}

    async def ask(stream):
        body = {"input_ids": [5, 6, 7], "rid": f"held-{stream}", "stream": stream, "sampling_params": LONG}
        results[stream] = await server.post("/generate", json=body)

    async with trio.open_nursery() as nursery:
        for stream in (False, True):
            nursery.start_soon(ask, stream)
        await wait_for_info(server, lambda info: info["admitting"] == 2)
        for stream in (False, True):
            r = await server.post("/abort_request", json={"rid": f"held-{stream}"})
            assert r.json() == {"rid": f"held-{stream}", "aborted": True}
    whole = results[False].json()  # both answered while still paused
    assert results[False].status_code == 200 and whole["meta_info"]["finish_reason"]["type"] == "abort"
    assert whole["output_ids"] == [] and whole["meta_info"]["completion_tokens"] == 0
    last = sse_events(results[True].text)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort" and last["output_ids"] == []

    body = json.dumps({"input_ids": [8, 9], "rid": "leaves", "sampling_params": LONG}).encode()
    stream = await trio.open_tcp_stream(server.base_url.host, server.base_url.port)
    await stream.send_all(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await wait_for_info(server, lambda info: info["admitting"] == 1)
    await stream.aclose()  # the client leaves while its request waits
    await wait_for_info(server, lambda info: info["admitting"] == 0)

    assert (await server.post("/continue_generation")).status_code == 200
    r = await server.post("/generate", json={"input_ids": [8, 9], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200  # serving again; the three held requests never reached the scheduler:
    info = (await server.get("/server_info")).json()
    assert info["aborted"] == 0 and info["running"] == info["waiting"] == 0 and tm.rid_to_state == {}
    assert await metric(server, 'tercet_requests_total{finish_reason="length"}') == 1
    assert (await server.post("/abort_request", json={"rid": "held-False"})).json()["aborted"] is False


BAD = [
    ("/generate", b"{", None),
    ("/generate", b"[]", None),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": "x", "input_ids": [1]}, None),
    ("/generate", {"input_ids": [[1], 2]}, "input_ids"),
    ("/generate", {"input_ids": [99999999]}, "input_ids"),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_token": 3}}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"text": "x", "sampling_params": {"stop": [""]}}, "sampling_params.stop[0]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a", 1]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, None),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"one": 2}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, None),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/abort_request", {}, None),
    ("/update_weights_from_disk", {"model_path": "/no/such/dir"}, "model_path"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
async def test_malformed_bodies_get_400_naming_the_field(server, path, body, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = await server.post(path, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error


async def test_unknown_model_route_and_method(server):
    r = await server.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert (await server.get("/nope")).status_code == 404
    assert (await server.get("/generate")).status_code == 405


LONG = {"max_new_tokens": 4000, "ignore_eos": True}  # seconds of decoding: far longer than the checks


async def assert_aborted_downstream(server, tm, aborted_before):
    """The request is gone from the tokenizer manager and the scheduler, ended by an abort
    (not by running out its tokens: ``aborted`` counts the scheduler's aborts)."""
    with trio.fail_after(10):
        while tm.rid_to_state or (info := (await server.get("/server_info")).json())["running"]:
            await trio.sleep(0.01)
    assert info["aborted"] == aborted_before + 1, info


async def test_client_disconnect_mid_stream_frees_the_request(server):
    tm = server.app.state.server.runtime.tokenizer_manager
    aborted = (await server.get("/server_info")).json()["aborted"]
    body = json.dumps({"text": "x", "stream": True, "sampling_params": LONG}).encode()
    host, port = server.base_url.host, server.base_url.port
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    received = b""
    while b"data: " not in received:  # the stream is flowing
        received += await stream.receive_some()
    assert received.startswith(b"HTTP/1.1 200") and len(tm.rid_to_state) == 1
    await stream.aclose()  # the client goes away mid-stream
    await assert_aborted_downstream(server, tm, aborted)


async def test_client_disconnect_while_waiting_non_streaming(server):
    tm = server.app.state.server.runtime.tokenizer_manager
    aborted = (await server.get("/server_info")).json()["aborted"]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(server.post, "/generate", json={"text": "x", "sampling_params": LONG}))
        while not tm.rid_to_state:  # it is in flight; the client then goes away
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    await assert_aborted_downstream(server, tm, aborted)


async def test_api_key_on_every_route_and_admin_key_on_admin_routes(nursery):
    from serving.http.app import ADMIN, ROUTES, UNPROTECTED

    url, _ = await start_server(nursery, **{"server.api_key": "sesame", "server.admin_api_key": "open-up"})
    user, admin = {"Authorization": "Bearer sesame"}, {"Authorization": "Bearer open-up"}
    wrong = [None, {"Authorization": "Bearer sesame2"}, {"Authorization": "Bearer sesam"},
             {"Authorization": "sesame"}, {"Authorization": "Basic sesame"}]
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/livez")).text == "OK"  # (a probe holds no key)
        for path, _, methods in ROUTES:
            if path in UNPROTECTED:
                continue
            right, other = (admin, user) if path in ADMIN else (user, admin)
            for headers in [*wrong, other]:
                r = await client.request(methods[0], path, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code)
                assert r.json()["error"]["type"] == "authentication_error"
            r = await client.request(methods[0], path, headers=right)  # past the key: whatever the route says
            assert r.status_code != 401, (path, r.text)
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=user)
        assert r.status_code == 200
        info = (await client.get("/server_info", headers=admin)).text
        assert "sesame" not in info and "open-up" not in info  # the keys are never shown


async def test_overload_is_503_with_retry_after(nursery):
    url, _ = await start_server(nursery, **{"scheduler.max_queued_requests": 0})
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "overloaded" in r.json()["error"]["message"]
        # a server that answers but cannot generate: /health says up, /health_generate says no
        assert (await client.get("/health")).status_code == 200
        r = await client.get("/health_generate")
        assert r.status_code == 503 and "generation failed" in r.text and "overloaded" in r.text, r.text


async def test_a_request_starved_while_others_stream_ends_with_504(nursery):
    """One running slot: a long stream holds it, a second request waits behind it, hearing nothing
    while the stream's tokens keep flowing. ``server.request_timeout`` ends the starved one (504)
    and takes it out of the queue; the stream, running longer than the timeout, goes on."""
    url, _ = await start_server(nursery, **{"scheduler.max_running_requests": 1, "server.request_timeout": 1.0})
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        seen = []

        async def hog():
            body = {"input_ids": [5, 6, 7], "rid": "hog", "stream": True, "sampling_params": LONG}
            async with client.stream("POST", "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen.append((trio.current_time(), json.loads(line[6:])))

        async with trio.open_nursery() as inner:
            inner.start_soon(hog)
            with trio.fail_after(30):
                while not seen:  # it runs
                    await trio.sleep(0.01)
            start = trio.current_time()
            with trio.fail_after(30):
                r = await client.post("/generate", json={"input_ids": [8, 9], "sampling_params": {"max_new_tokens": 2}})
            waited = trio.current_time() - start
            assert r.status_code == 504, r.text
            assert "no output for this request in 1 s (server.request_timeout)" in r.json()["error"]["message"]
            assert 1.0 <= waited < 10, waited
            info = (await client.get("/server_info")).json()
            assert info["waiting"] == 0 and info["running"] == 1  # out of the queue; the stream runs on
            count = len(seen)
            with trio.fail_after(30):
                while len(seen) == count:
                    await trio.sleep(0.01)
            assert seen[-1][0] - seen[0][0] > 1.0 and seen[-1][1]["meta_info"]["finish_reason"] is None
            assert (await client.post("/abort_request", json={"rid": "hog"})).json()["aborted"] is True
        assert seen[-1][1]["meta_info"]["finish_reason"]["type"] == "abort"


async def test_official_openai_client(server, tiny_runner, tokenizer):
    """The openai client's answers, whole and streamed, are the model runner's own greedy answers."""
    import openai

    hello = tokenizer("Hello", add_special_tokens=False).input_ids
    chat = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                   tokenize=False), add_special_tokens=False).input_ids
    expected_completion = greedy_reference(tiny_runner, tokenizer, hello, 5)[0]
    expected_chat = greedy_reference(tiny_runner, tokenizer, chat, 4)[0]

    def use_client():
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        whole = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                                                 temperature=0, stream=True) if c.choices)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        chat_streamed = "".join(
            c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
                stream=True) if c.choices)
        return whole.choices[0].text, streamed, chat.choices[0].message.content, chat_streamed

    whole, streamed, chat_whole, chat_streamed = await trio.to_thread.run_sync(use_client)
    assert whole == streamed == expected_completion and whole
    assert chat_whole == chat_streamed == expected_chat and chat_whole


async def test_stream_interval_sends_fewer_larger_events_with_the_same_text(nursery):
    """scheduler.stream_interval 4: a 10-token stream arrives in events after tokens 1, 4, 8 and 10
    (each event of /generate carries the output so far) and ends as interval 1 ends."""
    body = {"input_ids": [5, 6, 7], "stream": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    finals = {}
    for interval in (1, 4):
        url, _ = await start_server(nursery, **{"model.dtype": "float32", "scheduler.stream_interval": interval})
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            events = sse_events((await client.post("/generate", json=body)).text)
        finals[interval] = (events[-1]["text"], events[-1]["output_ids"])
        counts = [len(e["output_ids"]) for e in events]
        assert counts == ([1, 4, 8, 10] if interval == 4 else list(range(1, 11))), counts
    assert finals[4] == finals[1]

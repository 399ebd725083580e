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

    r = await server.post("/generate", json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 3}})
    assert [len(x["output_ids"]) for x in r.json()] == [3, 3]

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


async def test_admin_routes(server):
    assert (await server.get("/health")).text == "OK"
    assert (await server.get("/health_generate")).status_code == 200
    info = (await server.get("/server_info")).json()
    assert info["running"] == 0 and info["kv_pages_total"] > 0
    assert (await server.post("/flush_cache")).status_code == 200
    assert (await server.post("/abort_request", json={"rid": "nope"})).json() == {"rid": "nope", "aborted": False}
    metrics = (await server.get("/metrics")).text
    assert "tercet_time_to_first_token_seconds" in metrics and "tercet_num_running_reqs" in metrics


async def assert_held_until_continued(pauser, asker, continuer):
    """Paused through ``pauser``, a request through ``asker`` waits until ``continuer`` continues."""
    assert (await pauser.post("/pause_generation")).json() == {"paused": True}
    done = trio.Event()

    async def ask():
        r = await asker.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        with trio.move_on_after(1.0):
            await done.wait()
        assert not done.is_set()
        assert (await continuer.post("/continue_generation")).json() == {"paused": False}
        await done.wait()


async def test_pause_holds_new_requests_until_continue(server):
    await assert_held_until_continued(server, server, server)


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
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
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


async def test_official_openai_client(server):
    import openai

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

    whole, streamed, chat, chat_streamed = await trio.to_thread.run_sync(use_client)
    assert whole == streamed and chat == chat_streamed and chat

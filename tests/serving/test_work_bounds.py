"""Work per request is bounded and off the event loop (issue 29 N7): every input counts toward
"large" (tokenized in a thread), tool definitions and logprob counts are bounded, /tokenize and
/detokenize sit behind the overload gate and decode large inputs in a thread, grammar caches are
bounded by what they hold. Through real HTTP on the default topology (the tiny model): the status, a
bound on the wait, /health under 1 s meanwhile, and no restart after."""

from contextlib import AsyncExitStack

import httpx
import pytest
import trio

from serving.managers.grammar import GrammarCache
from serving.managers.inputs import LARGE_INPUT_CHARS, Expander, GenerateInput
from serving.managers.messages import SamplingParams

from .test_derived import answered, assert_nothing_left
from .test_hostile import health_latency_while
from .test_http import start_server

WAIT_S = 60


def test_every_input_counts_toward_a_large_request():
    """Only the text, message contents and the outer length of input_ids counted before."""
    small = GenerateInput(text="hi")
    assert not Expander.is_large(small)
    batched = GenerateInput(input_ids=[[5] * 5_000 for _ in range(4)])  # outer length 4, 20,000 ids
    regex = GenerateInput(text="hi", sampling_params=SamplingParams(regex="a" * (LARGE_INPUT_CHARS + 1)))
    tools = GenerateInput(messages=[{"role": "user", "content": "x"}],
                          tools=[{"type": "function", "function": {"name": "f", "description": "d" * 20_000}}])
    message = GenerateInput(messages=[{"role": "user", "content": "x", "name": "n" * 20_000}])
    stops = GenerateInput(text="hi", sampling_params=[SamplingParams(stop=["s" * 200] * 100)])
    for large in (batched, regex, tools, message, stops):
        assert Expander.is_large(large), large


def test_a_grammar_cache_is_bounded_by_the_characters_it_holds():
    cache = GrammarCache(max_chars=1_000)
    calls = []

    def compiled(text):
        calls.append(text)
        return text.upper()

    for i in range(10):
        text = f"{i}" * 200
        assert cache.get("regex", text, lambda: compiled(text)) == text.upper()
    assert cache.chars <= 1_000 and len(cache) == 2  # 405 characters each: the two most recent
    assert cache.get("regex", "9" * 200, lambda: compiled("never")) == "9" * 200  # a hit compiles nothing
    assert cache.get("regex", "x" * 2_000, lambda: compiled("x" * 2_000)) == "X" * 2_000  # too big to keep
    assert ("regex", "x" * 2_000) not in cache and len(cache) == 2


@pytest.mark.slow
async def test_work_per_request_is_bounded_and_off_the_event_loop(nursery):
    url, app = await start_server(nursery, "default", **{
        "model.dtype": "float32", "server.max_logprobs": 1_000,
        "scheduler.max_running_requests": 1, "scheduler.max_queued_requests": 1})
    runtime = app.state.server.runtime
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
        # /detokenize of a million ids: checked and decoded in a worker thread
        r = await answered(client, "/detokenize", {"tokens": [28] * 1_000_000})
        assert r.status_code == 200 and len(r.json()["prompt"]) >= 1_000_000, r.text[:200]
        r = await answered(client, "/detokenize", {"tokens": [28] * 100_000 + [10**6]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text[:300]
        # a batch of prompts whose ids together pass the context (only 4 prompts by the outer count)
        r = await answered(client, "/generate", {"input_ids": [[28] * 50_000 for _ in range(4)]})
        assert r.status_code == 400 and "context window" in r.json()["error"]["message"], r.text[:300]
        # n × max_tokens × (1 + top logprobs) is bounded (server.max_logprobs)
        r = await answered(client, "/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 100, "logprobs": 5})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "logprobs" and "server.max_logprobs" in error["message"], error
        r = await answered(client, "/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 20,
                                                 "sampling_params": {"max_new_tokens": 100}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs_num", r.text
        r = await answered(client, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "logprobs": True, "top_logprobs": 5})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert content and all(len(c["top_logprobs"]) == 5 for c in content), content
        token = content[0]["top_logprobs"][0]
        assert bytes(token["bytes"]).decode() == token["token"], token
        # tool definitions are bounded in number and size, before any schema compiles
        tool = {"type": "function", "function": {"name": "f", "description": "d" * 20_000,
                                                 "parameters": {"type": "object"}}}
        many = [{**tool, "function": {**tool["function"], "name": f"f{i}"}} for i in range(60)]
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        r = await answered(client, "/v1/chat/completions", {**chat, "tools": many})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text[:300]
        r = await answered(client, "/generate", {"messages": chat["messages"], "tools": many * 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text[:300]
        assert "at most 128" in r.json()["error"]["message"]
        # /tokenize and /detokenize are behind the overload gate (2 in flight: the bound here). Two long
        # requests hold it; a probe counts only if both still held it when its answer came. A holder can
        # end first (a fast host finishes it; a loaded one refuses it, its event loop late): then the
        # probe is tried again with new holders, once the gate has drained
        long = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [28]})):
            r = None
            for _ in range(5):
                ended = []

                async def hold():
                    ended.append((await client.post("/generate", json=long)).status_code)

                async with trio.open_nursery() as inner:
                    for _ in range(2):
                        inner.start_soon(hold)
                    with trio.fail_after(WAIT_S):
                        while runtime.gate.readers < 2 and not ended:
                            await trio.sleep(0.01)
                    if not ended:
                        r = await answered(client, path, body)
                    held = not ended and runtime.gate.readers >= 2
                    inner.cancel_scope.cancel()
                with trio.fail_after(WAIT_S):
                    while (runtime.tokenizer_manager.rid_to_state or runtime.gate.readers
                           or (await client.get("/server_info")).json()["running"]):
                        await trio.sleep(0.02)
                if r is not None and (held or r.status_code == 503):
                    break
            assert r is not None, (path, "no try had both holders in flight", ended)
            assert r.status_code == 503 and r.headers["retry-after"], (path, r.text)
            assert "overloaded" in r.json()["error"]["message"], r.text
        assert (await client.post("/tokenize", json={"prompt": "hi"})).status_code == 200
        await assert_nothing_left(client, runtime)


async def _partial_upload(port: int, declared: int, sent: int) -> trio.SocketStream:
    """A connection whose POST /generate declares ``declared`` bytes and has sent ``sent`` so far."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"POST /generate HTTP/1.1\r\nhost: tercet\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % declared + b" " * sent)
    return stream


async def posted(client, body: bytes):
    """POST /generate of raw ``body`` (within ``WAIT_S``), /health under 1 s meanwhile."""
    with trio.fail_after(WAIT_S):
        slowest, r = await health_latency_while(client, lambda: client.post("/generate", content=body))
    assert slowest < 1.0, slowest
    return r


async def _status_line(stream: trio.SocketStream) -> bytes:
    data = b""
    while b"\r\n" not in data:
        part = await stream.receive_some(4096)
        assert part, data
        data += part
    return data.split(b"\r\n", 1)[0]


@pytest.mark.slow
async def test_bodies_read_at_once_are_bounded_and_a_slow_upload_times_out(nursery):
    url, app = await start_server(nursery, "default", **{
        "model.dtype": "float32", "server.max_request_bytes": "48KiB", "server.max_body_bytes_in_flight": "64KiB",
        "server.body_timeout": 3.0})
    runtime = app.state.server.runtime
    port = int(url.rsplit(":", 1)[1])
    async with AsyncExitStack() as held:
        client = await held.enter_async_context(httpx.AsyncClient(base_url=url, timeout=WAIT_S))
        body = b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}' + b" " * 40_000
        slow = await _partial_upload(port, 45_000, 40_000)  # holds 40 KB of the 64 KiB being read
        held.callback(slow.socket.close)
        with trio.fail_after(WAIT_S):
            while app.state.body_budget.used < 40_000:
                await trio.sleep(0.01)
        r = await posted(client, body)
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert "server.max_body_bytes_in_flight" in r.json()["error"]["message"], r.text
        # the slow upload ends with 408 at server.body_timeout, and gives its bytes back
        with trio.fail_after(WAIT_S):
            assert await _status_line(slow) == b"HTTP/1.1 408 ", "no 408"
        assert app.state.body_budget.used == 0
        r = await posted(client, body)
        assert r.status_code == 200, r.text
        # a prompt of ids longer than the context window is refused by the decoder
        context = await app.state.server.context_len()
        r = await answered(client, "/generate", {"input_ids": [28] * (context + 1)})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "input_ids" and "context window" in error["message"], error
        r = await answered(client, "/generate", {"input_ids": [[28], [28] * (context + 1)]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids[1]", r.text
        await assert_nothing_left(client, runtime)


@pytest.mark.slow
async def test_generate_with_messages_and_malformed_tools_is_a_400(nursery):
    """Issue 29 N14: /generate's messages with tools were rendered unchecked (a KeyError, a JSONDecodeError: 500)."""
    url, app = await start_server(nursery, "default", **{"model.dtype": "float32"})
    runtime = app.state.server.runtime
    user = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad_call = [*user, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]
    cases = [({"messages": user, "tools": [{}]}, "tools[0]"),
             ({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
              "tools[0]"),
             ({"messages": bad_call, "tools": [tool]}, "messages[1].tool_calls"),
             ({"messages": [{"content": "x"}], "tools": [tool]}, "messages[0].role")]
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
        for body, param in cases:
            r = await answered(client, "/generate", {**body, "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        r = await answered(client, "/generate", {"messages": user, "tools": [tool],
                                                 "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        await assert_nothing_left(client, runtime)

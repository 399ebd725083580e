"""A tool call identical to one already made in the same answer ends the calls there (issue 32): it is
dropped, the rest of the generation is aborted, and the answer finishes with ``tool_calls``. On its own
(parser, stream, responder) and on the embedded SmolLM2, which repeats its calls until max_tokens."""

import json

import httpx
import pytest
import trio

from serving.http.openai_api import Responder
from serving.managers.messages import FinishReason
from serving.managers.tokenizer_manager import Chunk
from serving.managers.tools import ToolStream, parse_answer

from .test_http import sse_events, start_server
from .test_tools import ASK, TIME, WEATHER, valid_call


def call(name, arguments, layout=""):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>\n{layout}'


WEATHER_PARIS = call("get_weather", '{"city": "Paris", "unit": "C"}')
TIME_UTC = call("get_time", '{"zone": "UTC"}')
# the same call as WEATHER_PARIS: its arguments in another order and layout
AGAIN = call("get_weather", '{"unit":"C",  "city":"Paris"}')
ANSWER = WEATHER_PARIS + TIME_UTC + AGAIN + TIME_UTC + "and more text"


def test_the_parser_stops_at_the_first_repeated_call():
    answer = parse_answer(ANSWER)
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "UTC"})]
    assert answer.repeated and answer.content is None
    other = parse_answer(WEATHER_PARIS + call("get_weather", '{"city": "Oslo", "unit": "C"}'))
    assert len(other.calls) == 2 and not other.repeated  # other arguments: another call


@pytest.mark.parametrize("size", [1, 3, 16, len(ANSWER)])
def test_the_stream_drops_the_repeat_and_all_after_it(size):
    stream, content, heads = ToolStream(), "", []
    for i in range(0, len(ANSWER), size):
        text, deltas = stream.feed(ANSWER[i:i + size])
        content += text
        heads += [d["function"]["name"] for d in deltas if "id" in d]
    text, deltas = stream.feed("", final=True)
    assert heads == ["get_weather", "get_time"] and stream.repeated and not (content + text) and not deltas


def chunk(text, finished=None, index=0, completion=1):
    return Chunk(index, f"r{index}", text, [], finished, 5, completion, 0)


def test_the_responder_ends_a_choice_at_a_repeat_streamed_and_whole():
    responder = Responder("chat", "m", None, 2, tools=True)
    parts = [WEATHER_PARIS, TIME_UTC + AGAIN[:10], AGAIN[10:] + "x", "more"]
    ends = [responder.ends(chunk(p)) for p in parts]
    assert ends == [False, False, True, False]  # said once: the route aborts the rest then
    events = [responder.stream_chunk(chunk(p)) for p in parts]
    aborted = responder.stream_chunk(chunk("", FinishReason("abort", message="the answer was complete")))
    assert [e["choices"][0]["finish_reason"] for e in events[:3]] == [None, None, "tool_calls"]
    assert events[3] is None and aborted is None  # nothing after the finish
    other = responder.stream_chunk(chunk(WEATHER_PARIS, FinishReason("stop"), index=1))  # choices are apart
    assert other["choices"][0]["finish_reason"] == "tool_calls"
    for finished in (FinishReason("abort", message="the answer was complete"), FinishReason("length")):
        folded = {"text": ANSWER, "output_ids": [], "finished": finished, "prompt_tokens": 5,
                  "completion_tokens": 50, "cached_tokens": 0, "logprobs": [], "top_logprobs": []}
        choice = Responder("chat", "m", None, 1, tools=True).whole([folded])["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 2


@pytest.mark.slow
async def test_smollm2_required_parallel_calls_end_at_a_repeat_streamed_and_not(nursery):
    url, _ = await start_server(nursery, **{"model.path": None})
    body = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 200,
            "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        with trio.fail_after(600):
            whole = (await client.post("/v1/chat/completions", json=body)).json()
            streamed = await client.post("/v1/chat/completions",
                                         json={**body, "stream": True, "stream_options": {"include_usage": True}})
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    keys = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert calls and all(valid_call(c) is None for c in calls) and all(k not in keys[:i] for i, k in enumerate(keys))
    assert whole["usage"]["completion_tokens"] < 200, whole["usage"]  # its generation stopped there
    events = sse_events(streamed.text)
    reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert reasons[-1] == "tool_calls" and reasons.count("tool_calls") == 1, reasons
    deltas = [d for e in events if e["choices"] for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [(d["function"]["name"], json.loads(a["function"]["arguments"]))
            for d, a in zip(deltas[::2], deltas[1::2])] == keys  # greedy: the same calls, streamed
    assert events[-1]["usage"]["completion_tokens"] < 200

"""``--reasoning-parser``: the think block split into reasoning_content, whole and streamed, on a fake
token stream (any split of the text streams to the same answer), and through HTTP (the wiring)."""

import json

import httpx
import pytest

from serving.http.answer import AnswerStream, take_apart
from serving.http.openai_api import Responder
from serving.managers.messages import FinishReason
from serving.managers.reasoning import ReasoningStream, split_reasoning
from serving.managers.tokenizer_manager import Chunk

from .test_http import sse_events, start_server

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'

CASES = [  # (parser, answer, reasoning, content)
    ("qwen3", "<think>\nWhat time is it?\n</think>\n\nIt is noon.", "What time is it?", "It is noon."),
    ("qwen3", "  <think>a < b</think>b", "a < b", "b"),
    ("qwen3", "It is noon.", None, "It is noon."),  # no think block at all
    ("qwen3", "<thin", None, "<thin"),  # looked like one, was not
    ("qwen3", "No <think>here</think>", None, "No <think>here</think>"),  # only at the start
    ("qwen3", "<think>ran out of tokens", "ran out of tokens", ""),
    ("qwen3", "", None, ""),
    ("deepseek-r1", "Let me think.\n</think>\n\nParis.", "Let me think.", "Paris."),  # started inside
    ("deepseek-r1", "<think>Let me think.</think>Paris.", "Let me think.", "Paris."),  # or wrote <think>
    ("deepseek-r1", "thinking, thinking", "thinking, thinking", ""),  # never closed: all reasoning
    ("deepseek-r1", "</think>Paris.", None, "Paris."),
    ("deepseek-r1", "a</thinking> </think>b </think>", "a</thinking>", "b </think>"),
]


def pieces(text, size):
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


@pytest.mark.parametrize("parser, answer, reasoning, content", CASES)
def test_the_parser_whole_and_streamed_in_any_pieces(parser, answer, reasoning, content):
    assert split_reasoning(answer, parser) == (reasoning, content)
    for size in (1, 2, 3, 7, len(answer) or 1):
        stream, thought, said = ReasoningStream(parser), "", ""
        parts = pieces(answer, size)
        for i, part in enumerate(parts):
            r, c = stream.feed(part, final=i == len(parts) - 1)
            thought, said = thought + r, said + c
        assert (thought or None, said) == (reasoning, content), size


def test_a_tool_call_inside_the_think_block_is_reasoning_and_one_after_it_a_call():
    answer = f"<think>I could write {CALL.strip()} here.</think>\n{CALL}"
    whole = take_apart(answer, reasoning="qwen3", tools=True)
    assert whole.reasoning.startswith("I could write <tool_call>") and whole.content is None
    assert [c.name for c in whole.calls] == ["get_time"]
    stream, thought, calls = AnswerStream(reasoning="qwen3", tools=True), "", []
    for i, part in enumerate(pieces(answer, 5)):
        r, _, deltas = stream.feed(part)
        thought, calls = thought + r, calls + deltas
    assert thought == whole.reasoning and [d["function"]["name"] for d in calls if "id" in d] == ["get_time"]


def chunks(text, size, finished):
    parts = pieces(text, size)
    return [Chunk(0, "r", part, [], finished if i == len(parts) - 1 else None, 5, i + 1, 0)
            for i, part in enumerate(parts)]


@pytest.mark.parametrize("size", [1, 4, 100])
def test_the_responder_streams_reasoning_content_deltas_and_answers_whole_alike(size):
    answer = "<think>\nThe user greets.\n</think>\n\nHello!"
    responder = Responder("chat", "m", None, 1, reasoning="qwen3")
    deltas = [c["choices"][0]["delta"] for chunk in chunks(answer, size, FinishReason("stop"))
              if (c := responder.stream_chunk(chunk)) is not None]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user greets."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"
    folded = {"text": answer, "output_ids": [], "finished": FinishReason("stop"), "prompt_tokens": 5,
              "completion_tokens": 9, "cached_tokens": 0, "logprobs": [], "top_logprobs": []}
    message = Responder("chat", "m", None, 1, reasoning="qwen3").whole([folded])["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets."}


@pytest.fixture
async def r1(nursery):
    url, _ = await start_server(nursery, **{"server.reasoning_parser": "deepseek-r1"})
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        yield client


async def test_http_a_deepseek_r1_answer_that_never_closes_its_think_block_is_all_reasoning(r1):
    """The tiny random model never writes </think>: with deepseek-r1 its whole answer is reasoning."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    message = (await r1.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] == "", message
    r = await r1.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(r.text) if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert not "".join(d.get("content") or "" for d in deltas)
    plain = (await r1.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})).json()
    assert "reasoning_content" not in json.dumps(plain)  # completions are not chat: nothing is split


async def test_http_structured_output_with_a_reasoning_parser_is_a_400_naming_it(r1):
    for extra, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"guided_regex": "[a-z]+"}, "guided_regex")):
        r = await r1.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "reasoning parser" in r.json()["error"]["message"]

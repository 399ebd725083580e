"""``--reasoning-parser``: the think block split into reasoning_content, whole and streamed, on a fake
token stream (any split of the text streams to the same answer), and through HTTP (the wiring)."""

import json

import httpx
import llguidance
import llguidance.hf
import msgspec
import pytest

from serving.http.answer import AnswerStream, take_apart
from serving.http.openai_api import ChatRequest, Responder, chat_input, thinking_first
from serving.managers.messages import FinishReason
from serving.managers.reasoning import ReasoningStream, split_reasoning, think_first
from serving.managers.tokenizer_manager import Chunk, InvalidRequest
from serving.managers.tools import call_grammar

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


SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
CALL_TEXT = '<tool_call>\n{"name":"get_time","arguments":{"zone":"UTC"}}\n</tool_call>\n'


@pytest.fixture(scope="module")
def accepts(tokenizer):
    """accepts(grammar, text): whether llguidance's matcher takes all of ``text`` and may end there."""
    lg = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(lark, text):
        matcher = llguidance.LLMatcher(lg, llguidance.LLMatcher.grammar_from_lark(lark))
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    return accepts


@pytest.mark.parametrize("kind, text, parser, answer, ok", [
    ("json_schema", SCHEMA, "qwen3", '<think>\nmaybe {"a": "x"}</think>\n\n{"a":1}', True),  # JSON inside: free
    ("json_schema", SCHEMA, "qwen3", '{"a":1}', True),  # no think block
    ("json_schema", SCHEMA, "qwen3", 'text{"a":1}', False),
    ("json_schema", SCHEMA, "qwen3", '<think>x</think>{"a":"s"}', False),  # the schema holds after it
    ("json_schema", SCHEMA, "deepseek-r1", 'maybe</think>\n{"a":1}', True),  # started inside the block
    ("json_schema", SCHEMA, "deepseek-r1", '<think>maybe</think>{"a":1}', True),
    ("json_schema", SCHEMA, "deepseek-r1", '{"a":1}', False),  # the block must close first
    ("regex", "[a-z/]+", "qwen3", "<think>ok</think> ab/c", True),
    ("regex", "[a-z/]+", "qwen3", "AB", False),
    ("grammar", 'start: "yes" | "no"', "deepseek-r1", "hmm</think>\nyes", True),
    ("grammar", call_grammar([TIME]), "qwen3", "<think>a call?</think>\n" + CALL_TEXT, True),
    ("grammar", call_grammar([TIME]), "qwen3", CALL_TEXT, True),
])
def test_a_constraint_binds_the_answer_after_the_think_block(accepts, kind, text, parser, answer, ok):
    assert accepts(think_first(kind, text, parser), answer) is ok


def test_a_chat_requests_constraint_moves_after_the_think_block_and_an_ebnf_one_is_refused():
    req = msgspec.convert({"messages": [{"role": "user", "content": "Hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"schema": json.loads(SCHEMA)}}}, ChatRequest)
    sampling = thinking_first(chat_input(req), "deepseek-r1", req.structured_param()).sampling_params
    assert sampling.json_schema is None and sampling.grammar == think_first("json_schema", SCHEMA, "deepseek-r1")
    req = msgspec.convert({"messages": [{"role": "user", "content": "Hi"}], "tools": [TIME],
                           "tool_choice": "auto"}, ChatRequest)
    obj = chat_input(req)
    assert thinking_first(obj, "qwen3", None) is obj  # auto: free text (a think block too) comes first
    req = msgspec.convert({"messages": [{"role": "user", "content": "Hi"}], "guided_grammar": 'root ::= "a"'},
                          ChatRequest)
    with pytest.raises(InvalidRequest, match=r"^guided_grammar: .*reasoning parser \(qwen3\)"):
        thinking_first(chat_input(req), "qwen3", req.structured_param())


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


async def test_http_a_constraint_binds_what_follows_the_think_block_and_a_grammar_is_a_400(r1, tokenizer):
    """With deepseek-r1 the answer starts inside the think block: a choice of "yes" binds only what follows
    its </think> (alone, the constraint would make the answer "yes" at once). The tiny model writes text
    the think-first grammar allows; the grammar itself is checked above."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0, "logprobs": True,
            "guided_choice": ["yes"]}
    r = await r1.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    raw = bytes(b for t in choice["logprobs"]["content"] for b in t["bytes"]).decode()
    assert raw != "yes" and choice["message"]["reasoning_content"], choice
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(
        think_first("grammar", 'start: "yes"', "deepseek-r1")))
    assert matcher.consume_tokens(tokenizer.encode(raw, add_special_tokens=False)) and not matcher.is_error()
    for extra, param in (({"structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs"),
                         ({"guided_grammar": 'root ::= "a"'}, "guided_grammar")):
        r = await r1.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "reasoning parser" in r.json()["error"]["message"]


def test_the_flag_and_the_topology_field(tmp_path):
    from serving.cli import parser, topology_from
    from serving.runtime.topology import TopologyError, load_topology

    assert topology_from(parser().parse_args(["serve", "--reasoning-parser", "deepseek-r1"]), {}) \
        .server.reasoning_parser == "deepseek-r1"
    assert load_topology().server.reasoning_parser is None  # off unless asked for
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  reasoning_parser: qwen4\n")
    with pytest.raises(TopologyError, match=r"bad.yaml:2: server.reasoning_parser: .*'qwen4'"):
        load_topology(bad)

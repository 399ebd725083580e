"""Tool calling through the OpenAI routes (Hermes format on a template that ignores tools): enforced
calls with `required` and a named function, streaming accumulated as the official client does it,
a round trip with a `tool` message, and the parser on its own."""

import json

import httpx
import jsonschema
import pytest
import trio

import llguidance
import llguidance.hf

from models.loading import load_tokenizer
from serving.managers.grammar import compile_grammar
from serving.managers.tools import ToolStream, auto_grammar, call_grammar, hermes_messages, parse

from .test_http import sse_events, start_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                   "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                              "enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_call(call, tools=(WEATHER, TIME)):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call["type"] == "function" and call["id"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), by_name[call["function"]["name"]])


@pytest.fixture
async def client(nursery):
    url, _ = await start_server(nursery, **{"model.dtype": "float32"})
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        yield c


async def test_required_and_named_calls_are_valid_calls(client):
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER, TIME],
                                                        "tool_choice": "required", "max_tokens": 120,
                                                        "temperature": 0})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["tool_calls"] and all(valid_call(c) is None for c in choice["message"]["tool_calls"])
    r = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER, TIME], "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0.8,
        "seed": 3, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    valid_call(calls[0])


async def test_a_streamed_call_accumulates_as_the_official_client_does(client):
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                                                        "max_tokens": 120, "temperature": 0, "stream": True})
    calls, content, finish = {}, "", None
    for event in sse_events(r.text):
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for part in delta.get("tool_calls") or []:  # the official client's accumulation
                call = calls.setdefault(part["index"], {"id": None, "type": None, "function": {"name": "",
                                                                                              "arguments": ""}})
                call["id"] = part.get("id") or call["id"]
                call["type"] = part.get("type") or call["type"]
                call["function"]["name"] += part.get("function", {}).get("name") or ""
                call["function"]["arguments"] += part.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    assert finish == "tool_calls" and calls and content.strip() == ""
    for call in calls.values():
        valid_call(call)


async def test_a_round_trip_with_a_tool_message_and_the_official_client(client):
    import openai

    def use_client():
        api = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="none")
        first = api.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required",
                                            max_tokens=120, temperature=0)
        call = first.choices[0].message.tool_calls[0]
        history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
        second = api.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], tool_choice="none",
                                             max_tokens=8, temperature=0)
        return call, second

    call, second = await trio.to_thread.run_sync(use_client)
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert second.choices[0].message.tool_calls is None and second.usage.prompt_tokens > 0


def test_the_hermes_parser_and_stream_on_their_own():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n' \
           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    content, calls = parse(text)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "C"}
    assert parse("no calls <tool_call>not json</tool_call>") == ("no calls <tool_call>not json</tool_call>", [])
    stream, sent, deltas = ToolStream(), "", []
    for i in range(0, len(text), 3):  # any split of the text
        more, new = stream.feed(text[i:i + 3])
        sent += more
        deltas += new
    more, new = stream.feed("", final=True)
    assert sent + more == "Let me check.\n" and [d.get("function", {}).get("name") for d in deltas[::2]] == \
        ["get_weather", "get_time"]
    assert json.loads(deltas[1]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    rendered = hermes_messages([{"role": "system", "content": "Be brief."}, *ASK,
                                {"role": "assistant", "content": None, "tool_calls": [
                                    {"id": "x", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                                {"role": "tool", "tool_call_id": "x", "content": "21"}], [WEATHER])
    assert rendered[0]["content"].startswith("Be brief.") and "<tools>" in rendered[0]["content"]
    assert "<tool_call>" in rendered[2]["content"] and rendered[3]["content"].startswith("<tool_response>")
    assert "call+" in call_grammar([WEATHER]) and "call\n" in call_grammar([WEATHER], parallel=False)


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_leaves_text_free_but_holds_a_started_call_to_the_schemas(parallel):
    tokenizer = load_tokenizer(None)  # the embedded SmolLM2's
    grammar = compile_grammar("grammar", auto_grammar([WEATHER, TIME], parallel))
    lltok = llguidance.hf.from_tokenizer(tokenizer)

    def outcome(text):
        matcher = llguidance.LLMatcher(lltok, grammar)
        matcher.consume_tokens(tokenizer(text, add_special_tokens=False).input_ids)
        return "refused" if matcher.is_error() else "may end" if matcher.is_accepting() else "must go on"

    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","unit":"C"}}\n</tool_call>\n'
    assert outcome("It is sunny in Paris, no tool needed.") == "may end"
    assert outcome("Let me check. " + call) == "may end"
    assert outcome('Let me check. <tool_call>\n{"name":"get_weather","argu') == "must go on"  # no EOS mid-call
    assert outcome('Let me check. <tool_call>\n{"name":"get_news","arguments":{}}') == "refused"
    assert outcome('<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome","unit":"C"}}') == "refused"
    second = call.replace("get_weather", "get_time").replace('"city":"Oslo","unit":"C"', '"zone":"UTC"')
    assert outcome(call + "and " + second) == ("may end" if parallel else "refused")


async def test_auto_with_an_invalid_parameter_schema_is_a_400(client):
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}
    r = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "tools": [broken],
                                                        "max_tokens": 4})
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"], r.text

"""Constrained decoding through the server: regexes, JSON schemas (SGLang's and OpenAI's forms),
grammars and choices; batched beside unconstrained requests; through retract and a crash resume."""

import json
import os
import re
import signal

import httpx
import jsonschema
import pytest
import trio

from serving.runtime.engine import open_engine

from .test_http import sse_events, start_server
from .test_recovery import RECOVERY, run_all, scheduler_pid

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9},
                                           "tag": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
GREEDY = {"max_new_tokens": 40, "temperature": 0.0}


async def test_constrained_and_free_requests_share_a_step_and_keep_their_own_outputs():
    async with open_engine("tiny", dtype="float32") as engine:
        free = await engine.generate([[5, 6, 7], [8, 9]], {**GREEDY, "ignore_eos": True, "max_new_tokens": 12})
        obj = {"input_ids": [[5, 6, 7], [8, 9], [10, 11], [12, 13]], "sampling_params": [
            {**GREEDY, "ignore_eos": True, "max_new_tokens": 12}, {**GREEDY, "ignore_eos": True, "max_new_tokens": 12},
            {**GREEDY, "regex": REGEX}, {**GREEDY, "json_schema": json.dumps(SCHEMA)}]}
        from serving.managers.tokenizer_manager import GenerateInput
        import msgspec

        chunks = {}
        async for chunk in engine.stream(msgspec.convert(obj, GenerateInput)):
            chunks.setdefault(chunk.index, []).append(chunk)
        from serving.managers.tokenizer_manager import fold

        out = [fold(chunks[i]) for i in range(4)]
    assert [o["output_ids"] for o in out[:2]] == [r["output_ids"] for r in free]  # the masks touch no one else
    assert re.fullmatch(REGEX, out[2]["text"]) and out[2]["finished"].type == "stop"
    jsonschema.validate(json.loads(out[3]["text"]), SCHEMA)
    assert out[3]["finished"].type == "stop"


async def test_sglang_and_openai_forms_through_http(server_tiny):
    client = server_tiny
    r = await client.post("/generate", json={"text": "Phone:", "sampling_params": {**GREEDY, "regex": REGEX}})
    assert re.fullmatch(REGEX, r.json()["text"]), r.text
    r = await client.post("/generate", json={"text": "x", "sampling_params": {**GREEDY, "ebnf": 'root ::= "yes" | "no"'}})
    assert r.json()["text"] in ("yes", "no")
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Give me JSON"}], "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_object"}})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"].startswith("{")
    if choice["finish_reason"] == "stop":  # (the random model may write one long string: then "length")
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["finish_reason"] == "length"
    r = await client.post("/v1/completions", json={"prompt": "Colour:", "max_tokens": 10, "temperature": 0.8,
                                                   "seed": 1, "structured_outputs": {"choice": ["red", "blue"]}})
    assert r.json()["choices"][0]["text"] in ("red", "blue")
    r = await client.post("/v1/completions", json={"prompt": "n", "max_tokens": 10, "guided_regex": "[ab]{3}"})
    assert re.fullmatch("[ab]{3}", r.json()["choices"][0]["text"])
    # streamed: the deltas concatenate to the valid document
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "stream JSON"}], "max_tokens": 60, "temperature": 0, "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(r.text) if e["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(("body", "param"), [
    ({"text": "x", "sampling_params": {"regex": "([0-9"}}, "sampling_params.regex"),
    ({"text": "x", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
    ({"text": "x", "sampling_params": {"json_schema": '{"type": "nonsense"}'}}, "sampling_params.json_schema"),
    ({"text": "x", "sampling_params": {"ebnf": "root ::= undefined_rule"}}, "sampling_params.ebnf"),
    ({"text": "x", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "sampling_params.regex"),
    ({"text": "x", "sampling_params": {"logit_bias": {"a": 1}}}, "sampling_params.logit_bias"),
    ({"text": "x", "sampling_params": {"logit_bias": {"999999": 1}}}, "sampling_params.logit_bias"),
])
async def test_an_invalid_constraint_is_a_400_naming_it(server_tiny, body, param):
    r = await server_tiny.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_logit_bias_steers_the_output(server_tiny):
    r = await server_tiny.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0,
                                                        "logit_bias": {"1234": 100}})
    assert r.json()["choices"][0]["text"] == server_tiny.tokenizer.decode([1234] * 5)
    r = await server_tiny.post("/generate", json={"text": "Hello", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0, "logit_bias": {"4321": 100}}})
    assert r.json()["output_ids"] == [4321] * 3


async def test_constrained_requests_stay_valid_through_retract(tiny_loaded):
    config = tiny_loaded.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    three = {"type": "array", "items": SCHEMA, "minItems": 3, "maxItems": 3}  # ~60 tokens each
    async with open_engine("tiny", dtype="float32", kv_budget_bytes=per_token * 128) as engine:
        results = await engine.generate([[20 + i, 21] for i in range(6)],
                                        {"max_new_tokens": 120, "temperature": 0.7, "seed": 4,
                                         "json_schema": json.dumps(three)})
        info = await engine.tokenizer_manager.call_scheduler(__import__("serving.managers.messages",
                                                                        fromlist=["x"]).ServerInfoReq())
    for r in results:
        jsonschema.validate(json.loads(r["text"]), three)
    assert info.retracted > 0


@pytest.mark.slow  # kills the scheduler of a real server
async def test_json_schema_streams_stay_valid_through_a_scheduler_kill(nursery):
    """8 json_schema streams (sampled: the grammar keeps choosing), the scheduler killed mid-way:
    all 8 complete and parse, and equal a fault-free run (the resumed matchers replayed)."""
    url, app = await start_server(nursery, "default", **RECOVERY)
    long_schema = {"type": "object", "properties": {"items": {"type": "array", "minItems": 6, "maxItems": 6,
                                                              "items": SCHEMA}},
                   "required": ["items"], "additionalProperties": False}
    bodies = [{"input_ids": [30 + i, 31, 32], "rid": f"json-{i}", "sampling_params": {
        "max_new_tokens": 300, "temperature": 0.9, "seed": i, "json_schema": json.dumps(long_schema)}}
        for i in range(8)]
    tm = app.state.server.runtime.tokenizer_manager
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        fault_free, texts = {}, {}
        await run_all(client, bodies, True, fault_free)
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, [{**b, "rid": b["rid"] + "-k"} for b in bodies], True, texts)
            with trio.fail_after(120):
                while sum(len(s.output_ids) for s in tm.rid_to_state.values()) < 8 * 20:
                    await trio.sleep(0.005)
            os.kill(scheduler_pid(app), signal.SIGKILL)
    for text, _ in texts.values():
        jsonschema.validate(json.loads(text), long_schema)
    assert {rid.removesuffix("-k"): v for rid, v in texts.items()} == fault_free
    assert app.state.server.runtime.status.restarts["scheduler"] == 1


@pytest.fixture
async def server_tiny(nursery):
    url, app = await start_server(nursery, **{"model.dtype": "float32"})
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        client.tokenizer = app.state.server.runtime.tokenizer
        yield client


async def test_tokenize_and_detokenize_in_vllm_shapes(server_tiny):
    client = server_tiny
    r = await client.post("/tokenize", json={"prompt": "Hello world"})
    body = r.json()
    assert body["tokens"] == client.tokenizer("Hello world", add_special_tokens=False).input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096
    r = await client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    chat = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    rendered = client.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                                    tokenize=False)
    assert chat.json()["tokens"] == client.tokenizer(rendered, add_special_tokens=False).input_ids
    # and they are what generation counts as the prompt
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == chat.json()["count"]
    for bad, param in (({"prompt": "x", "messages": []}, "prompt"), ({}, "prompt"),
                       ({"tokens": [10**7]}, "tokens")):
        r = await client.post("/detokenize" if "tokens" in bad else "/tokenize", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.slow
async def test_smollm2_structured_output_and_tools_through_the_official_client(nursery):
    """The embedded SmolLM2: parse() into a Pydantic model, JSON mode, a regex, a streamed schema, a tool call."""
    import openai
    import pydantic

    url, _ = await start_server(nursery, **{"model.path": None})

    class City(pydantic.BaseModel):  # bounded: a 135M model, greedy, can write digits forever
        name: str = pydantic.Field(max_length=40)
        country: str = pydantic.Field(max_length=40)
        population_millions: int = pydantic.Field(ge=0, le=100)

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

    def use_client():
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        parsed = api.chat.completions.parse(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            response_format=City, max_tokens=300, temperature=0)
        mode = api.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Give a JSON object about cats."}],
            response_format={"type": "json_object"}, max_tokens=120, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Describe Oslo as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema()}},
            max_tokens=300, temperature=0, stream=True) if c.choices)
        call = api.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What's the weather in Rome?"}],
            tools=[weather], tool_choice="required", max_tokens=60, temperature=0)
        return parsed, mode, streamed, call

    parsed, mode, streamed, call = await trio.to_thread.run_sync(use_client)
    assert isinstance(parsed.choices[0].message.parsed, City), parsed
    if mode.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(mode.choices[0].message.content), dict)
    City.model_validate_json(streamed)
    tool_call = call.choices[0].message.tool_calls[0]
    assert tool_call.function.name == "get_weather" and "city" in json.loads(tool_call.function.arguments)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/generate", json={"text": "My phone number is", "sampling_params": {
            "max_new_tokens": 20, "temperature": 0, "regex": r"\+[0-9]{2} [0-9]{3} [0-9]{4}"}})
        assert re.fullmatch(r"\+[0-9]{2} [0-9]{3} [0-9]{4}", r.json()["text"]), r.text

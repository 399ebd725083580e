"""The OpenAI-compatible protocol: requests in, responses and stream chunks out.

Requests are msgspec structs with bounded fields; a wrong type or an
out-of-range value is a 400 naming the field (``param``). An unknown field
is a 400 too, and so is an OpenAI parameter this server does not implement
(``NOT_IMPLEMENTED``): nothing a client asks for is silently ignored.
SGLang/vLLM extensions (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, skip_special_tokens, no_stop_trim) are accepted.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from ..managers.messages import (
    Constraint,
    Count,
    LogitBias,
    FinishReason,
    Int64,
    MinP,
    NumSamples,
    Penalty,
    RepetitionPenalty,
    RequestId,
    SamplingParams,
    StopString,
    Temperature,
    TokenId,
    TopK,
    TopLogprobs,
    TopP,
)
from ..managers.grammar import GrammarError, constraint_of
from ..managers.inputs import check_tools, checked_grammar
from ..managers.reasoning import think_first
from ..managers.tokenizer_manager import Chunk, GenerateInput, InvalidRequest
from ..managers.tools import auto_grammar, call_grammar, valid_calls
from .answer import AnswerStream, take_apart

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "chat_input",
    "completion_input",
    "finish_reason",
    "thinking_first",
]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


# OpenAI parameters this server does not implement: refused with a 400 naming them,
# never ignored (a client asking for JSON or tools and getting prose is worse off).
NOT_IMPLEMENTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio",
                   "modalities", "prediction", "web_search_options", "reasoning_effort", "best_of")


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    name: str = "response"
    schema: dict[str, Any] | bool = True
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's ``response_format``: text, JSON mode, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` (one of them)."""

    json: dict[str, Any] | str | None = None
    regex: Constraint | None = None
    choice: list[Constraint] | None = None
    grammar: Constraint | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=True):
    unimplemented: ClassVar[tuple[str, ...]] = NOT_IMPLEMENTED
    model: str | None = None
    max_tokens: Count | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: NumSamples = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Int64 | None = None
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # extensions, as SGLang and vLLM accept them
    top_k: TopK = -1
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    min_tokens: Count = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: RequestId | None = None
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's, and its older guided_* names
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Constraint | None = None
    guided_choice: list[Constraint] | None = None
    guided_grammar: Constraint | None = None
    # named so that they are refused by name (see NOT_IMPLEMENTED)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    best_of: Any = None

    def refuse_unimplemented(self) -> None:
        for name in self.unimplemented:
            value = getattr(self, name)
            harmless = (value is None or value == [] or value == {} or (name == "best_of" and value == 1)
                        or (name == "parallel_tool_calls" and not self.tools))
            if not harmless:
                raise InvalidRequest(f"{name}: not supported by this server")

    def sampling(self, max_new_tokens: int | None) -> SamplingParams:
        """``max_new_tokens`` None: up to the context window."""
        self.refuse_unimplemented()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            no_stop_trim=self.no_stop_trim, n=self.n, logit_bias=self.logit_bias or None,
            **self.constraint(),
        )

    def structured_param(self) -> str | None:
        """The parameter that asks for structured output (a JSON schema, a regex, a grammar, choices), if any."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        so = self.structured_outputs
        if so is not None and any(v is not None for v in (so.json, so.regex, so.choice, so.grammar)):
            return "structured_outputs"
        return next((name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                     if getattr(self, name) is not None), None)

    def constraint(self) -> dict[str, str]:
        """The one constraint asked for, as SamplingParams fields (json_schema / regex / grammar)."""
        asked: list[tuple[str, dict[str, str]]] = []
        f = self.response_format
        if f is not None and f.type == "json_object":
            asked.append(("response_format", {"json_schema": '{"type": "object"}'}))
        elif f is not None and f.type == "json_schema":
            if f.json_schema is None:
                raise InvalidRequest("response_format.json_schema: required with type json_schema")
            asked.append(("response_format", {"json_schema": json.dumps(f.json_schema.schema)}))
        so = self.structured_outputs or StructuredOutputs()
        for name, value in (("json", so.json if so.json is not None else self.guided_json),
                            ("regex", so.regex or self.guided_regex), ("choice", so.choice or self.guided_choice),
                            ("grammar", so.grammar or self.guided_grammar)):
            if value is None:
                continue
            if name == "json":
                asked.append((name, {"json_schema": value if isinstance(value, str) else json.dumps(value)}))
            elif name == "regex":
                asked.append((name, {"regex": value}))
            elif name == "choice":
                if not value:
                    raise InvalidRequest("structured_outputs.choice: give at least one choice")
                asked.append((name, {"grammar": "start: " + " | ".join(json.dumps(c) for c in value)}))
            else:
                asked.append((name, {"ebnf": value}))
        if len(asked) > 1:
            raise InvalidRequest(f"{asked[1][0]}: only one of response_format and structured outputs at a time")
        return asked[0][1] if asked else {}


class CompletionRequest(_Common):
    prompt: str | list[str | TokenId | list[TokenId]] = ""  # text, texts, token ids, or lists of them
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None


FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName


class ToolChoiceFunction(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Common):
    unimplemented: ClassVar[tuple[str, ...]] = tuple(
        n for n in NOT_IMPLEMENTED if n not in ("tools", "tool_choice", "parallel_tool_calls"))
    messages: list[dict[str, Any]] = []
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs = 0
    tools: Annotated[list[Tool], msgspec.Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True

    def tool_use(self) -> tuple[list[dict[str, Any]] | None, str | None]:
        """(the tools the model sees, the lark grammar that enforces a call) from tools and tool_choice."""
        tools = [msgspec.to_builtins(t) for t in self.tools or []]
        check_tools(tools)  # before compiling each one's schema
        choice = self.tool_choice or ("auto" if tools else "none")
        if choice == "none" or not tools:
            if choice not in ("none", "auto"):
                raise InvalidRequest("tool_choice: there are no tools to call")
            return None, None
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise InvalidRequest("tools: two tools have the same name")
        only = None
        if isinstance(choice, ToolChoiceFunction):
            only = choice.function.name
            if only not in names:
                raise InvalidRequest(f"tool_choice: no tool named {only!r}")
        for t in tools:
            if t["function"].get("parameters") is not None:
                try:
                    checked_grammar("json_schema", json.dumps(t["function"]["parameters"]))
                except GrammarError as exc:
                    raise InvalidRequest(f"tools: the parameters of {t['function']['name']}: {exc}") from None
        if choice == "auto":
            return tools, auto_grammar(tools, self.parallel_tool_calls)
        return tools, call_grammar(tools, only, self.parallel_tool_calls)


def completion_input(req: CompletionRequest) -> GenerateInput:
    if req.echo:
        raise InvalidRequest("echo: not supported")
    if req.suffix:
        raise InvalidRequest("suffix: not supported")
    prompt = req.prompt
    if prompt == "" or prompt == []:
        raise InvalidRequest("prompt: must not be empty")
    sampling = req.sampling(req.max_tokens if req.max_tokens is not None else 16)  # OpenAI's default
    common = dict(sampling_params=sampling, stream=req.stream, rid=req.rid,
                  return_logprob=req.logprobs is not None, top_logprobs_num=req.logprobs or 0)
    if isinstance(prompt, str):
        return GenerateInput(text=prompt, **common)
    kinds = {type(p) for p in prompt}
    if len(kinds) != 1:
        raise InvalidRequest("prompt: mixes texts, token ids and lists of token ids")
    if kinds == {str}:
        return GenerateInput(text=prompt, **common)
    return GenerateInput(input_ids=prompt, **common)


def chat_input(req: ChatRequest) -> GenerateInput:
    if not req.messages:
        raise InvalidRequest("messages: must not be empty")
    messages = []
    for i, message in enumerate(req.messages):
        if not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}].role: missing or not a string")
        if message.get("tool_calls") is not None and not valid_calls(message["tool_calls"]):
            raise InvalidRequest(f"messages[{i}].tool_calls: each needs function.name and function.arguments "
                                 "(a JSON object, as text)")
        content = message.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
            content = "".join(texts)
        if content is not None and not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content: must be a string or a list of text parts")
        messages.append({**message, "content": content or ""})
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = req.sampling(max_tokens)
    tools, grammar = req.tool_use()
    if grammar is not None:
        if constraint_of(sampling) is None:
            sampling = msgspec.structs.replace(sampling, grammar=grammar)
        elif req.tool_choice not in (None, "auto"):
            raise InvalidRequest("tool_choice: a required tool call cannot be combined with response_format")
        # (auto with a response_format: the format holds, and the model answers in it rather than calling)
    return GenerateInput(
        messages=messages, tools=tools, sampling_params=sampling, stream=req.stream, rid=req.rid,
        return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs if req.logprobs else 0,
    )




def thinking_first(obj: GenerateInput, parser: str, param: str | None) -> GenerateInput:
    """``obj`` with its constraint (if any) moved after the think block the reasoning ``parser``
    expects: the model reasons freely, then answers as constrained. ``param``: the request's
    parameter that asked for it (named when it cannot be combined: an EBNF grammar)."""
    sampling = obj.sampling_params
    constraint = constraint_of(sampling) if isinstance(sampling, SamplingParams) else None
    if constraint is None or constraint[1].startswith("%llguidance"):
        return obj  # (tool_choice auto: free text, a think block included, comes first already)
    kind, text = constraint
    try:
        checked_grammar(kind, text)  # its own errors first, named as without a reasoning parser
    except GrammarError as exc:
        raise InvalidRequest(f"sampling_params.{exc}") from None
    try:
        grammar = think_first(kind, text, parser)
    except ValueError:
        raise InvalidRequest(f"{param or kind}: a grammar cannot be combined with the reasoning parser "
                             f"({parser}) of this server; a JSON schema, a regex or choices can") from None
    sampling = msgspec.structs.replace(sampling, json_schema=None, regex=None, ebnf=None, grammar=grammar)
    return msgspec.structs.replace(obj, sampling_params=sampling)


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.type


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class TokenStrings:
    """Each token id's text and UTF-8 bytes as logprobs show them, decoded once per id and kept (at
    most one entry per id of the vocabulary): rendering n × tokens × top_logprobs entries costs dict
    look-ups, not that many ``tokenizer.decode`` calls. Share one per tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text

    def utf8(self, token: int) -> list[int]:
        """The bytes of ``text(token)``, as a list (shared: render it, never change it)."""
        data = self._bytes.get(token)
        if data is None:
            data = self._bytes[token] = list(self.text(token).encode())
        return data


class Responder:
    """Builds one request's responses (whole or streamed) in the OpenAI shapes."""

    def __init__(self, kind: str, model: str, tokenizer: Any, num_choices: int, n: int = 1,
                 tools: bool = False, strings: TokenStrings | None = None, reasoning: str | None = None,
                 continuous_usage: bool = False) -> None:
        self.kind = kind  # "completion" | "chat"
        # vLLM's stream_options.continuous_usage_stats: each chunk has its choice's usage so far, as
        # vLLM gives it (its prompt, the tokens that choice generated, this chunk's included)
        self.continuous_usage = continuous_usage
        self.tools = tools  # the answer may hold tool calls (Hermes format): parse them out
        self.reasoning = reasoning  # the reasoning parser: the think block goes to reasoning_content
        split = tools or reasoning is not None
        self.streams = [AnswerStream(reasoning=reasoning, tools=tools) for _ in range(num_choices)] if split else []
        # each choice's text as it arrives, watched for a repeated tool call (``ends``)
        self.watchers = [AnswerStream(reasoning=reasoning, tools=True) for _ in range(num_choices)] if tools else []
        self.ended = [False] * num_choices  # a streamed choice already finished (at a repeated call)
        self.n = n
        self.model = model
        self.tokenizer = tokenizer
        self.strings = strings if strings is not None else TokenStrings(tokenizer)
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.prompt_tokens = [0] * num_choices
        self.completion_tokens = [0] * num_choices
        self.cached_tokens = [0] * num_choices
        self.sent_role = [False] * num_choices

    def _count(self, chunk: Chunk) -> None:
        self.prompt_tokens[chunk.index] = chunk.prompt_tokens
        self.completion_tokens[chunk.index] = chunk.completion_tokens
        self.cached_tokens[chunk.index] = chunk.cached_tokens

    def usage(self) -> dict[str, Any]:
        # the n samples of a prompt share it: count each prompt once, as OpenAI does
        return usage(sum(self.prompt_tokens[:: self.n]), sum(self.completion_tokens), sum(self.cached_tokens[:: self.n]))

    def _logprobs(self, chunk_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]]) -> Any:
        if not logprobs:
            return None
        text = self.strings.text
        tokens = [text(t) for t in chunk_ids]
        if self.kind == "chat":
            utf8 = self.strings.utf8
            content = []
            for i, (t, lp) in enumerate(zip(chunk_ids, logprobs)):
                alternatives = top[i] if i < len(top) else []
                content.append({
                    "token": text(t), "logprob": lp, "bytes": utf8(t),
                    "top_logprobs": [{"token": text(a), "logprob": v, "bytes": utf8(a)} for a, v in alternatives],
                })
            return {"content": content}
        return {
            "tokens": tokens, "token_logprobs": logprobs,
            "top_logprobs": [{text(t): v for t, v in (top[i] if i < len(top) else [])} for i in range(len(tokens))],
            "text_offset": [],
        }

    def stream_chunk(self, chunk: Chunk) -> dict[str, Any] | None:
        self._count(chunk)
        choice: dict[str, Any] = {"index": chunk.index,
                                  "logprobs": self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs),
                                  "finish_reason": finish_reason(chunk.finished)}
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if not self.sent_role[chunk.index]:
                self.sent_role[chunk.index] = True
                delta["role"] = "assistant"
            text, thought, calls = chunk.text, "", []
            if self.streams:
                if self.ended[chunk.index]:
                    return None  # (what came after a repeated call, and the end of its aborted generation)
                stream = self.streams[chunk.index]
                thought, text, calls = stream.feed(chunk.text, final=chunk.finished is not None)
                if stream.repeated:
                    self.ended[chunk.index] = True
                    choice["finish_reason"] = "tool_calls"
                elif stream.calls and choice["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
            if thought:
                delta["reasoning_content"] = thought
            if calls:
                delta["tool_calls"] = calls
            if text or not delta:
                delta["content"] = text
            choice["delta"] = delta
            obj = "chat.completion.chunk"
        else:
            choice["text"] = chunk.text
            obj = "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if self.continuous_usage:
            i = chunk.index
            out["usage"] = usage(self.prompt_tokens[i], self.completion_tokens[i], self.cached_tokens[i])
        return out

    def ends(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` completes its choice's answer before its generation ends (a repeated
        tool call): the caller aborts the rest of that generation (once per choice)."""
        if not self.watchers or chunk.finished is not None:
            return False
        watcher = self.watchers[chunk.index]
        if watcher.repeated:
            return False  # (said already)
        watcher.feed(chunk.text)
        return watcher.repeated

    def usage_chunk(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}

    def whole(self, folded: list[dict[str, Any]]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(folded):
            self.prompt_tokens[index] = result["prompt_tokens"]
            self.completion_tokens[index] = result["completion_tokens"]
            self.cached_tokens[index] = result["cached_tokens"]
            logprobs = self._logprobs(result["output_ids"], result["logprobs"], result["top_logprobs"])
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": result["text"]}
                reason = finish_reason(result["finished"])
                if self.streams:
                    answer = take_apart(result["text"], reasoning=self.reasoning, tools=self.tools)
                    message["content"] = answer.content
                    if self.reasoning is not None:
                        message["reasoning_content"] = answer.reasoning
                    if answer.calls:
                        message["tool_calls"] = [call.to_openai() for call in answer.calls]
                        reason = "tool_calls" if reason == "stop" or answer.repeated else reason
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": result["text"], "logprobs": logprobs,
                                "finish_reason": finish_reason(result["finished"])})
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}

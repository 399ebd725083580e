"""What a generation request may ask, and how it becomes sub-requests.

``GenerateInput`` is SGLang's ``GenerateReqInput`` shape (one prompt or a
batch; text, token ids or chat messages), with bounded fields so msgspec
refuses an out-of-range value while decoding. ``Expander`` turns one into
sub-requests — tokenized, one per prompt and sample — and checks what the
types cannot: the server's limits (``RequestLimits``), the vocabulary and
the context window. Every refusal is an ``InvalidRequest`` whose message
starts with the field it is about.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from models.sampling import random_seed

from .grammar import GrammarCache, GrammarError, compile_grammar, constraint_of
from .messages import RequestId, SamplingParams, TokenId, TopLogprobs
from .tools import hermes_messages, valid_calls

__all__ = ["DuplicateRequestError", "Expander", "GenerateInput", "InvalidRequest", "RequestLimits", "SubRequest",
           "bounded_input", "check_samples", "check_tools", "input_size", "sample_seed", "samples"]


class InvalidRequest(ValueError):
    """Bad input, with a message that starts with the field it names (``field: why``)."""


class DuplicateRequestError(InvalidRequest):
    """A request id that is already in flight."""


Prompt = Annotated[list[TokenId], msgspec.Meta(min_length=1)]


class GenerateInput(msgspec.Struct, forbid_unknown_fields=True):
    """One generation request, SGLang's GenerateReqInput shape: single or batch."""

    text: str | list[str] | None = None
    input_ids: list[TokenId | Prompt] | None = None  # one prompt, or a batch of prompts
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the chat template
    tools: list[dict[str, Any]] | None = None  # with messages: OpenAI tool definitions the model may call
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: RequestId | list[RequestId] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: TopLogprobs = 0


@functools.lru_cache(maxsize=8)
def bounded_input(max_prompt: int, max_batch: int) -> type[GenerateInput]:
    """``GenerateInput`` whose ``input_ids`` hold at most ``max_prompt`` ids a prompt (the context window)
    and ``max_batch`` prompts: the decoder refuses a longer one before anything copies or scans it."""
    prompt = Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=max_prompt)]
    outer = Annotated[list[TokenId | prompt], msgspec.Meta(max_length=max(max_prompt, max_batch))]
    return msgspec.defstruct("GenerateInput", [("input_ids", outer | None, None)], bases=(GenerateInput,),
                             forbid_unknown_fields=True, module=__name__)


@dataclass(frozen=True)
class RequestLimits:
    """The server's bounds on one request (``server.*`` in the topology)."""

    max_batch_size: int = 256  # prompts in one /generate (each n times)
    max_samples: int = 256  # sub-requests (prompts × n) in one request
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters of one stop string
    max_logprobs: int = 2_097_152  # logprob entries: samples × max_new_tokens × (1 + top_logprobs)
    context_len: int | None = None  # prompt + max_new_tokens; None: the scheduler's own check only


@dataclass
class SubRequest:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams  # n = 1, seed fixed (a resume samples the same)


GREEDY_BELOW = 1e-5  # a temperature this small samples greedily (as vLLM treats it)
# above this many characters of prompt text, tokenizing runs in a worker thread
LARGE_INPUT_CHARS = 16_384


_CHECKED = GrammarCache(32 << 20)  # bounded by characters held, not by count (texts of up to 1 MiB)


def checked_grammar(kind: str, text: str) -> str:
    """A constraint checked once per text (GrammarError names what is wrong)."""
    return _CHECKED.get(kind, text, lambda: compile_grammar(kind, text))


def _counted(obj: GenerateInput) -> tuple[int, int]:
    """(prompts, sub-requests: prompts × n) that ``obj`` asks for, counted without tokenizing."""
    if obj.messages is not None or isinstance(obj.text, str):
        prompts = 1
    elif obj.text is not None:
        prompts = len(obj.text)
    elif obj.input_ids:
        prompts = len(obj.input_ids) if isinstance(obj.input_ids[0], list) else 1
    else:
        prompts = 1
    params = obj.sampling_params
    if isinstance(params, list):  # (a count that does not match the prompts is refused later)
        return prompts, sum(p.n for p in params[:prompts]) + max(prompts - len(params), 0)
    return prompts, prompts * (params.n if params is not None else 1)


def samples(obj: GenerateInput) -> int:
    """How many sub-requests ``obj`` asks for (prompts × n), counted without tokenizing."""
    return _counted(obj)[1]


def check_samples(obj: GenerateInput, limits: RequestLimits) -> int:
    """The sub-requests of ``obj``, checked before any tokenizing: InvalidRequest past
    ``limits.max_batch_size`` prompts or ``limits.max_samples`` prompts × n."""
    prompts, count = _counted(obj)
    where = "input_ids" if obj.input_ids is not None else "text"
    if prompts > limits.max_batch_size:
        raise InvalidRequest(f"{where}: {prompts} prompts in one request; at most {limits.max_batch_size}")
    if count > limits.max_samples:
        where = where if count == prompts else "sampling_params.n"
        raise InvalidRequest(f"{where}: {count} samples (prompts × n) in one request; this server takes at most "
                             f"{limits.max_samples} (server.max_samples)")
    return count


def input_size(obj: GenerateInput) -> int:
    """About how much work expanding ``obj`` is: characters of every text it holds (prompts, whole
    messages and tools, constraints, stop strings) plus every token id (all prompts of a batch)."""
    texts = [obj.text] if isinstance(obj.text, str) else (obj.text or [])
    size = sum(len(t) for t in texts)
    if obj.messages or obj.tools:
        size += len(msgspec.json.encode([obj.messages or [], obj.tools or []]))
    ids = obj.input_ids or []
    size += sum(len(p) if isinstance(p, list) else 1 for p in ids)
    params = obj.sampling_params
    for p in params if isinstance(params, list) else [params] if params is not None else []:
        size += sum(len(getattr(p, kind) or "") for kind in ("json_schema", "regex", "ebnf", "grammar"))
        size += sum(len(s) for s in p.stop)
    return size


MAX_TOOLS = 128  # tools in one request
MAX_TOOLS_CHARS = 1 << 20  # their JSON together, as much as one constraint may hold


def check_tools(tools: list[Any] | None, messages: list[dict[str, Any]] | None = None) -> None:
    """InvalidRequest past ``MAX_TOOLS`` tools or ``MAX_TOOLS_CHARS`` of their JSON (each tool's schema
    is compiled, and all of them are rendered into the prompt), for a tool not shaped as OpenAI's
    (``{"type": "function", "function": {"name", "parameters"}}``), or, given ``messages``, for a
    message without a role or with malformed ``tool_calls`` (all written into the prompt with tools)."""
    if not tools:
        return
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools: {len(tools)} tools; at most {MAX_TOOLS}")
    size = len(msgspec.json.encode(tools))
    if size > MAX_TOOLS_CHARS:
        raise InvalidRequest(f"tools: {size} bytes of tool definitions; at most {MAX_TOOLS_CHARS} together")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str) or \
                not isinstance(function.get("parameters", {}), dict | None):
            raise InvalidRequest(f"tools[{i}]: a tool is {{\"type\": \"function\", \"function\": {{\"name\": "
                                 "a string, \"parameters\": a JSON schema object}}")
    for i, message in enumerate(messages or []):
        if not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}].role: missing or not a string")
        if message.get("tool_calls") is not None and not valid_calls(message["tool_calls"]):
            raise InvalidRequest(f"messages[{i}].tool_calls: each needs function.name and function.arguments "
                                 "(a JSON object, as text)")


def sample_seed(seed: int, k: int) -> int:
    """The seed of sample ``k`` of a request seeded ``seed``: ``seed + k`` as vLLM derives it, wrapped
    like an int64 addition (``2**63 - 1`` then ``-2**63``), so it always fits the wire's Int64."""
    return (seed + k + 2**63) % 2**64 - 2**63


class Expander:
    """Sub-requests of a ``GenerateInput``; ``expand`` is synchronous (run it in a thread for big inputs)."""

    def __init__(self, tokenizer: Any, limits: RequestLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.vocab = len(tokenizer)
        self._renders_tools: bool | None = None

    @staticmethod
    def is_large(obj: GenerateInput) -> bool:
        """Whether expanding ``obj`` may take long enough to stall the event loop: every input counts
        (texts, whole messages, tools, constraints, stop strings, each id of a batch of prompts)."""
        return input_size(obj) > LARGE_INPUT_CHARS

    def expand(self, obj: GenerateInput) -> list[SubRequest]:
        """The sub-requests of ``obj``: one per prompt × n."""
        check_samples(obj, self.limits)
        prompts = self._prompts(obj)
        params = obj.sampling_params
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise InvalidRequest(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        else:
            params = [params or SamplingParams()] * len(prompts)
        rids = obj.rid
        if isinstance(rids, str):
            rids = [rids] if len(prompts) == 1 else [f"{rids}-{i}" for i in range(len(prompts))]
        elif rids is None:
            rids = [uuid.uuid4().hex for _ in prompts]
        if len(rids) != len(prompts):
            raise InvalidRequest(f"rid: {len(rids)} given for {len(prompts)} prompts")
        subs = []
        for rid, ids, p in zip(rids, prompts, params):
            if p.max_new_tokens is None:  # up to the context window
                p = msgspec.structs.replace(p, max_new_tokens=self._room_after(len(ids)))
            if 0 < p.temperature < GREEDY_BELOW:  # 1/temperature would overflow: it means greedy
                p = msgspec.structs.replace(p, temperature=0.0)
            self._check(p, len(ids))
            for k in range(p.n):
                if p.seed is not None:
                    seed = sample_seed(p.seed, k)
                else:
                    seed = random_seed() if p.temperature > 0 else None
                sub_rid = rid if p.n == 1 else f"{rid}-{k}"
                subs.append(SubRequest(sub_rid, ids, msgspec.structs.replace(p, seed=seed, n=1)))
        if obj.return_logprob:
            self._check_logprobs(subs, obj.top_logprobs_num)
        return subs

    def _check_logprobs(self, subs: list[SubRequest], top: int) -> None:
        """Logprobs are rendered at the end of a request (each token and its ``top`` alternatives):
        their count, samples × max_new_tokens × (1 + top), is bounded by ``limits.max_logprobs``."""
        entries = sum(sub.sampling.max_new_tokens for sub in subs) * (1 + top)
        if entries > self.limits.max_logprobs:
            raise InvalidRequest(
                f"top_logprobs_num: {entries} logprob entries asked for (samples × sampling_params.max_new_tokens "
                f"× (1 + top logprobs)); this server returns at most {self.limits.max_logprobs} in one request "
                "(server.max_logprobs): ask for fewer tokens, samples or top logprobs")

    def _check(self, p: SamplingParams, prompt_len: int) -> None:
        if (problem := p.check()) is not None:
            raise InvalidRequest(f"sampling_params.{problem}")
        limits = self.limits
        if len(p.stop) > limits.max_stop_strings:
            raise InvalidRequest(f"sampling_params.stop: {len(p.stop)} stop strings; at most {limits.max_stop_strings}")
        if any(len(s) > limits.max_stop_length for s in p.stop):
            raise InvalidRequest(f"sampling_params.stop: a stop string is longer than {limits.max_stop_length} "
                                 "characters")
        if p.logit_bias and any(int(t) >= self.vocab for t in p.logit_bias):
            raise InvalidRequest(f"sampling_params.logit_bias: a token id is outside the vocabulary "
                                 f"(size {self.vocab})")
        try:
            constraint = constraint_of(p)
            if constraint is not None:
                checked_grammar(*constraint)
        except GrammarError as exc:
            raise InvalidRequest(f"sampling_params.{exc}") from None
        if any(t >= self.vocab for t in p.stop_token_ids):
            raise InvalidRequest(f"sampling_params.stop_token_ids: a token id is outside the vocabulary "
                                 f"(size {self.vocab})")
        if limits.context_len is not None and prompt_len + p.max_new_tokens > limits.context_len:
            raise InvalidRequest(
                f"sampling_params.max_new_tokens: the prompt has {prompt_len} tokens and {p.max_new_tokens} "
                f"more were asked for; the context window is {limits.context_len} tokens")

    def _room_after(self, prompt_len: int) -> int:
        if self.limits.context_len is None:
            return 2**31 - 1  # the scheduler ends it at the context window ("length")
        return max(self.limits.context_len - prompt_len, 0)

    def _prompts(self, obj: GenerateInput) -> list[list[int]]:
        given = [x for x in (obj.text, obj.input_ids, obj.messages) if x is not None]
        if len(given) != 1:
            raise InvalidRequest("give exactly one of text, input_ids or messages")
        if obj.messages is not None:
            check_tools(obj.tools, obj.messages)
            return [self._chat(obj.messages, obj.tools)]
        if obj.tools is not None:
            raise InvalidRequest("tools: only with messages")
        if obj.text is not None:
            texts = [obj.text] if isinstance(obj.text, str) else obj.text
            if not texts:
                raise InvalidRequest("text: an empty batch")
            return [self.tokenize(t) for t in texts]
        ids = obj.input_ids
        batch = ids if ids and isinstance(ids[0], list) else [ids]
        if any(not isinstance(p, list) for p in batch) or any(isinstance(t, list) for p in batch for t in p):
            raise InvalidRequest("input_ids: give a list of token ids, or a list of such lists")
        for prompt in batch:
            if not prompt:
                raise InvalidRequest("input_ids: a prompt is empty")
            bad = next((t for t in prompt if t >= self.vocab), None)
            if bad is not None:
                raise InvalidRequest(f"input_ids: token id {bad} is outside the vocabulary (size {self.vocab})")
        return [list(p) for p in batch]

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        extra: dict[str, Any] = {}
        if tools:
            if self.template_renders_tools():
                extra["tools"] = tools
            else:  # the template ignores tools: the Hermes format, in the messages themselves
                messages = hermes_messages(messages, tools)
        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                          **extra)
        except Exception as exc:  # a template error is the request's fault
            raise InvalidRequest(f"messages: cannot apply the chat template: {exc}") from None
        return self.tokenize(rendered)

    def template_renders_tools(self) -> bool:
        """Whether the chat template does anything with ``tools`` (asked once)."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {"name": "probe_tool", "parameters": {"type": "object"}}}
            try:
                with_tools = self.tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
                self._renders_tools = with_tools != self.tokenizer.apply_chat_template(probe, tokenize=False)
            except Exception:  # noqa: BLE001 - a template that chokes on tools does not render them
                self._renders_tools = False
        return self._renders_tools

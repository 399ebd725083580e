"""``GET /openapi.json``: the HTTP API as an OpenAPI 3.2 document.

The request bodies are described by ``msgspec.json.schema_components`` over
the very structs the routes decode (``GenerateInput``, ``CompletionRequest``,
``ChatRequest``, ``AbortBody``, ``UpdateWeightsBody``), so every bound in the
document (minimum, maximum, minLength, maxLength, additionalProperties) is the
one msgspec enforces. The structs below only describe answers; the fuzz test
checks the server's real answers against them. It is 3.2 for the streams:
``itemSchema`` describes one server-sent event (3.1 has no way to).
One thing JSON Schema cannot say: an integer field takes JSON integers only
(msgspec refuses ``2.0``, which JSON Schema counts as an integer).

The operations are those of the app's routes, read from ``request.app.routes``
(this module does not import ``app``, which imports it). The document is the
same for every server: it shows no configuration, so it is served without the
API key, as /health is (vLLM serves its own openly too).
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..managers.inputs import GenerateInput
from ..managers.messages import FinishReason
from .admin import AbortBody, UpdateWeightsBody
from .errors import KINDS
from .openai_api import ChatRequest, CompletionRequest
from .state import ServerState
from .tokens import DetokenizeBody, Detokenized, TokenizeBody, Tokenized

__all__ = ["OPEN", "document", "openapi"]

OPEN = ("/health", "/livez", "/openapi.json")  # served without the API key (app.UNPROTECTED)


# -- answers, as described (never built: the routes build plain dicts) -------------------


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None  # the field the error is about, when it is about one
    code: int  # the HTTP status


class ErrorBody(msgspec.Struct):
    """Every JSON error, OpenAI's shape (a stream that fails after it started sends one as its last event)."""

    error: ErrorDetail


class NativeMeta(msgspec.Struct):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None
    output_token_logprobs: list[tuple[float, int, None]] = []  # with return_logprob only
    output_top_logprobs: list[list[tuple[float, int, None]]] = []


class NativeResult(msgspec.Struct):
    """One prompt's answer; a batch (several prompts, or n > 1) answers a list, each with ``index``.
    Streamed, every event holds the text and ids so far."""

    text: str
    output_ids: list[int]
    meta_info: NativeMeta
    index: int = 0


class CachedTokens(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(msgspec.Struct):
    """One event of a streamed completion; the last, with ``stream_options.include_usage``, has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]


class ChatMessage(msgspec.Struct):
    role: str
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(msgspec.Struct):
    role: str | None = None  # in each choice's first event
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    """One event of a streamed chat completion; the last, with ``stream_options.include_usage``, has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]


class AbortResult(msgspec.Struct):
    rid: str
    aborted: bool  # whether a request with that rid was in flight


class Paused(msgspec.Struct):
    paused: bool


class WeightsUpdated(msgspec.Struct):
    success: bool
    message: str


# -- what each route takes and gives ------------------------------------------------------

BODIES: dict[str, Any] = {"/generate": GenerateInput, "/v1/completions": CompletionRequest,
                          "/v1/chat/completions": ChatRequest, "/abort_request": AbortBody,
                          "/update_weights_from_disk": UpdateWeightsBody, "/tokenize": TokenizeBody,
                          "/detokenize": DetokenizeBody}
JSON_ANSWERS: dict[str, Any] = {
    "/generate": NativeResult | list[NativeResult], "/v1/completions": Completion,
    "/v1/chat/completions": ChatCompletion, "/v1/models": ModelList, "/abort_request": AbortResult,
    "/pause_generation": Paused, "/continue_generation": Paused, "/update_weights_from_disk": WeightsUpdated,
    "/server_info": dict[str, Any], "/get_server_info": dict[str, Any], "/openapi.json": dict[str, Any],
    "/tokenize": Tokenized, "/detokenize": Detokenized,
}
TEXT_ANSWERS = {"/health": "OK", "/livez": "OK: this process answers (whatever the scheduler or replicas do)",
                "/health_generate": "OK (one token was generated)",
                "/metrics": "Prometheus text exposition format", "/flush_cache": "Cache flushed."}
STREAMS = {"/generate": "NativeResult", "/v1/completions": "CompletionChunk",
           "/v1/chat/completions": "ChatCompletionChunk"}
EXTRA_SCHEMAS = [ErrorBody, CompletionChunk, ChatCompletionChunk]

WHY = {400: "the request is malformed or out of bounds; ``param`` names the field",
       401: "no or the wrong API key (only when the server has one)",
       404: "the model named is not the one served", 409: "weights are already being updated",
       413: "the body is larger than server.max_request_bytes",
       500: "the request crashed the scheduler each time it ran (quarantined)",
       503: "paused, restarting, overloaded or failed: retry (``Retry-After``)"}
GENERATION = (400, 404, 413, 500, 503)
ERRORS = {"/generate": (400, 413, 500, 503), "/v1/completions": GENERATION, "/v1/chat/completions": GENERATION,
          "/v1/models": (503,), "/abort_request": (400, 413), "/flush_cache": (400,),
          "/pause_generation": (503,), "/continue_generation": (503,),
          "/update_weights_from_disk": (400, 409, 413, 503), "/tokenize": (400, 404, 413, 503),
          "/detokenize": (400, 404, 413)}
PLAIN_503 = ("/health", "/health_generate")  # these say what is wrong in plain text


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _error(status: int) -> dict[str, Any]:
    headers = {"Retry-After": {"schema": {"type": "integer"}}} if status == 503 else {}
    return {"description": f"{KINDS.get(status, 'server_error')}: {WHY[status]}",
            "content": _json({"$ref": "#/components/schemas/ErrorBody"}), **({"headers": headers} if headers else {})}


def _event(name: str) -> dict[str, Any]:
    """One server-sent event of a stream of ``name``s (OpenAPI 3.2's ``itemSchema``)."""
    chunk = {"anyOf": [{"$ref": f"#/components/schemas/{name}"}, {"$ref": "#/components/schemas/ErrorBody"}]}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json", "contentSchema": chunk}]}}}


def _operation(path: str, method: str, answers: dict[str, Any]) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": f"{method}_{path.strip('/').replace('/', '_').replace('.', '_')}"}
    if path in OPEN:
        op["security"] = []
    if method == "post" and path in BODIES:
        op["requestBody"] = {"required": True, "content": _json(answers[f"body {path}"])}
    ok: dict[str, Any] = {"description": "OK"}
    if path in JSON_ANSWERS:
        ok["content"] = _json(answers[path])
    if path in TEXT_ANSWERS:
        ok["description"] = TEXT_ANSWERS[path]
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    if path in STREAMS:
        ok["description"] = (f'With "stream": true, Server-Sent Events: one "data: <{STREAMS[path]} JSON>" event '
                             'per step, an ErrorBody event if it fails after it started, then "data: [DONE]".')
        ok["content"]["text/event-stream"] = {"itemSchema": _event(STREAMS[path])}
    responses: dict[str, Any] = {"200": ok}
    for status in ERRORS.get(path, ()):
        responses[str(status)] = _error(status)
    if path not in OPEN:
        responses["401"] = _error(401)
    if path in PLAIN_503:
        responses["503"] = {"description": "not healthy: why, in plain text",
                            "content": {"text/plain": {"schema": {"type": "string"}}}}
    op["responses"] = dict(sorted(responses.items()))
    return op


@cache
def document(routes: tuple[tuple[str, tuple[str, ...]], ...]) -> bytes:
    """The OpenAPI document of ``routes`` (path, methods), as JSON."""
    named = [(f"body {path}", t) for path, t in BODIES.items()] + list(JSON_ANSWERS.items())
    schemas, components = msgspec.json.schema_components(
        [t for _, t in named] + EXTRA_SCHEMAS, ref_template="#/components/schemas/{name}")
    answers = dict(zip([name for name, _ in named], schemas))
    paths = {path: {m.lower(): _operation(path, m.lower(), answers) for m in methods} for path, methods in routes}
    return msgspec.json.encode({
        "openapi": "3.2.0",
        "info": {"title": "tercet", "version": "0.1.0",
                 "description": "SGLang's native /generate, OpenAI-compatible completions and chat, admin routes."},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {
            "type": "http", "scheme": "bearer",
            "description": "Only when the server has server.api_key; the admin routes take "
                           "server.admin_api_key instead when that is set."}}},
        "security": [{}, {"bearer": []}],
    })


async def openapi(request: Request, state: ServerState) -> Response:
    routes = tuple((route.path, tuple(sorted(set(route.methods) - {"HEAD"})))
                   for route in request.app.routes if isinstance(route, Route) and route.methods)
    return Response(document(routes), media_type="application/json")

"""The HTTP face: a Starlette app on hypercorn's trio worker.

Routes: SGLang's native ``/generate``; OpenAI's ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/models``; and ``/health``,
``/health_generate``, ``/metrics``, ``/server_info``, ``/abort_request``,
``/flush_cache``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk``. The lifespan starts the topology and stops it.

Every bad request is a 400 with an OpenAI-style error body naming the field;
nothing a client sends makes a 500. A client that disconnects (streaming or
not) aborts its request down to the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import open_runtime
from .http_admin import (
    abort_request,
    continue_generation,
    flush_cache,
    health,
    health_generate,
    metrics,
    models,
    pause_generation,
    server_info,
    update_weights_from_disk,
)
from .http_state import BadRequest, ServerState, decode_body
from .messages import FinishReason, SamplingParams
from .openai_api import ChatRequest, CompletionRequest, Responder, chat_input, completion_input
from .tokenizer_manager import Chunk, DuplicateRequestError, GenerateInput, InvalidRequest, fold
from .topology import Topology

__all__ = ["build_app"]

log = logging.getLogger("serving.http")

_json = msgspec.json.Encoder()


def error(status: int, message: str, *, param: str | None = None, kind: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    503: "service_unavailable"}.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _param_of(message: str) -> str | None:
    head = message.split(":", 1)[0]
    return head if head and " " not in head else None


# -- running one request ----------------------------------------------------------


async def until_disconnected(request: Request, work: Callable[[], Awaitable[Any]]) -> tuple[bool, Any]:
    """Run ``work`` unless the client goes away first: (disconnected, result)."""
    result: Any = None
    gone = False

    async def watch(nursery: trio.Nursery) -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        nursery.cancel_scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, nursery)
            result = await work()
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the work's own error, not the group around it
        _, errors = group.split(trio.Cancelled)
        if errors is not None and len(errors.exceptions) == 1 and isinstance(errors.exceptions[0], Exception):
            raise errors.exceptions[0] from None
        raise
    return gone, result


def _finish_error(chunk: Chunk) -> JSONResponse | None:
    reason = chunk.finished
    if reason is None or reason.type != "abort" or reason.status_code is None:
        return None
    headers = {"Retry-After": "1"} if reason.status_code == 503 else None
    return error(reason.status_code, reason.message or "aborted", headers=headers)


async def run_request(request: Request, state: ServerState, obj: GenerateInput,
                      whole: Callable[[list[dict[str, Any]]], Any],
                      piece: Callable[[Chunk], Any | None],
                      tail: Callable[[], list[Any]] = list) -> Response:
    """Generate ``obj``; a JSON response from ``whole`` or an SSE stream of ``piece``s."""
    tm = state.engine.tokenizer_manager
    await state.admit()
    try:
        stream = tm.generate(obj)
        timer = state.metrics.timer()
        gone, first = await until_disconnected(request, lambda: _first(stream))
        if gone or first is None:
            await stream.aclose()
            state.read_unlock()
            return Response(status_code=499)
    except (InvalidRequest, DuplicateRequestError) as exc:
        state.read_unlock()
        raise BadRequest(str(exc), _param_of(str(exc))) from None
    except BaseException:
        state.read_unlock()
        raise
    timer.chunk(first)
    if (failed := _finish_error(first)) is not None:
        await stream.aclose()
        state.read_unlock()
        return failed

    if obj.stream:
        async def events() -> AsyncIterator[bytes]:
            try:
                for chunk in [first]:
                    if (data := piece(chunk)) is not None:
                        yield _sse(data)
                async for chunk in stream:
                    timer.chunk(chunk)
                    if chunk.finished is not None and chunk.finished.status_code:
                        yield _sse({"error": {"message": chunk.finished.message, "type": "service_unavailable",
                                              "param": None, "code": chunk.finished.status_code}})
                        continue
                    if (data := piece(chunk)) is not None:
                        yield _sse(data)
                for data in tail():
                    yield _sse(data)
                yield b"data: [DONE]\n\n"
            finally:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
                state.read_unlock()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def rest() -> dict[int, list[Chunk]]:
        chunks: dict[int, list[Chunk]] = {first.index: [first]}
        async for chunk in stream:
            timer.chunk(chunk)
            chunks.setdefault(chunk.index, []).append(chunk)
        return chunks

    try:
        gone, chunks = await until_disconnected(request, rest)
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        state.read_unlock()
    if gone:
        return Response(status_code=499)
    folded = [fold(chunks[i]) for i in sorted(chunks)]
    for result in folded:
        reason: FinishReason | None = result["finished"]
        if reason is not None and reason.type == "abort" and reason.status_code:
            return error(reason.status_code, reason.message or "aborted",
                         headers={"Retry-After": "1"} if reason.status_code == 503 else None)
    return JSONResponse(whole(folded))


async def _first(stream: AsyncIterator[Chunk]) -> Chunk | None:
    async for chunk in stream:
        return chunk
    return None


def _sse(data: Any) -> bytes:
    return b"data: " + _json.encode(data) + b"\n\n"


# -- routes -------------------------------------------------------------------------


def _state(request: Request) -> ServerState:
    return request.app.state.server


def routes_for(handler: Callable[[Request, ServerState], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        state = _state(request)
        try:
            return await handler(request, state)
        except BadRequest as exc:
            return error(exc.status, str(exc), param=exc.param,
                         headers={"Retry-After": "1"} if exc.status == 503 else None)

    return endpoint


async def generate(request: Request, state: ServerState) -> Response:
    obj = await decode_body(request, GenerateInput)
    single = obj.text is None or isinstance(obj.text, str)
    single = single and (obj.input_ids is None or not obj.input_ids or not isinstance(obj.input_ids[0], list))
    params = obj.sampling_params
    n = params.n if isinstance(params, SamplingParams) else 1
    single = single and n == 1
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    logprobs: dict[int, list] = {}

    def native(index: int, rid: str, text: str, output_ids: list[int], finished: FinishReason | None,
               prompt: int, completion: int, cached: int, lps: list, tops: list) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid, "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
            "finish_reason": finished.to_json() if finished is not None else None,
        }
        if obj.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, output_ids)]
            meta["output_top_logprobs"] = [[[v, t, None] for t, v in top] for top in tops]
        out = {"text": text, "output_ids": output_ids, "meta_info": meta}
        if not single:
            out["index"] = index
        return out

    def whole(folded: list[dict[str, Any]]) -> Any:
        results = [native(i, r["rid"], r["text"], r["output_ids"], r["finished"], r["prompt_tokens"],
                          r["completion_tokens"], r["cached_tokens"], r["logprobs"], r["top_logprobs"])
                   for i, r in enumerate(folded)]
        return results[0] if single else results

    def piece(chunk: Chunk) -> dict[str, Any]:
        # SGLang streams the text so far in every chunk
        texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
        ids.setdefault(chunk.index, []).extend(chunk.token_ids)
        logprobs.setdefault(chunk.index, []).extend(chunk.logprobs)
        return native(chunk.index, chunk.rid, texts[chunk.index], ids[chunk.index], chunk.finished,
                      chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens,
                      logprobs[chunk.index], chunk.top_logprobs)

    return await run_request(request, state, obj, whole, piece)


async def completions(request: Request, state: ServerState) -> Response:
    req = await decode_body(request, CompletionRequest)
    state.check_model(req.model)
    obj = _convert(completion_input, req)
    prompts = 1 if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)) else len(req.prompt)
    return await _openai(request, state, Responder("completion", state.model_name, state.engine.tokenizer,
                                                   prompts * req.n, req.n), obj, req)


async def chat_completions(request: Request, state: ServerState) -> Response:
    req = await decode_body(request, ChatRequest)
    state.check_model(req.model)
    obj = _convert(chat_input, req)
    return await _openai(request, state, Responder("chat", state.model_name, state.engine.tokenizer, req.n, req.n),
                         obj, req)


def _convert(fn: Callable[[Any], GenerateInput], req: Any) -> GenerateInput:
    try:
        obj = fn(req)
        for params in [obj.sampling_params] if isinstance(obj.sampling_params, SamplingParams) else []:
            if (problem := params.check()) is not None:
                raise InvalidRequest(problem)
        return obj
    except InvalidRequest as exc:
        raise BadRequest(str(exc), _param_of(str(exc))) from None


async def _openai(request: Request, state: ServerState, responder: Responder, obj: GenerateInput,
                  req: Any) -> Response:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await run_request(
        request, state, obj, responder.whole, responder.stream_chunk,
        tail=lambda: [responder.usage_chunk()] if include_usage else [],
    )


ROUTES = [
    ("/generate", generate, ["POST"]),
    ("/v1/completions", completions, ["POST"]),
    ("/v1/chat/completions", chat_completions, ["POST"]),
    ("/v1/models", models, ["GET"]),
    ("/health", health, ["GET"]),
    ("/health_generate", health_generate, ["GET"]),
    ("/metrics", metrics, ["GET"]),
    ("/server_info", server_info, ["GET"]),
    ("/get_server_info", server_info, ["GET"]),
    ("/abort_request", abort_request, ["POST"]),
    ("/flush_cache", flush_cache, ["POST", "GET"]),
    ("/pause_generation", pause_generation, ["POST"]),
    ("/continue_generation", continue_generation, ["POST"]),
    ("/update_weights_from_disk", update_weights_from_disk, ["POST"]),
]

UNPROTECTED = {"/health"}


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on every route but /health, when a key is set."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in UNPROTECTED:
            headers = dict(scope.get("headers") or [])
            if headers.get(b"authorization") != self.expected:
                await error(401, "missing or wrong API key (Authorization: Bearer ...)")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(topology: Topology, *, runtime: Any = None) -> Starlette:
    """The app; its lifespan starts ``topology`` — or, in a tokenizer worker, uses
    ``runtime`` (a WorkerRuntime) that the worker runs."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if runtime is not None:
            app.state.server = ServerState(runtime, topology)
            app.state.ready.set()
            yield
            return
        async with open_runtime(topology) as engine:
            app.state.server = ServerState(engine, topology)
            app.state.ready.set()
            log.info("ready: model %s, topology %s", app.state.server.model_name,
                     {k: v.address for k, v in msgspec.structs.asdict(topology.actors).items()})
            yield

    from starlette.middleware import Middleware

    middleware = [Middleware(ApiKeyMiddleware, api_key=topology.server.api_key)] if topology.server.api_key else []
    routes = [Route(path, routes_for(fn), methods=methods) for path, fn, methods in ROUTES]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={404: _not_found, 405: _not_allowed})
    app.state.ready = trio.Event()
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    return error(404, f"no route {request.url.path}")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error(405, f"{request.method} is not allowed on {request.url.path}", kind="invalid_request_error")


"""The generation routes: SGLang's ``/generate`` and OpenAI's completions and chat.

Each builds a ``GenerateInput`` and hands ``run_request`` two renderers: one
for the whole answer, one for each streamed chunk. ``run_request`` admits
the request, streams it from the tokenizer manager, and answers JSON or SSE.
A client that disconnects (streaming or not) aborts its request down to the
scheduler.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..managers.messages import FinishReason, SamplingParams
from ..managers.inputs import bounded_input, check_samples
from ..managers.tokenizer_manager import Chunk, GenerateInput, InvalidRequest, fold
from .errors import BadRequest, decode_body, error_body, finish_error, param_of
from .openai_api import ChatRequest, CompletionRequest, Responder, chat_input, completion_input, thinking_first
from .state import ServerState

__all__ = ["chat_completions", "completions", "generate", "run_request"]

_json = msgspec.json.Encoder()

Renderer = Callable[[Chunk], Any | None]
LARGE_ANSWER = 16_384  # tokens and top logprobs in a whole answer: rendered in a worker thread


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


@asynccontextmanager
async def _closing(stream: Any) -> AsyncIterator[Any]:
    """Close the tokenizer manager's stream (which aborts an unfinished request), even when cancelled."""
    try:
        yield stream
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


class _Stream(StreamingResponse):
    """An SSE response that releases the request (stream closed, gate left) however it
    ends — even when the client left before the body started. Its event generator is closed
    here too: starlette abandons it half-way when the client leaves."""

    def __init__(self, content: AsyncGenerator[bytes, None], release: Callable[[], Awaitable[Any]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._content, self._release = content, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with trio.CancelScope(shield=True):
                await self._content.aclose()
                await self._release()


async def run_request(request: Request, state: ServerState, obj: GenerateInput,
                      whole: Callable[[list[dict[str, Any]]], Any], piece: Renderer,
                      tail: Callable[[], list[Any]] = list, names: dict[str, str] | None = None,
                      ends: Callable[[Chunk], bool] | None = None) -> Response:
    """Generate ``obj``; a JSON response from ``whole`` or an SSE stream of ``piece``s.
    ``names``: what the client calls the fields an error may name (OpenAI's ``max_tokens``).
    ``ends``: whether a chunk completes its sub-request's answer early (the rest is aborted)."""
    tm = state.runtime.tokenizer_manager
    try:
        weight = check_samples(obj, tm.limits)  # each sub-request counts against admission
    except InvalidRequest as exc:
        raise _bad_request(exc, names) from None
    async with AsyncExitStack() as held:
        admission = tm.admission(obj)  # an /abort_request of its rid ends its wait: it ends unrun
        held.callback(admission.close)
        gone = False
        with admission.scope:
            gone, _ = await until_disconnected(request, lambda: held.enter_async_context(state.admitted(weight)))
        if gone:  # the client left while its request waited (paused, restarting)
            return Response(status_code=499)
        stream = await held.enter_async_context(_closing(tm.generate(obj, admission=admission)))
        if ends is not None:
            stream = _EndingEarly(stream, tm, ends)
        timer = state.metrics.timer()
        try:
            gone, first = await until_disconnected(request, lambda: _first(stream))
        except InvalidRequest as exc:
            raise _bad_request(exc, names) from None
        if gone or first is None:
            return Response(status_code=499)
        timer.chunk(first)
        if (failed := finish_error(first.finished)) is not None:
            return failed
        if obj.stream:
            return _Stream(_events(first, stream, timer, piece, tail), held.pop_all().aclose)

        async def rest() -> dict[int, list[Chunk]]:
            chunks: dict[int, list[Chunk]] = {first.index: [first]}
            async for chunk in stream:
                timer.chunk(chunk)
                chunks.setdefault(chunk.index, []).append(chunk)
            return chunks

        gone, chunks = await until_disconnected(request, rest)
    if gone:
        return Response(status_code=499)
    folded = [fold(chunks[i]) for i in sorted(chunks)]
    for result in folded:
        if (failed := finish_error(result["finished"])) is not None:
            return failed
    entries = sum(len(r["output_ids"]) + sum(len(top) for top in r["top_logprobs"]) for r in folded)
    if entries > LARGE_ANSWER:  # rendered (logprobs, each token's text) and encoded off the event loop
        return await trio.to_thread.run_sync(lambda: JSONResponse(whole(folded)))
    return JSONResponse(whole(folded))


def _bad_request(exc: InvalidRequest, names: dict[str, str] | None) -> BadRequest:
    """A 400 for ``exc``, its field as the client names it."""
    message, param = str(exc), param_of(str(exc))
    for ours, theirs in (names or {}).items():
        message = message.replace(ours, theirs)
        param = param.replace(ours, theirs) if param else param
    return BadRequest(message, param)


async def _events(first: Chunk, stream: AsyncIterator[Chunk], timer: Any, piece: Renderer,
                  tail: Callable[[], list[Any]]) -> AsyncGenerator[bytes, None]:
    if (data := piece(first)) is not None:
        yield _sse(data)
    async for chunk in stream:
        timer.chunk(chunk)
        reason = chunk.finished
        if reason is not None and reason.status_code:
            yield _sse(error_body(reason.status_code, reason.message or "aborted"))
            continue
        if (data := piece(chunk)) is not None:
            yield _sse(data)
    for data in tail():
        yield _sse(data)
    yield b"data: [DONE]\n\n"


class _EndingEarly:
    """``stream``'s chunks, each sub-request's generation aborted once ``ends`` says its answer is
    complete (its aborted end still comes through, for the renderer to drop). An iterator, not an
    async generator: nothing is left to finalize when a response stops reading it half-way."""

    MESSAGE = "the answer was complete"

    def __init__(self, stream: AsyncIterator[Chunk], tm: Any, ends: Callable[[Chunk], bool]) -> None:
        self.stream, self.tm, self.ends = stream, tm, ends

    def __aiter__(self) -> _EndingEarly:
        return self

    async def __anext__(self) -> Chunk:
        chunk = await anext(self.stream)
        if self.ends(chunk):
            await self.tm.abort(chunk.rid, self.MESSAGE)
        return chunk


async def _first(stream: AsyncIterator[Chunk]) -> Chunk | None:
    async for chunk in stream:
        return chunk
    return None


def _sse(data: Any) -> bytes:
    return b"data: " + _json.encode(data) + b"\n\n"


# -- routes ----------------------------------------------------------------------------


async def generate(request: Request, state: ServerState) -> Response:
    """SGLang's native API: one prompt or a batch; every streamed chunk holds the text so far."""
    state.refuse_if_overloaded()
    context, limits = await state.context_len(), state.runtime.tokenizer_manager.limits
    try:  # a prompt of ids longer than the context window is refused by the decoder, not copied and scanned
        obj = await decode_body(request, bounded_input(context, limits.max_batch_size))
    except BadRequest as exc:
        if exc.param and exc.param.startswith("input_ids") and "length <=" in str(exc):
            raise BadRequest(f"{exc.param}: longer than the context window ({context} tokens), or more than "
                             f"{max(context, limits.max_batch_size)} prompts", exc.param) from None
        raise
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
        texts[chunk.index] = texts.get(chunk.index, "") + chunk.text
        ids.setdefault(chunk.index, []).extend(chunk.token_ids)
        logprobs.setdefault(chunk.index, []).extend(chunk.logprobs)
        return native(chunk.index, chunk.rid, texts[chunk.index], ids[chunk.index], chunk.finished,
                      chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens,
                      logprobs[chunk.index], chunk.top_logprobs)

    return await run_request(request, state, obj, whole, piece)


async def completions(request: Request, state: ServerState) -> Response:
    return await _openai(request, state, "completion", CompletionRequest, completion_input)


async def chat_completions(request: Request, state: ServerState) -> Response:
    return await _openai(request, state, "chat", ChatRequest, chat_input)


def _thinking_first(convert: Callable[[Any], GenerateInput], parser: str, req: Any) -> GenerateInput:
    return thinking_first(convert(req), parser, req.structured_param())


def _convert(fn: Callable[[Any], GenerateInput], req: Any) -> GenerateInput:
    """The request as the tokenizer manager takes it (which checks the sampling values, once: its
    errors name OpenAI's fields through ``OPENAI_NAMES``)."""
    try:
        return fn(req)
    except InvalidRequest as exc:
        raise BadRequest(str(exc), param_of(str(exc))) from None


async def _openai(request: Request, state: ServerState, kind: str, shape: type,
                  convert: Callable[[Any], GenerateInput]) -> Response:
    state.refuse_if_overloaded()
    req = await decode_body(request, shape)
    state.check_model(req.model)
    reasoning = state.topology.server.reasoning_parser if kind == "chat" else None
    if reasoning is not None:  # a constraint binds the answer after the think block
        convert = partial(_thinking_first, convert, reasoning)
    if any(getattr(req, name, None) for name in ("tools", "response_format", "structured_outputs", "guided_json")):
        obj = await trio.to_thread.run_sync(_convert, convert, req)  # schemas are compiled and dumped: off the loop
    else:
        obj = _convert(convert, req)
    prompts = 1
    if kind == "completion" and not (isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int))):
        prompts = len(req.prompt)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    responder = Responder(kind, state.model_name, state.runtime.tokenizer, prompts * req.n, req.n,
                          tools=obj.tools is not None, strings=state.token_strings, reasoning=reasoning,
                          continuous_usage=include_usage and req.stream_options.continuous_usage_stats)
    return await run_request(
        request, state, obj, responder.whole, responder.stream_chunk,
        tail=lambda: [responder.usage_chunk()] if include_usage else [], names=OPENAI_NAMES,
        ends=responder.ends if obj.tools is not None else None,
    )


# the sampling fields as OpenAI's requests name them
OPENAI_NAMES = {"sampling_params.max_new_tokens": "max_tokens", "sampling_params.min_new_tokens": "min_tokens",
                "top_logprobs_num": "logprobs", "sampling_params.": ""}

"""A fake OpenAI-compatible server for exercising ``bench_serving`` itself.

It streams ``max_tokens`` fixed tokens per request with small sleeps (a
prefill delay, then one per token); it runs no model and measures nothing
about tercet. ``fail_every=k`` makes every k-th completion request fail,
alternating three ways: an HTTP 500, an error SSE event before any token,
and an error SSE event after a few tokens.

    async with trio.open_nursery() as nursery:
        base_url = await nursery.start(serve_stub, StubConfig())
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODEL = "stub-model"


@dataclass(frozen=True)
class StubConfig:
    prefill_s: float = 0.005  # before the first token
    token_s: float = 0.001  # between tokens
    tokens_per_chunk: int = 1  # > 1: chunks carry several tokens and usage
    fail_every: int = 0  # 0: never fail
    # llama-server's form: a token a chunk without usage, then an empty chunk with the finish_reason
    # and the whole usage (whatever stream_options asks)
    usage_in_last_chunk: bool = False


def build_app(config: StubConfig) -> Starlette:
    counter = itertools.count(1)
    encode = msgspec.json.encode

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(request: Request):
        body = await request.json()
        chat = request.url.path.endswith("/chat/completions")
        n = next(counter)
        failure = None
        if config.fail_every and n % config.fail_every == 0:
            failure = ("http", "event-first", "event-later")[(n // config.fail_every) % 3]
        if failure == "http":
            return JSONResponse({"error": {"message": "stub failure", "code": 500}},
                                status_code=500)
        if chat:
            prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        else:
            prompt = body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        max_tokens = int(body.get("max_tokens") or 16)
        usage_on = bool((body.get("stream_options") or {}).get("include_usage"))
        continuous = usage_on and bool(body["stream_options"].get("continuous_usage_stats"))
        rid = f"stub-{n}"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str, done: int, finish: str | None) -> bytes:
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish}
            event = {"id": rid, "object": obj, "created": int(time.time()), "model": MODEL,
                     "choices": [choice]}
            if continuous:  # vLLM's continuous_usage_stats: the usage so far in every chunk
                event["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done}
            return b"data: " + encode(event) + b"\n\n"

        async def stream():
            await trio.sleep(config.prefill_s)
            if failure == "event-first":
                yield b'data: {"error": {"message": "stub failure", "code": 500}}\n\n'
                return
            done = 0
            while done < max_tokens:
                step = min(config.tokens_per_chunk, max_tokens - done)
                done += step
                finish = "length" if done == max_tokens and not config.usage_in_last_chunk else None
                yield chunk(" tok" * step, done, finish)
                if failure == "event-later" and done >= min(3, max_tokens - 1):
                    yield b'data: {"error": {"message": "stub failure", "code": 500}}\n\n'
                    return
                if done < max_tokens:
                    await trio.sleep(config.token_s * step)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}
            if config.usage_in_last_chunk:
                choice = {"index": 0, "text": "", "finish_reason": "length"}
                if chat:
                    choice = {"index": 0, "delta": {"content": ""}, "finish_reason": "length"}
                yield b"data: " + encode({"id": rid, "object": obj, "model": MODEL, "choices": [choice],
                                          "usage": usage}) + b"\n\n"
            elif usage_on:
                yield b"data: " + encode({"id": rid, "object": obj, "model": MODEL,
                                          "choices": [], "usage": usage}) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
    ])


async def serve_stub(config: StubConfig = StubConfig(), *,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the stub on 127.0.0.1, port 0; ``started`` reports its base URL."""
    hyper = Config()
    hyper.bind = ["127.0.0.1:0"]
    hyper.accesslog = None
    hyper.errorlog = None
    hyper.loglevel = "WARNING"

    class _Started:
        def started(self, binds: list[str]) -> None:
            task_status.started(binds[0])

    await serve(build_app(config), hyper, task_status=_Started())

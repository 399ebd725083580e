"""The HTTP routes around generation: models, health, metrics, admin."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ..managers.messages import FlushCacheReq, SamplingParams
from ..managers.tokenizer_manager import GenerateInput
from .errors import BadRequest, decode_body
from .state import ServerState, merged_detokenizers, merged_info

__all__ = [
    "abort_request",
    "continue_generation",
    "flush_cache",
    "health",
    "health_generate",
    "metrics",
    "models",
    "pause_generation",
    "server_info",
    "update_weights_from_disk",
]


async def models(request: Request, state: ServerState) -> Response:
    return JSONResponse({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "tercet",
        "max_model_len": await state.context_len(),
    }]})


async def health(request: Request, state: ServerState) -> Response:
    problem = state.quick_health()
    if problem is not None:
        return PlainTextResponse(problem, status_code=503)
    if state.replicated:
        replicas = state.runtime.tokenizer_manager.replicas
        return PlainTextResponse(f"OK: {len(replicas.serving())} of {len(replicas)} replicas serving")
    return PlainTextResponse("OK")


async def livez(request: Request, state: ServerState) -> Response:
    """Liveness (Kubernetes' ``livenessProbe``): this process's event loop answers. Nothing about the
    scheduler or the replicas, which restarting this process would not bring back (that is /health)."""
    return PlainTextResponse("OK")


async def health_generate(request: Request, state: ServerState) -> Response:
    problem = await state.health_problem()
    if problem is not None:
        return PlainTextResponse(problem, status_code=503)
    if not state.runtime.gate.is_open:  # paused, or weights being replaced: no generation now
        return PlainTextResponse("generation is paused or the weights are being updated", status_code=503)
    obj = GenerateInput(input_ids=[1], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
    with trio.move_on_after(20.0):
        async with state.admitted(), aclosing(state.runtime.tokenizer_manager.generate(obj)) as stream:
            async for chunk in stream:
                if chunk.finished is not None:
                    if chunk.finished.type == "abort":
                        return PlainTextResponse(f"generation failed: {chunk.finished.message}", status_code=503)
                    return PlainTextResponse("OK")
    return PlainTextResponse("no token within 20 s", status_code=503)


async def metrics(request: Request, state: ServerState) -> Response:
    body = state.metrics.render(state.runtime, state.health.info)  # no wait on a busy scheduler
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def server_info(request: Request, state: ServerState) -> Response:
    runtime = state.runtime
    infos = await state.replica_infos()
    if not infos:
        raise BadRequest("no scheduler answers (restarting, or swamped)", status=503)
    info = msgspec.to_builtins(merged_info([i.scheduler for i in infos.values()]))
    detokenizer = merged_detokenizers([i.detokenizer for i in infos.values()])
    tm = runtime.tokenizer_manager
    info["replicas"] = state.replica_figures(infos)
    info["migrated"] = tm.migrated
    return JSONResponse({
        "model": state.model_name, "topology": without_secrets(msgspec.to_builtins(runtime.topology)),
        "restarts": runtime.status.restarts, "pids": runtime.status.pids(), "worker": runtime.worker,
        "admitting": runtime.tokenizer_manager.admitting,  # requests on their way in (e.g. held by a pause)
        "detokenizer": detokenizer, **info,
    })


SECRETS = ("api_key", "admin_api_key", "secret_key", "curve")
OPAQUE = ("args",)  # a placement's arguments for a custom actor: anything, a token among them


def without_secrets(value: Any) -> Any:
    """``value`` (plain data) with every key that names a secret, or opaque arguments, masked."""
    if isinstance(value, dict):
        return {k: ("***" if _masked(k, v) else without_secrets(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [without_secrets(v) for v in value]
    return value


def _masked(key: str, value: Any) -> bool:
    return (value is not None and any(word in key for word in SECRETS)) or (key in OPAQUE and bool(value))


class AbortBody(msgspec.Struct):
    rid: str


async def abort_request(request: Request, state: ServerState) -> Response:
    body = await decode_body(request, AbortBody)
    found = await state.runtime.tokenizer_manager.abort(body.rid)
    return JSONResponse({"rid": body.rid, "aborted": found})


async def flush_cache(request: Request, state: ServerState) -> Response:
    answers = await state.runtime.tokenizer_manager.replicas.call_all(FlushCacheReq())
    if not answers or any(isinstance(a, BaseException) for a in answers.values()):
        raise BadRequest("the scheduler does not answer (restarting, or swamped)", status=503)
    if not all(answers.values()):
        raise BadRequest("cannot flush the cache while requests are running or queued")
    return PlainTextResponse("Cache flushed.")


async def pause_generation(request: Request, state: ServerState) -> Response:
    await state.set_paused(True)
    return JSONResponse({"paused": True})


async def continue_generation(request: Request, state: ServerState) -> Response:
    await state.set_paused(False)
    return JSONResponse({"paused": False})


class UpdateWeightsBody(msgspec.Struct):
    model_path: str


async def update_weights_from_disk(request: Request, state: ServerState) -> Response:
    body = await decode_body(request, UpdateWeightsBody)
    return JSONResponse({"success": True, "message": await state.update_weights(body.model_path)})

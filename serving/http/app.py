"""The HTTP face: a Starlette app on hypercorn's trio worker.

Routes: SGLang's native ``/generate``; OpenAI's ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/models``; and ``/health``,
``/livez``, ``/health_generate``, ``/metrics``, ``/server_info``, ``/abort_request``,
``/flush_cache``, ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk``.

The app does not start anything itself: its lifespan enters the runtime
opener it was given (``serving.runtime.launch`` starts a topology; a
tokenizer worker hands in the runtime it runs) and stops it after.

Every bad request is a 400 with an OpenAI-style error body naming the field;
nothing a client sends makes a 500.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import trio
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..runtime.interface import Runtime
from ..runtime.topology import Topology, parse_size
from .admin import (
    abort_request,
    continue_generation,
    flush_cache,
    health,
    health_generate,
    livez,
    metrics,
    models,
    pause_generation,
    server_info,
    update_weights_from_disk,
)
from .errors import BadRequest, BodyBudget, error
from .generate import chat_completions, completions, generate
from .metrics import Metrics
from .openapi import OPEN, openapi
from .state import ServerState
from .tokens import detokenize, tokenize

__all__ = ["RuntimeOpener", "build_app", "hypercorn_config"]

log = logging.getLogger(__name__)

RuntimeOpener = Callable[[], AbstractAsyncContextManager[Runtime]]


def _state(request: Request) -> ServerState:
    return request.app.state.server


def routes_for(handler: Callable[[Request, ServerState], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request, _state(request))
        except BadRequest as exc:
            return error(exc.status, str(exc), param=exc.param)

    return endpoint


ROUTES = [
    ("/generate", generate, ["POST"]),
    ("/v1/completions", completions, ["POST"]),
    ("/v1/chat/completions", chat_completions, ["POST"]),
    ("/v1/models", models, ["GET"]),
    ("/health", health, ["GET"]),
    ("/health_generate", health_generate, ["GET"]),
    ("/livez", livez, ["GET"]),
    ("/metrics", metrics, ["GET"]),
    ("/server_info", server_info, ["GET"]),
    ("/get_server_info", server_info, ["GET"]),
    ("/abort_request", abort_request, ["POST"]),
    ("/flush_cache", flush_cache, ["POST", "GET"]),
    ("/pause_generation", pause_generation, ["POST"]),
    ("/continue_generation", continue_generation, ["POST"]),
    ("/update_weights_from_disk", update_weights_from_disk, ["POST"]),
    ("/openapi.json", openapi, ["GET"]),
    ("/tokenize", tokenize, ["POST"]),
    ("/detokenize", detokenize, ["POST"]),
]

UNPROTECTED = set(OPEN)  # /health, /livez, /openapi.json
ADMIN = {"/server_info", "/get_server_info", "/abort_request", "/flush_cache", "/pause_generation",
         "/continue_generation", "/update_weights_from_disk"}


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on every route but /health when ``api_key`` is set;
    the admin routes take ``admin_api_key`` instead when that is set. Keys are compared
    in constant time."""

    def __init__(self, app: Any, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.admin = None if admin_api_key is None else f"Bearer {admin_api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in UNPROTECTED:
            expected = self.admin if scope["path"] in ADMIN and self.admin is not None else self.expected
            if expected is not None:
                given = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not hmac.compare_digest(given, expected):
                    await error(401, "missing or wrong API key (Authorization: Bearer ...)")(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def build_app(topology: Topology, open_runtime: RuntimeOpener, *, metrics: Metrics | None = None) -> Starlette:
    """The app of ``topology``; its lifespan holds ``open_runtime()`` open while it serves.
    ``app.state.ready`` is set once it serves, ``app.state.server`` is its ServerState."""
    server = topology.server

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            async with open_runtime() as runtime, trio.open_nursery() as nursery:
                state = app.state.server = ServerState(runtime, metrics or Metrics())
                await runtime.status.scheduler_up()  # (replicas started elsewhere may come later)
                context = await state.context_len()
                await nursery.start(state.health.run)
                app.state.ready.set()
                if runtime.worker is None:  # (with tokenizer workers, the main process says it for all)
                    log.info("ready on http://%s:%d: model %s, context %d tokens, actors %s", server.host,
                             server.port, state.model_name, context, _actors(runtime))
                yield
                nursery.cancel_scope.cancel()
        except BaseException as exc:
            if not app.state.ready.is_set():
                app.state.startup_error = exc  # the caller says why in one line; hypercorn would dump it
            raise

    middleware = [Middleware(ApiKeyMiddleware, api_key=server.api_key, admin_api_key=server.admin_api_key)] \
        if server.api_key or server.admin_api_key else []
    routes = [Route(path, routes_for(fn), methods=methods) for path, fn, methods in ROUTES]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={404: _not_found, 405: _not_allowed})
    app.state.ready = trio.Event()
    app.state.max_request_bytes = parse_size(server.max_request_bytes, "server.max_request_bytes")
    budget = server.max_body_bytes_in_flight
    app.state.body_budget = BodyBudget(2 * app.state.max_request_bytes if budget is None
                                       else parse_size(budget, "server.max_body_bytes_in_flight"))
    app.state.body_timeout = server.body_timeout
    return app


def _actors(runtime: Runtime) -> str:
    """Each actor's address, as running (placeholders filled in), and its pid."""
    pids = runtime.status.pids()
    return ", ".join(f"{name} {address}" + (f" (pid {pids[name]})" if name in pids else "")
                     for name, address in runtime.addresses.items() if name in ("scheduler", "detokenizer"))


async def _not_found(request: Request, exc: Exception) -> Response:
    return error(404, f"no route {request.url.path}")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error(405, f"{request.method} is not allowed on {request.url.path}")


def hypercorn_config(bind: str, *, startup_timeout: float = 60.0) -> Config:
    """How tercet runs hypercorn: ``bind`` is ``HOST:PORT`` or ``fd://N`` (an inherited socket)."""
    config = Config()
    config.bind = [bind]
    config.accesslog = None
    config.graceful_timeout = 5.0
    config.startup_timeout = startup_timeout
    config.backlog = 2048  # hypercorn's 100 resets connections when hundreds arrive at once
    config.loglevel = "WARNING"  # not "Running on ...": tercet says when it is ready
    return config


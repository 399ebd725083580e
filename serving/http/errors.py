"""Errors as clients see them: OpenAI-style bodies, and the one mapping from a
request's abort reason to an HTTP status (503s carry ``Retry-After``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import aclosing, contextmanager, nullcontext
from math import inf
from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..managers.messages import FinishReason

__all__ = ["BadRequest", "BodyBudget", "decode_body", "error", "error_body", "finish_error", "param_of", "read_body"]

KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
         413: "invalid_request_error", 503: "service_unavailable"}


class BadRequest(Exception):
    """A request that cannot be served as sent: becomes ``error(status, message, param)``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_body(status: int, message: str, *, param: str | None = None, kind: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind or KINDS.get(status, "server_error"), "param": param,
                      "code": status}}


def error(status: int, message: str, *, param: str | None = None, kind: str | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(error_body(status, message, param=param, kind=kind), status_code=status, headers=headers)


def finish_error(reason: FinishReason | None) -> JSONResponse | None:
    """The error response for a request that ended in an abort with a status; else None."""
    if reason is None or reason.type != "abort" or reason.status_code is None:
        return None
    return error(reason.status_code, reason.message or "aborted")


def param_of(message: str) -> str | None:
    """The field a validation message starts with (``"top_p must be ..."`` → ``top_p``)."""
    head = message.split(":", 1)[0]
    return head if head and " " not in head else None


class BodyBudget:
    """Bytes of request bodies being read and decoded at once, across the requests of one process.

    Each body is refused with 413 past ``max_request_bytes`` alone; this bounds them together (a
    decoded body takes several times its bytes). A body that would pass ``limit`` is refused at once
    with 503 (Retry-After), never left waiting: a waiting upload would hold its connection anyway."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    @contextmanager
    def holding(self) -> Iterator[Callable[[int], None]]:
        """A ``take(size)`` for one body; all it took is given back on exit."""
        taken = 0

        def take(size: int) -> None:
            nonlocal taken
            if self.used + size > self.limit:
                raise BadRequest(f"server overloaded: {self.used} bytes of request bodies are being read; "
                                 f"this server reads at most {self.limit} at once "
                                 "(server.max_body_bytes_in_flight)", status=503)
            self.used += size
            taken += size

        try:
            yield take
        finally:
            self.used -= taken


async def read_body(request: Request, limit: int, take: Callable[[int], None] | None = None,
                    timeout: float = inf) -> bytes:
    """The body, refused with 413 as soon as it is known to pass ``limit`` bytes (never read whole), 408
    when it has not all arrived within ``timeout`` seconds (a slow upload); ``take(size)`` is called for
    each part as it arrives (a ``BodyBudget``'s, which may refuse it)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the body has {int(declared)} bytes; this server takes at most {limit}", status=413)
    parts, size = [], 0
    with trio.move_on_after(timeout) as deadline:
        async with aclosing(request.stream()) as stream:
            async for part in stream:
                size += len(part)
                if size > limit:
                    raise BadRequest(f"the body passes {limit} bytes, the most this server takes", status=413)
                if take is not None:
                    take(len(part))
                parts.append(part)
    if deadline.cancelled_caught:
        raise BadRequest(f"the body did not arrive within {timeout:g} s (server.body_timeout)", status=408)
    return b"".join(parts)


async def decode_body(request: Request, type_: Any) -> Any:
    """The body as ``type_``; 413 past ``request.app.state.max_request_bytes``, 408 past
    ``request.app.state.body_timeout``, 503 while ``request.app.state.body_budget`` is spent (its
    bytes are held until the body is decoded), 400 for anything that is not valid JSON of that shape
    (the message names the field)."""
    app_state = request.app.state
    budget: BodyBudget | None = getattr(app_state, "body_budget", None)
    with budget.holding() if budget is not None else nullcontext(None) as take:
        body = await read_body(request, app_state.max_request_bytes, take, getattr(app_state, "body_timeout", inf))
        return _decoded(body, type_)


def _decoded(body: bytes, type_: Any) -> Any:
    try:
        return msgspec.json.decode(body or b"{}", type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.split("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise BadRequest(f"invalid request: {text}", param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None

"""Errors as clients see them: OpenAI-style bodies, and the one mapping from a
request's abort reason to an HTTP status (503s carry ``Retry-After``)."""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..managers.messages import FinishReason

__all__ = ["BadRequest", "decode_body", "error", "error_body", "finish_error", "param_of", "read_body"]

KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
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


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to pass ``limit`` bytes (never read whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"the body has {int(declared)} bytes; this server takes at most {limit}", status=413)
    parts, size = [], 0
    async with aclosing(request.stream()) as stream:
        async for part in stream:
            size += len(part)
            if size > limit:
                raise BadRequest(f"the body passes {limit} bytes, the most this server takes", status=413)
            parts.append(part)
    return b"".join(parts)


async def decode_body(request: Request, type_: Any) -> Any:
    """The body as ``type_``; 413 past ``request.app.state.max_request_bytes``, 400 for
    anything that is not valid JSON of that shape (the message names the field)."""
    body = await read_body(request, request.app.state.max_request_bytes)
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

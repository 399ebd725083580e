"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

    {"model", "prompt"} or {"model", "messages"}  ->  {"tokens", "count", "max_model_len"}
    {"model", "tokens"}                           ->  {"prompt"}

The text is tokenized as generation would tokenize it (no special tokens
added; messages through the chat template with the generation prompt).
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..managers.messages import TokenId
from .errors import BadRequest, decode_body
from .state import ServerState

__all__ = ["DetokenizeBody", "Detokenized", "TokenizeBody", "Tokenized", "detokenize", "tokenize"]

LARGE = 16_384  # characters: tokenized in a worker thread, so other streams never stall


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[TokenId]
    model: str | None = None


class Tokenized(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class Detokenized(msgspec.Struct):
    prompt: str


async def tokenize(request: Request, state: ServerState) -> Response:
    state.refuse_if_overloaded()  # the same gate as generation: 503 before the body is read
    body = await decode_body(request, TokenizeBody)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("give exactly one of prompt or messages", "prompt")
    tokenizer = state.runtime.tokenizer

    def encode() -> list[int]:
        if body.messages is not None:
            try:
                text = tokenizer.apply_chat_template(body.messages, add_generation_prompt=body.add_generation_prompt,
                                                     tokenize=False)
            except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
                raise BadRequest(f"messages: cannot apply the chat template: {exc}", "messages") from None
        else:
            text = body.prompt
        return list(tokenizer(text, add_special_tokens=body.add_special_tokens).input_ids)

    size = len(body.prompt or "") + (len(msgspec.json.encode(body.messages)) if body.messages else 0)
    tokens = await trio.to_thread.run_sync(encode) if size > LARGE else encode()
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": await state.context_len()})


async def detokenize(request: Request, state: ServerState) -> Response:
    state.refuse_if_overloaded()  # the same gate as generation: 503 before the body is read
    body = await decode_body(request, DetokenizeBody)
    state.check_model(body.model)
    tokenizer = state.runtime.tokenizer

    def decode() -> str:
        vocab = len(tokenizer)
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise BadRequest(f"tokens: token id {bad} is outside the vocabulary (size {vocab})", "tokens")
        return tokenizer.decode(body.tokens)

    # millions of ids take seconds to check and decode: in a worker thread, so other streams never stall
    text = await trio.to_thread.run_sync(decode) if len(body.tokens) > LARGE else decode()
    return JSONResponse({"prompt": text})

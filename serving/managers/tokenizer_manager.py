"""The TokenizerManager: the API side of every request.

``generate(GenerateInput)`` tokenizes (chat templates included), registers a
``ReqState`` per sub-request in ``rid_to_state``, sends the requests to the
scheduler and yields ``Chunk``s as the detokenizer's outputs arrive. A
streaming caller forwards each chunk; a non-streaming one folds them.

Lifecycle: the state of a request is created when ``generate`` starts and
removed in one place, when ``generate`` ends — after the finish, or on
cancellation (a client gone), which also aborts the request downstream. So
there is one owner, no leak, and no abort/finish race.

Each ReqState keeps what a resume needs: prompt ids, the ids and text
received so far, and sampling parameters with a fixed seed.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import trio

from actors import Actor, CallError, Context, SoftWatchdog, WatchdogTimeout
from models.sampling import random_seed

from .messages import (
    AbortReq,
    AbortWhere,
    BatchStrOut,
    FinishReason,
    GenerateReq,
    RuntimeStatus,
    SamplingParams,
    TokenizerInbox,
)

__all__ = ["Chunk", "DuplicateRequestError", "GenerateInput", "ReqState", "TokenizerManager"]

log = logging.getLogger(__name__)


class DuplicateRequestError(ValueError):
    pass


class InvalidRequest(ValueError):
    """Bad input, with a message that names the field."""


class GenerateInput(msgspec.Struct, forbid_unknown_fields=True):
    """One generation request, SGLang's GenerateReqInput shape: single or batch."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None  # one prompt, or a batch of prompts
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the chat template
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0


@dataclass
class Chunk:
    """What one sub-request produced since its previous chunk."""

    index: int  # the sub-request: prompt index * n + sample index
    rid: str
    text: str
    token_ids: list[int]
    finished: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(eq=False)
class ReqState:
    """One sub-request. Downstream it is known as ``wire_rid`` (rid and epoch), so
    outputs still on their way from an incarnation that a resume replaced are
    recognised and ignored: no duplicate, no gap."""

    rid: str
    index: int
    prompt_ids: list[int]
    sampling: SamplingParams  # seed fixed: a resume samples the same
    stream: bool
    return_logprob: bool
    top_logprobs_num: int
    notify: Callable[[], None]
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished: FinishReason | None = None
    pending: list[Chunk] = field(default_factory=list)
    epoch: int = 0  # incarnations downstream: each resume starts a new one
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def wire_rid(self) -> str:
        return f"{self.rid}#{self.epoch}"


class TokenizerManager(Actor):
    inbox = TokenizerInbox

    def __init__(self, tokenizer: Any, *, scheduler: str, detokenizer: str | None = None, worker: int = 0,
                 watchdog_timeout: float = 300.0,
                 on_stall: Callable[[WatchdogTimeout], None] | None = None,
                 on_status: Callable[[RuntimeStatus], Awaitable[None]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.worker = worker
        self.rid_to_state: dict[str, ReqState] = {}
        self._by_wire_rid: dict[str, ReqState] = {}
        self.resumed = 0
        self.on_stall = on_stall
        self.on_status = on_status  # a tokenizer worker: news of the runtime from the main process
        self.watchdog = SoftWatchdog("tokenizer manager receive", watchdog_timeout,
                                     busy=lambda: bool(self.rid_to_state), on_fire=self._stalled)
        self._ids = itertools.count()

    async def on_start(self, ctx: Context) -> None:
        self.ctx = ctx
        await ctx.nursery.start(self.watchdog.run)

    def _stalled(self, report: WatchdogTimeout) -> None:
        log.error("no output for %g s with %d requests in flight", report.timeout, len(self.rid_to_state))
        if self.on_stall is not None:
            self.on_stall(report)

    # -- outputs from the detokenizer --------------------------------------------------

    async def handle(self, msg: Any) -> None:
        self.watchdog.feed()
        match msg:
            case BatchStrOut():
                self._handle_batch_output(msg)
            case RuntimeStatus():
                if self.on_status is not None:
                    await self.on_status(msg)

    def _handle_batch_output(self, out: BatchStrOut) -> None:
        now = time.monotonic()
        for i, wire_rid in enumerate(out.rids):
            state = self._by_wire_rid.get(wire_rid)
            if state is None or state.finished is not None:
                continue  # gone (its caller left), or an incarnation a resume replaced
            rid = state.rid
            ids, text = out.new_token_ids[i], out.texts[i]
            state.text += text
            state.output_ids.extend(ids)
            state.finished = out.finished[i]
            if ids and state.first_token_at is None:
                state.first_token_at = now
            if ids:
                state.last_token_at = now
            state.pending.append(Chunk(
                state.index, rid, text, ids, out.finished[i], out.prompt_tokens[i],
                out.completion_tokens[i], out.cached_tokens[i],
                out.logprobs[i] if out.logprobs else [],
                out.top_logprobs[i] if out.top_logprobs else [],
            ))
            state.notify()

    # -- the API -----------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template error is the request's fault
            raise InvalidRequest(f"messages: cannot apply the chat template: {exc}") from None
        return self.tokenize(rendered)

    def expand(self, obj: GenerateInput) -> list[tuple[str, list[int], SamplingParams]]:
        """The sub-requests of ``obj``: (rid, prompt ids, sampling) per prompt × n."""
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
            if (problem := p.check()) is not None:
                raise InvalidRequest(f"sampling_params: {problem}")
            for k in range(p.n):
                seed = p.seed + k if p.seed is not None else (random_seed() if p.temperature > 0 else None)
                sub_rid = rid if p.n == 1 else f"{rid}-{k}"
                subs.append((sub_rid, ids, msgspec.structs.replace(p, seed=seed, n=1)))
        return subs

    def _prompts(self, obj: GenerateInput) -> list[list[int]]:
        given = [x for x in (obj.text, obj.input_ids, obj.messages) if x is not None]
        if len(given) != 1:
            raise InvalidRequest("give exactly one of text, input_ids or messages")
        if obj.messages is not None:
            return [self.apply_chat_template(obj.messages)]
        if obj.text is not None:
            texts = [obj.text] if isinstance(obj.text, str) else obj.text
            return [self.tokenize(t) for t in texts]
        ids = obj.input_ids
        batch = ids if ids and isinstance(ids[0], list) else [ids]
        if any(not isinstance(p, list) for p in batch) or any(isinstance(t, list) for p in batch for t in p):
            raise InvalidRequest("input_ids: give a list of token ids, or a list of such lists")
        vocab = len(self.tokenizer)
        for prompt in batch:
            if not prompt:
                raise InvalidRequest("input_ids: a prompt is empty")
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(f"input_ids: token id {bad} is outside the vocabulary (size {vocab})")
        return [list(p) for p in batch]

    async def generate(self, obj: GenerateInput) -> AsyncIterator[Chunk]:
        subs = self.expand(obj)
        rids = [rid for rid, _, _ in subs]
        duplicates = sorted({r for r in rids if r in self.rid_to_state or rids.count(r) > 1})
        if duplicates:
            raise DuplicateRequestError(f"rid: duplicate request id(s) {duplicates}")
        arrived = trio.Event()

        def notify() -> None:
            arrived.set()

        states = [
            ReqState(rid, index, ids, sampling, obj.stream, obj.return_logprob, obj.top_logprobs_num, notify)
            for index, (rid, ids, sampling) in enumerate(subs)
        ]
        for state in states:
            self.rid_to_state[state.rid] = state
            self._by_wire_rid[state.wire_rid] = state
        try:
            for state in states:
                await self._submit(state)
            unfinished = len(states)
            while unfinished:
                await arrived.wait()
                arrived = trio.Event()
                for state in states:
                    chunks, state.pending = state.pending, []
                    for chunk in chunks:
                        unfinished -= chunk.finished is not None
                        yield chunk
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                for state in states:
                    if state.finished is None:
                        state.finished = FinishReason("abort", message="the client went away")
                        await self.ctx.send(self.scheduler, AbortReq(state.wire_rid, "the client went away"))
            for state in states:
                del self.rid_to_state[state.rid]
                del self._by_wire_rid[state.wire_rid]

    async def _submit(self, state: ReqState, *, resume: bool = False) -> None:
        replaces = None
        if resume:
            replaces = state.wire_rid
            del self._by_wire_rid[replaces]
            state.epoch += 1
            self._by_wire_rid[state.wire_rid] = state
        ids = np.asarray(state.prompt_ids + state.output_ids, dtype=np.int32)
        await self.ctx.send(self.scheduler, GenerateReq(
            state.wire_rid, ids, state.sampling, state.stream, state.return_logprob,
            state.top_logprobs_num, self.worker, len(state.output_ids) if resume else 0, replaces,
        ))

    async def abort(self, rid: str, message: str = "aborted by request") -> bool:
        """Abort a request by id; False when no such request is in flight.

        A request of another tokenizer worker is aborted by the scheduler,
        which knows every request; its owner then sees it end."""
        state = self.rid_to_state.get(rid)
        if state is None:
            try:
                return bool(await self.call_scheduler(AbortWhere(rid=rid, message=message), timeout=5.0))
            except CallError:
                return False
        await self.ctx.send(self.scheduler, AbortReq(state.wire_rid, message))
        return True

    async def resubmit_in_flight(self) -> int:
        """After a restart downstream: continue every unfinished request from what it has."""
        count = 0
        for state in list(self.rid_to_state.values()):
            if state.finished is None:
                await self._submit(state, resume=True)
                count += 1
        self.resumed += count
        if count:
            log.warning("resumed %d requests in flight", count)
        return count

    def fail_all(self, message: str, status_code: int = 503) -> int:
        """End every request in flight with an error (the runtime gave up)."""
        count = 0
        for state in self.rid_to_state.values():
            if state.finished is None:
                state.finished = FinishReason("abort", message=message, status_code=status_code)
                state.pending.append(Chunk(state.index, state.rid, "", [], state.finished, len(state.prompt_ids),
                                           len(state.output_ids), 0))
                state.notify()
                count += 1
        return count

    async def call_scheduler(self, msg: Any, *, timeout: float = 10.0) -> Any:
        return await self.ctx.call(self.scheduler, msg, timeout=timeout)

    async def call_detokenizer(self, msg: Any, *, timeout: float = 10.0) -> Any:
        if self.detokenizer is None:
            raise CallError("no detokenizer address given")
        return await self.ctx.call(self.detokenizer, msg, timeout=timeout)


def fold(chunks: Sequence[Chunk]) -> dict[str, Any]:
    """A non-streaming result from one sub-request's chunks."""
    last = chunks[-1]
    return {
        "rid": last.rid,
        "text": "".join(c.text for c in chunks),
        "output_ids": [t for c in chunks for t in c.token_ids],
        "finished": last.finished,
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
        "logprobs": [lp for c in chunks for lp in c.logprobs],
        "top_logprobs": [t for c in chunks for t in c.top_logprobs],
    }

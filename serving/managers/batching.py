"""The scheduler's state: waiting queue, running batch, pages, stop checks.

Pure and synchronous: the Scheduler actor feeds it messages and runs the
model; this module decides what each step computes and what it produced.
One step reads as: ``batch = state.schedule()``, ``out = runner.step(batch.seqs)``,
``rows = state.postprocess(batch, out)``.

Memory: a running request holds pages for every token whose K/V is cached.
Its prefix may be shared, owned by the radix cache and locked while it runs.
When a decode would not fit, the newest running requests are retracted:
their tokens go into the prefix cache (evictable), they return to the
front of the waiting queue with their progress, and resume later, mostly
from the cache.

Speculative decoding (``speculative.py``): a decoding request may run its
last token with a draft after it, an extend of 1 + k tokens; ``postprocess``
keeps the draws while they confirm the draft and applies the stop checks to
each token it keeps, as one decode step per token would. The K/V of the
rejected positions lie past ``num_kv`` in the request's own pages (like the
slots taken ahead), are overwritten by its next step and never reach the
prefix cache; drafts take pages only from a pool with room to spare.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.errors import OutOfPages
from models.runner import SeqInput, StepOutput
from models.sampling import SamplingParams as ModelSampling

from .grammar import constraint_of
from .messages import FinishReason, GenerateReq, GenerateReqId, SamplingParams
from .radix_cache import RadixCache
from .speculative import Drafter, SpeculativeConfig

__all__ = ["Batch", "BatchState", "Limits", "Output", "Req"]

log = logging.getLogger(__name__)

READ_AHEAD_TOKENS = 32  # KV slots a growing request takes ahead of need (see BatchState._grow)


@dataclass(frozen=True)
class Limits:
    max_running_requests: int = 64
    max_queued_requests: int = 1024
    chunked_prefill_size: int = 2048
    schedule_policy: str = "fcfs"  # or "lpm": longest cached prefix first
    max_context_len: int = 8192
    stream_interval: int = 1  # send a request's tokens every so many (its first and last at once)


@dataclass(eq=False)
class Req:
    rid: str
    worker: int
    tokens: list[int]  # prompt, then everything generated (prior incarnations included)
    num_prompt: int
    num_prior: int  # generated before a resume
    sampling: SamplingParams
    params: ModelSampling
    stream: bool
    return_logprob: bool
    top_logprobs_num: int
    pages: list[int] = field(default_factory=list)
    num_kv: int = 0  # tokens whose K/V sit in ``pages``
    handle: Any = None  # the locked radix node of the shared prefix
    num_shared_pages: int = 0  # the first pages, owned by the prefix cache
    cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    replaces: str | None = None
    finished: FinishReason | None = None
    sent_init: bool = False
    matcher: Any = None  # its grammar's state (an llguidance LLMatcher) when it is constrained
    held: Output | None = None  # tokens not sent yet (Limits.stream_interval)
    alone: bool = False  # on probation: each step runs it in a model call of its own (GenerateReq.alone)
    boot: str = ""  # the tokenizer manager's incarnation that sent it (GenerateReq.boot)
    drafter: Drafter | None = None  # its speculative drafts (None: plain decoding)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    def prompt_ids(self) -> list[int]:
        return self.tokens[: self.num_prompt]


@dataclass
class Batch:
    reqs: list[Req]
    seqs: list[SeqInput]

    def __bool__(self) -> bool:
        return bool(self.reqs)


@dataclass
class Output:
    """One request's result of a step (or its end without a step)."""

    req: Req
    new_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


def _greedy(s: SamplingParams) -> bool:
    return s.temperature == 0 or s.top_k == 1


def _max_new(s: SamplingParams) -> int:
    """None (the tokenizer manager resolves it; here for a direct sender): up to the context window."""
    return s.max_new_tokens if s.max_new_tokens is not None else 2**31 - 1


def to_model_sampling(s: SamplingParams) -> ModelSampling:
    bias = tuple((int(t), float(b)) for t, b in (s.logit_bias or {}).items())
    return ModelSampling(
        temperature=s.temperature, top_k=s.top_k if s.top_k > 0 else 0, top_p=s.top_p,
        min_p=s.min_p, repetition_penalty=s.repetition_penalty,
        frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty, seed=s.seed,
        logit_bias=bias,
    )


class BatchState:
    def __init__(self, kv: Any, cache: RadixCache | None, eos_token_ids: frozenset[int],
                 limits: Limits, vocab_size: int | None = None,
                 speculative: SpeculativeConfig | None = None) -> None:
        self.kv = kv
        self.speculative = speculative if speculative is not None else SpeculativeConfig()
        self.draft_tokens = 0  # draft tokens verified, and accepted (speculative decoding)
        self.accepted_tokens = 0
        self.vocab_size = vocab_size
        self.grammars: Any = None  # a serving.managers.grammar.Grammars, once the scheduler has one
        self.cache = cache
        self.eos_token_ids = eos_token_ids
        self.limits = limits
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.by_rid: dict[str, Req] = {}
        self.retracted = 0
        self.aborted = 0  # requests ended by an abort while queued or running
        self._refused: list[Output] = []

    # -- requests in and out ------------------------------------------------------

    def add(self, msg: GenerateReq, *, top_logprobs_cap: int = 20) -> Output | None:
        """Queue a request; an Output when it ends at once (rejected or nothing to do)."""
        ids = np.asarray(msg.input_ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(f"input_ids must be a 1-D integer array, not {ids.ndim}-D {ids.dtype}")
        tokens = ids.tolist()
        if self.vocab_size is not None and tokens and not 0 <= min(tokens) <= max(tokens) < self.vocab_size:
            raise ValueError(f"input_ids: a token id is outside the vocabulary (size {self.vocab_size})")
        req = Req(
            msg.rid, msg.worker, tokens, len(tokens) - msg.num_prior_output, msg.num_prior_output,
            msg.sampling, to_model_sampling(msg.sampling), msg.stream, msg.return_logprob,
            max(0, min(msg.top_logprobs_num, top_logprobs_cap)), replaces=msg.replaces, alone=msg.alone,
            boot=msg.boot,
        )
        if msg.rid in self.by_rid:  # the live one keeps running; this one is refused
            return self._end_now(req, FinishReason("abort", status_code=400,
                                                   message=f"rid: request {msg.rid} is already in flight"))
        if msg.replaces is not None and msg.replaces in self.by_rid:  # a resume replaces the old incarnation
            self.drop(msg.replaces)
        capacity = self.kv.num_pages * self.kv.page_size
        if not tokens or req.num_prompt <= 0:
            return self._end_now(req, FinishReason("abort", message="the prompt is empty", status_code=400))
        limit = min(capacity, self.limits.max_context_len)
        if len(tokens) + 1 > limit:
            return self._end_now(req, FinishReason(
                "abort", status_code=400,
                message=f"the prompt has {len(tokens)} tokens; this server holds at most {limit - 1}",
            ))
        resume = msg.resume or msg.replaces is not None or msg.num_prior_output > 0
        if len(self.waiting) >= self.limits.max_queued_requests and not resume:  # resumes may exceed it
            return self._end_now(req, FinishReason(
                "abort", status_code=503,
                message=f"server overloaded: {len(self.waiting)} requests already queued",
            ))
        if req.num_generated >= _max_new(msg.sampling):
            return self._end_now(req, FinishReason("length", matched=_max_new(msg.sampling)))
        constraint = constraint_of(msg.sampling)
        if constraint is not None:
            if self.grammars is None:
                raise ValueError("constrained decoding is not ready in this scheduler")
            req.matcher = self.grammars.matcher(*constraint)
            for token in req.output_ids:  # a resume: replay what the client already has
                if not req.matcher.consume_token(token):
                    return self._end_now(req, FinishReason(
                        "abort", status_code=500, message="the output so far does not match the request's grammar"))
        if self.speculative.enabled and req.matcher is None:  # a grammar's mask is for one next token only
            req.drafter = Drafter(self.speculative)
        self.by_rid[req.rid] = req
        self.waiting.append(req)
        return None

    def refuse(self, msg: GenerateReq | GenerateReqId, reason: FinishReason) -> Output:
        """End a request that could not be queued (its fields may be anything)."""
        req = Req(str(msg.rid), int(msg.worker) if isinstance(msg.worker, int) else 0, [], 0, 0, SamplingParams(),
                  ModelSampling(), False, False, 0, replaces=None)
        return self._end_now(req, reason)

    def take_refused(self) -> list[Output]:
        """The requests ``schedule`` ended because they could not be laid out (see ``_lay_out``)."""
        refused, self._refused = self._refused, []
        return refused

    def _end_now(self, req: Req, reason: FinishReason) -> Output:
        req.finished = reason
        return Output(req, [], [], [])

    def abort(self, rid: str, reason: FinishReason) -> Output | None:
        """End a request now; its Output (to tell downstream), or None if unknown."""
        req = self.by_rid.get(rid)
        if req is None:
            return None
        self.drop(rid)
        self.aborted += 1
        req.finished = reason
        return Output(req, [], [], [])

    def drop(self, rid: str) -> None:
        """Forget a request and give back its memory, telling no one."""
        req = self.by_rid.pop(rid)
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._release(req, keep=False)

    @property
    def idle(self) -> bool:
        return not self.by_rid

    # -- one step -------------------------------------------------------------------

    def schedule(self) -> Batch:
        self._make_room_for_decodes()
        budget = self.limits.chunked_prefill_size
        batch = Batch([], [])
        for req in list(self.running):
            remaining = len(req.tokens) - req.num_kv
            if remaining > 1 and budget <= 0:
                continue  # its next prefill chunk waits for the next step
            n = 1 if remaining == 1 else min(remaining, budget)
            if not self._grow(req, n):
                continue
            if remaining > 1:
                budget -= n
            draft = self._draft(req) if remaining == 1 and req.drafter is not None else []
            self._add_to_batch(batch, req, n, draft)
        for req in self._admission_order():
            if budget <= 0 or len(self.running) >= self.limits.max_running_requests:
                break
            if not self._admit(req, budget):
                break
            n = min(len(req.tokens) - req.num_kv, budget)
            budget -= n
            self._add_to_batch(batch, req, n)
        return batch

    def _add_to_batch(self, batch: Batch, req: Req, n: int, draft: list[int] | None = None) -> None:
        try:
            seq = self._lay_out(req, n, draft)
        except Exception as exc:  # noqa: BLE001 - this request's fault: it ends, the step goes on
            log.exception("request %s cannot be laid out for a step", req.rid)
            output = self.abort(req.rid, FinishReason("abort", status_code=500,
                                                      message=f"the request could not be run: {exc!r}"))
            if output is not None:
                self._refused.append(output)
            return
        batch.reqs.append(req)
        batch.seqs.append(seq)

    def _lay_out(self, req: Req, n: int, draft: list[int] | None = None) -> SeqInput:
        new = req.tokens[req.num_kv : req.num_kv + n]
        last = req.num_kv + n == len(req.tokens)
        return SeqInput(new + draft if draft else new, req.pages, req.num_kv, last, _with_logprobs(req),
                        req.prompt_ids(), req.output_ids, num_draft=len(draft) if draft else 0)

    def _draft(self, req: Req) -> list[int]:
        """The draft ``req`` verifies this step (its decode already has its page): none while more
        than ``max_batch`` requests run (``max_batch_sampled`` for a sampled request); never more tokens than
        it may still emit less one (the draw after the draft is emitted too); cut to its own pages when
        the pool has no room to spare."""
        if len(self.running) > self.speculative.max_batch or req.alone:  # (on probation: one call, no more rows)
            return []
        if len(self.running) > self.speculative.max_batch_sampled and not _greedy(req.sampling):
            return []  # (sampled drafts hold a third of the time: they pay alone, where extra rows cost ~nothing)
        limit = min(_max_new(req.sampling) - req.num_generated, self.limits.max_context_len - len(req.tokens)) - 1
        draft = req.drafter.draft(req.tokens, limit)
        if not draft:
            return draft
        room = len(req.pages) * self.kv.page_size - req.num_kv - 1  # slots held past the decoded token
        if room < len(draft):
            wanted = self.kv.pages_for(req.num_kv + 1 + len(draft)) - len(req.pages)
            if wanted <= (self.kv.num_free - len(self.running)) // 2:  # leave the decodes of this step theirs
                req.pages.extend(self.kv.allocate(wanted + self._ahead(req, wanted), after=req.pages[-1]))
            else:
                draft = draft[: max(room, 0)]
        return draft

    def postprocess(self, batch: Batch, sampled: StepOutput) -> list[Output]:
        outputs = []
        for i, (req, seq) in enumerate(zip(batch.reqs, batch.seqs)):
            req.num_kv += len(seq.token_ids) - seq.num_draft
            token = sampled.token_ids[i]
            if token is None or req.finished is not None or req.rid not in self.by_rid:
                continue  # a prefill chunk, or aborted while the step ran
            new_ids, logprobs, top = [], [], []
            for j, (token, logprob, alternatives) in enumerate(self._emitted(req, seq, sampled, i)):
                if j:  # the draft token before it was accepted: its K/V stands
                    req.num_kv += 1
                req.tokens.append(token)
                new_ids.append(token)
                if req.return_logprob:
                    logprobs.append(logprob)
                    if req.top_logprobs_num:
                        top.append(alternatives or [])
                req.finished = self._stop_reason(req, token) or self._grammar_end(req, token)
                if req.finished is not None:
                    break
            if req.finished is not None:
                del self.by_rid[req.rid]
                self.running.remove(req)
                self._release(req, keep=True)
            out = Output(req, new_ids, logprobs, top)
            if req.held is not None:  # the tokens stream_interval held back go first
                held, req.held = req.held, None
                out = Output(req, held.new_ids + out.new_ids, held.logprobs + out.logprobs,
                             held.top_logprobs + out.top_logprobs)
            if req.finished is None and self._holds(req, len(new_ids)):
                req.held = out
            else:
                outputs.append(out)
        return outputs

    def _emitted(self, req: Req, seq: SeqInput, sampled: StepOutput, i: int) -> list[tuple[int, float, Any]]:
        """(token, logprob, top logprobs) a step gave ``req``: the token drawn after its last token, then,
        while each draw equals the draft token it was drawn at, the draw after that draft token. Draws
        a step did not report (a request stepped alone after a failure, a draw past NaN logits) count as the
        draft rejected there."""
        emitted = [(sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i])]
        k = seq.num_draft
        if not k:
            return emitted
        draws = sampled.drafts[i] if sampled.drafts else None
        draft = seq.token_ids[len(seq.token_ids) - k :]
        accepted = 0
        while draws is not None and accepted < len(draws.token_ids) and emitted[-1][0] == draft[accepted]:
            emitted.append((draws.token_ids[accepted], draws.logprobs[accepted], draws.top_logprobs[accepted]))
            accepted += 1
        req.drafter.verified(k, accepted)
        self.draft_tokens += k
        self.accepted_tokens += accepted
        return emitted

    def _holds(self, req: Req, n_new: int = 1) -> bool:
        """Whether the ``n_new`` tokens just generated wait for more (stream_interval): not when they hold
        the first of this incarnation or reach a multiple of the interval."""
        interval = self.limits.stream_interval
        fresh = req.num_generated - req.num_prior
        before = fresh - n_new
        return interval > 1 and before > 0 and fresh // interval == before // interval

    def _grammar_end(self, req: Req, token: int) -> FinishReason | None:
        """A constrained request ends when its grammar can go no further (or, never, rejects a token)."""
        matcher = req.matcher
        if matcher is None:
            return None
        if not matcher.consume_token(token):  # llguidance's mask allowed what it now refuses: seen with
            # regexes of exotic code points over byte-level tokens; the constraint is what cannot be followed
            return FinishReason("abort", status_code=400, message=(
                f"the request's constraint cannot be followed with this model's tokens (its grammar refused "
                f"token {token}, which its own mask allowed: {matcher.get_error() or 'no reason given'})"))
        if matcher.is_stopped():
            return FinishReason("stop", matched=None)
        return None

    def constrained(self, batch: Batch) -> list[tuple[int, Any]]:
        """(index in the batch, matcher) of the sequences of ``batch`` whose next token a grammar picks."""
        return [(i, req.matcher) for i, (req, seq) in enumerate(zip(batch.reqs, batch.seqs))
                if req.matcher is not None and seq.sample]

    def _stop_reason(self, req: Req, token: int) -> FinishReason | None:
        s = req.sampling
        if req.num_generated >= s.min_new_tokens:
            if not s.ignore_eos and token in self.eos_token_ids:
                return FinishReason("stop", matched=token)
            if token in s.stop_token_ids:
                return FinishReason("stop", matched=token)
        if req.num_generated >= _max_new(s):
            return FinishReason("length", matched=_max_new(s))
        if len(req.tokens) >= self.limits.max_context_len:
            return FinishReason("length", matched=len(req.tokens))
        return None

    # -- memory ---------------------------------------------------------------------

    def _admission_order(self) -> list[Req]:
        if self.limits.schedule_policy == "lpm" and self.cache is not None and len(self.waiting) > 1:
            return sorted(self.waiting, key=lambda r: -self.cache.prefix_len(r.tokens))
        return list(self.waiting)

    def _admit(self, req: Req, budget: int) -> bool:
        if self.cache is not None and req.num_kv == 0:
            match = self.cache.match_prefix(req.tokens)  # leaves one token to compute
            req.pages, req.num_kv, req.handle = list(match.pages), match.num_tokens, match.handle
            req.num_shared_pages = len(req.pages)
            self.cache.lock(req.handle)
        if req.cached_tokens < 0:
            req.cached_tokens = req.num_kv
        n = min(len(req.tokens) - req.num_kv, budget)
        if not self._grow(req, n):
            self._release(req, keep=False)
            return False
        self.waiting.remove(req)
        self.running.append(req)
        return True

    def _grow(self, req: Req, n: int) -> bool:
        """Pages for ``n`` more tokens of ``req``, evicting cached prefixes if needed.

        A few pages more are taken while the pool has room (``_ahead``), so that the
        tokens a request decodes one a step lie side by side in the cache: decode
        attention reads each row's context, and scattered rows read 1.2-1.5x slower."""
        wanted = self.kv.pages_for(req.num_kv + n) - len(req.pages)
        if wanted <= 0:
            return True
        if wanted > self.kv.num_free and self.cache is not None:
            self.cache.evict(wanted - self.kv.num_free)
        try:
            req.pages.extend(self.kv.allocate(wanted + self._ahead(req, wanted),
                                              after=req.pages[-1] if req.pages else None))
        except OutOfPages:
            return False
        return True

    def _ahead(self, req: Req, wanted: int) -> int:
        """Pages to take beyond ``wanted``: up to READ_AHEAD_TOKENS' worth, never past the
        request's last token, and only from a pool with room to spare (a sixteenth of what is
        free), so reserving never evicts, retracts or refuses anything."""
        last = min(req.num_prompt + _max_new(req.sampling), self.limits.max_context_len)
        until_end = self.kv.pages_for(last) - len(req.pages) - wanted
        spare = (self.kv.num_free - wanted) // 16
        return max(0, min(self.kv.pages_for(READ_AHEAD_TOKENS), until_end, spare))

    def _make_room_for_decodes(self) -> None:
        decoding = [r for r in self.running if len(r.tokens) - r.num_kv == 1]
        while decoding:
            wanted = sum(max(0, self.kv.pages_for(r.num_kv + 1) - len(r.pages)) for r in decoding)
            if wanted > self.kv.num_free and self.cache is not None:
                self.cache.evict(wanted - self.kv.num_free)
            if wanted <= self.kv.num_free:
                return
            victim = self.running[-1]  # the newest
            if len(self.running) == 1:
                return  # alone and still too big: _grow fails, it waits (cannot happen: checked at add)
            self._retract(victim)
            if victim in decoding:
                decoding.remove(victim)

    def _retract(self, req: Req) -> None:
        log.info("retracting %s (%d tokens) under KV pressure", req.rid, len(req.tokens))
        self.running.remove(req)
        self._release(req, keep=True)
        self.waiting.appendleft(req)
        self.retracted += 1

    def _release(self, req: Req, *, keep: bool) -> None:
        """Give back a request's pages; with ``keep`` its computed prefix goes to the cache."""
        pages, num_kv, shared = req.pages, req.num_kv, req.num_shared_pages
        req.pages, req.num_kv, req.num_shared_pages = [], 0, 0
        if self.cache is None:
            to_free = pages
        elif keep and num_kv:
            full = num_kv // self.kv.page_size  # the cache takes whole pages, frees duplicates
            self.cache.insert(req.tokens[: full * self.kv.page_size], pages[:full])
            to_free = pages[full:]
        else:
            to_free = pages[shared:]
        if req.handle is not None:
            self.cache.unlock(req.handle)
            req.handle = None
        if to_free:
            self.kv.free(to_free)


def _with_logprobs(req: Req) -> ModelSampling:
    if req.top_logprobs_num and req.params.top_logprobs != req.top_logprobs_num:
        req.params = ModelSampling(**{**req.params.__dict__, "top_logprobs": req.top_logprobs_num})
    return req.params

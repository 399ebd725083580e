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

Before that, a request on its way in (waiting to be admitted while
generation is paused or the scheduler restarts, then being tokenized) is an
``Admission``: an ``abort`` of its rid finds it there, ends its wait, and
``generate`` then ends it without sending it anywhere.

``request_timeout`` (``server.request_timeout``; off by default): a request
that hears nothing of its own for that long since its last output or its
(re)submission — starved in the queue, or lost downstream, while other
requests' outputs keep the output watchdog fed — ends with a 504 and is
aborted downstream.

Resume and poison quarantine: after the scheduler or the detokenizer
restarted, ``resubmit_in_flight`` sends every unfinished request again as
a new incarnation. A crash of a scheduler (not an output stall, a detokenizer
restart or a replica lost: ``blames``) counts against the requests that were
in the step that died, as the scheduler's step journal says (``journal.py``;
every request in flight where there is none). Once one was blamed for
``quarantine_after`` crashes in a row without progress (``PROGRESS_TOKENS``)
since its last resume, the cause may be the request itself (a poison request
that crashes whatever runs it): such requests resume *on probation*, in
groups of ``PROBATION_GROUP``, each group waiting for the previous one to
make progress or for its ``trial_timeout``; new requests wait meanwhile, at
most ``hold_timeout`` (``server.request_wait``). Requests on trial run in a
model call of their own each (``GenerateReq.alone``), so the journal of a call
that kills the process names one of them: the culprit. It ends with an error
(500) naming the crash and is never resumed again; the others carry on.
Without a journal, a group on trial that dies is halved, each half tried on
its own, down to one. (A crash from outside — a kill -9 —
that lands while a request on trial is in the step is blamed on it too: the
price of never letting one request crash-loop the server.)

Data-parallel replicas (``scheduler.replicas``): each replica is a scheduler
and its own detokenizer, held with the ``Router`` that picks the replica of
each new request by a ``ReplicaPool`` (``replica_pool.py``; a pool of one
without replicas). When a replica goes down (``replica_down``: its scheduler or detokenizer
crashed, hung, or it left the pool) its requests resume at once on the
replicas still up, by the same protocol as after a restart — the old
incarnation is aborted where it may still run — and only wait when no
replica is up. Each replica has its own output watchdog.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import trio

from actors import Actor, CallError, Context, SoftWatchdog, WatchdogTimeout

from .inputs import DuplicateRequestError, Expander, GenerateInput, InvalidRequest, RequestLimits, SubRequest
from .journal import read_step
from .messages import (
    AbortReq,
    AbortWhere,
    BatchStrOut,
    FinishReason,
    ForgetRequests,
    GenerateReq,
    RuntimeStatus,
    SamplingParams,
    ServerInfo,
    ServerInfoReq,
    TokenizerInbox,
    WireCheck,
)
from .replica_pool import ReplicaPool

__all__ = ["Admission", "Chunk", "DuplicateRequestError", "GenerateInput", "InvalidRequest", "ReqState",
           "RequestLimits", "TokenizerManager", "fold"]

log = logging.getLogger(__name__)

# A request on probation is cleared once it has produced this many tokens (or ended): a
# request that kills the scheduler at some position does so again within a few tokens of it.
PROGRESS_TOKENS = 8
PROBATION_GROUP = 4  # suspects tried together; a group that crashes the server is halved, down to one
FORGIVEN_REPEATS = 2  # at most so many crashes per request are its own (see suspect_crashed), whatever the quarantine


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
    """One sub-request. Downstream it is known as ``wire_rid`` (rid, tokenizer worker
    and epoch: unique across workers), so outputs still on their way from an
    incarnation that a resume replaced are recognised and ignored: no duplicate, no gap."""

    rid: str
    index: int
    worker: int
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
    submitted: bool = False  # sent downstream at least once (a batch is sent one by one)
    crashes: int = 0  # crashes downstream while it was in flight
    since_submit: int = 0  # tokens received since the last (re)submission
    progressed: trio.Event = field(default_factory=trio.Event)  # PROGRESS_TOKENS since then, or the end
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    heard_at: float = 0.0  # trio time of its last output or (re)submission (request_timeout)
    replica: int | None = None  # where its current incarnation runs; None: nowhere (yet, or waiting)
    last_replica: int | None = None  # where its previous incarnation ran

    @property
    def wire_rid(self) -> str:
        return f"{self.rid}#{self.worker}.{self.epoch}"

    def end(self, reason: FinishReason) -> None:
        """Finish here, without waiting for downstream (its outputs are ignored from now)."""
        self.finished = reason
        self.progressed.set()
        self.pending.append(Chunk(self.index, self.rid, "", [], reason, len(self.prompt_ids),
                                  len(self.output_ids), 0))
        self.notify()


class Admission:
    """A request on its way in, from its arrival until ``generate`` has its sub-requests
    (``TokenizerManager.admission``): an abort of one of its ``rids`` ends it here — its
    wait (run it in ``scope``) is cancelled and ``generate`` ends it unrun (``ended``)."""

    def __init__(self, rids: list[str], registry: set[Admission]) -> None:
        self.rids = rids
        self.scope = trio.CancelScope()
        self.ended: FinishReason | None = None
        self._registry = registry
        registry.add(self)

    def abort(self, message: str) -> None:
        self.ended = FinishReason("abort", message=message)
        self.scope.cancel()
        self.close()

    def close(self) -> None:
        self._registry.discard(self)


class TokenizerManager(Actor):
    inbox = TokenizerInbox

    def __init__(self, tokenizer: Any, *, replicas: ReplicaPool | None = None,
                 scheduler: str | Sequence[str] | None = None, detokenizer: str | Sequence[str] | None = None,
                 worker: int = 0, watchdog_timeout: float = 300.0, limits: RequestLimits = RequestLimits(),
                 quarantine_after: int = 2, trial_timeout: float = 60.0, hold_timeout: float = 60.0,
                 request_timeout: float | None = None,
                 on_stall: Callable[[WatchdogTimeout, int], None] | None = None,
                 on_status: Callable[[RuntimeStatus], Awaitable[None]] | None = None) -> None:
        """``replicas``: where requests go; or ``scheduler`` / ``detokenizer``: the address of each
        replica's (one, or a list), a pool of them all up."""
        self.tokenizer = tokenizer
        self.replicas = replicas if replicas is not None else ReplicaPool.of(scheduler, detokenizer)  # type: ignore[arg-type]
        self.worker = worker
        # this incarnation: on start it ends, on every replica, what a previous one of ``worker`` left running
        self.boot = secrets.token_hex(6)
        self._running = False  # on_start ran: ctx is set
        self.limits = limits
        self.quarantine_after = quarantine_after
        self.request_timeout = request_timeout
        self.rid_to_state: dict[str, ReqState] = {}
        self._admissions: set[Admission] = set()
        self._by_wire_rid: dict[str, ReqState] = {}
        self.resumed = 0  # incarnations sent to continue a request (after a restart, or elsewhere)
        self.migrated = 0  # resumed on another replica than the one they ran on
        self.quarantined = 0
        self.suspected = 0  # requests put on probation
        self._failed = False  # fail_all: the runtime gave up
        self.on_stall = on_stall
        self.on_status = on_status  # a tokenizer worker: news of the runtime from the main process
        several = len(self.replicas) > 1
        self.watchdogs = [
            SoftWatchdog("tokenizer manager receive" + (f" (replica {i})" if several else ""),
                         watchdog_timeout, busy=partial(self._busy, i), on_fire=partial(self._stalled, i))
            for i in range(len(self.replicas))
        ]
        self._expander: Expander | None = None  # built once the context window is known
        self._wire = WireCheck()
        self._asking = trio.Lock()
        self._suspects: deque[list[ReqState]] = deque()  # groups waiting for their trial, one group at a time
        self._on_trial: list[ReqState] = []
        self._trial: trio.CancelScope | None = None  # the wait for the group on trial to progress
        self._trials = 0  # trials begun or ended by a crash (a trial sending its group checks it)
        self.trial_timeout = trial_timeout
        self.hold_timeout = hold_timeout
        self._no_probation = trio.Event()
        self._no_probation.set()
        # replicas that went down while none was up: the crash and the step that died, to resume after
        self._lost: dict[int, tuple[str, set[str] | None]] = {}

    async def on_start(self, ctx: Context) -> None:
        self.ctx = ctx
        self._running = True
        for watchdog in self.watchdogs:
            await ctx.nursery.start(watchdog.run)
        self.replicas.start(ctx)
        if self.request_timeout is not None:
            ctx.nursery.start_soon(self._end_unheard, self.request_timeout)
        for replica in self.replicas.serving():
            ctx.nursery.start_soon(self._end_orphans, replica)

    async def _end_orphans(self, replica: int) -> None:
        """End on ``replica`` what an earlier incarnation of this tokenizer manager left running there (it
        restarted, or the front end did): its clients are gone (issue 29 N6). Nothing waits for this: what
        this one sends carries its own ``boot`` and is spared."""
        message = "the front end that sent this request restarted"
        try:
            count = await self.replicas.call(replica, AbortWhere(worker=self.worker, message=message,
                                                                 spare_boot=self.boot),
                                             timeout=self.replicas.remote_timeout if self.replicas[replica].remote
                                             else 10.0)
        except (CallError, trio.TooSlowError) as exc:  # restarting, or not there: it holds nothing of ours
            log.info("replica %d was not asked to end an earlier front end's requests: %s", replica, exc)
            return
        if count:
            log.warning("replica %d ended %d requests an earlier front end left running", replica, count)

    def _busy(self, replica: int) -> bool:
        if len(self.replicas) == 1:  # requests on their way in count: a stall keeps them out too
            return bool(self.rid_to_state)
        return self.replicas.load(replica) > 0

    def _stalled(self, replica: int, report: WatchdogTimeout) -> None:
        log.error("no output for %g s with %d requests in flight%s", report.timeout, self.replicas.load(replica),
                  f" on replica {replica}" if len(self.replicas) > 1 else "")
        if self.on_stall is not None:
            self.on_stall(report, replica)

    def feed_watchdogs(self, replica: int | None = None) -> None:
        """A restarted child gets a full timeout (``replica``: that replica's; None: all)."""
        for i, watchdog in enumerate(self.watchdogs):
            if replica is None or i == replica:
                watchdog.feed()

    # -- outputs from the detokenizer --------------------------------------------------

    async def handle(self, msg: Any) -> None:
        if len(self.watchdogs) == 1:
            self.watchdogs[0].feed()
        match msg:
            case BatchStrOut():
                self._handle_batch_output(msg)
            case RuntimeStatus():
                if self.on_status is not None:
                    await self.on_status(msg)

    def _handle_batch_output(self, out: BatchStrOut) -> None:
        now, heard = time.monotonic(), trio.current_time()
        for i, wire_rid in enumerate(out.rids):
            state = self._by_wire_rid.get(wire_rid)
            if state is None or state.finished is not None:
                continue  # gone (its caller left), or an incarnation a resume replaced
            ids, text = out.new_token_ids[i], out.texts[i]
            replica = state.replica
            if replica is not None and len(self.watchdogs) > 1:
                self.watchdogs[replica].feed()
            state.heard_at = heard
            state.text += text
            state.output_ids.extend(ids)
            state.finished = out.finished[i]
            state.since_submit += len(ids)
            if state.since_submit >= PROGRESS_TOKENS or state.finished is not None:
                state.progressed.set()
            if ids and state.first_token_at is None:
                state.first_token_at = now
            if ids:
                state.last_token_at = now
            state.pending.append(Chunk(
                state.index, state.rid, text, ids, out.finished[i], out.prompt_tokens[i],
                out.completion_tokens[i], out.cached_tokens[i],
                out.logprobs[i] if out.logprobs else [],
                out.top_logprobs[i] if out.top_logprobs else [],
            ))
            if state.finished is not None and replica is not None:
                self.replicas.finished(replica, out.prompt_tokens[i], out.cached_tokens[i])
                self._unassign(state)
            state.notify()

    # -- the API -----------------------------------------------------------------------

    async def expander(self) -> Expander:
        """Built on first use, with the smallest context window the replicas up report (N16: a request
        may migrate to any of them; one ask, however many requests arrive at once)."""
        if self._expander is None:
            async with self._asking:
                if self._expander is None:
                    answers = await self.replicas.call_all(ServerInfoReq(), timeout=10.0)
                    windows = [a.max_context_len for a in answers.values() if isinstance(a, ServerInfo)]
                    if not windows or len(windows) < len(answers):  # one restarting: ask again next time
                        return Expander(self.tokenizer, self.limits)
                    limits = dataclasses.replace(self.limits, context_len=min(windows))
                    self._expander = Expander(self.tokenizer, limits)
        return self._expander

    async def expand(self, obj: GenerateInput) -> list[SubRequest]:
        """Tokenize and check ``obj``; a large input is tokenized in a worker thread,
        so it never stalls the other requests' streams."""
        expander = await self.expander()
        if Expander.is_large(obj):
            return await trio.to_thread.run_sync(expander.expand, obj)
        return expander.expand(obj)

    def admission(self, obj: GenerateInput) -> Admission:
        """``obj`` is on its way in: until ``generate(obj, admission=...)`` has its sub-requests, an
        abort of its rid (as the client gave it) ends it (close it on every other way out)."""
        return Admission([obj.rid] if isinstance(obj.rid, str) else list(obj.rid or []), self._admissions)

    @property
    def admitting(self) -> int:
        """Requests on their way in (waiting to be admitted, or being tokenized)."""
        return len(self._admissions)

    async def generate(self, obj: GenerateInput, *, admission: Admission | None = None) -> AsyncIterator[Chunk]:
        try:
            subs = await self.expand(obj)
        finally:
            if admission is not None:
                admission.close()
        seen: set[str] = set()
        duplicates: set[str] = set()
        for sub in subs:  # linear: a set, however many sub-requests
            if sub.rid in seen or sub.rid in self.rid_to_state:
                duplicates.add(sub.rid)
            seen.add(sub.rid)
        if duplicates:
            raise DuplicateRequestError(f"rid: duplicate request id(s) {sorted(duplicates)}")
        arrived = trio.Event()

        def notify() -> None:
            arrived.set()

        states = [
            ReqState(sub.rid, index, self.worker, sub.prompt_ids, sub.sampling, obj.stream, obj.return_logprob,
                     obj.top_logprobs_num, notify)
            for index, sub in enumerate(subs)
        ]
        for state in states:  # what the scheduler's mailbox would refuse is refused here, before anything is sent
            if (problem := self._wire.problem(self._request(state))) is not None:
                raise InvalidRequest(problem)
        for state in states:
            self.rid_to_state[state.rid] = state
            self._by_wire_rid[state.wire_rid] = state
        held_until = trio.current_time() + self.hold_timeout
        try:
            for state in states:
                if admission is not None and admission.ended is not None:
                    state.end(admission.ended)  # aborted on its way in: never sent
                    continue
                with trio.move_on_at(held_until):  # while requests are on probation, new ones wait (so long)
                    await self._no_probation.wait()
                if state.finished is None and not state.submitted:  # (a resume may have sent it)
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
            left = [state for state in states if state.finished is None]
            for state in left:  # all of them first: a resume in another task skips them from here on (L3)
                state.finished = FinishReason("abort", message="the client went away")
            with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                for state in left:
                    await self._abort_downstream(state, "the client went away")
            for state in states:
                self._unassign(state)
                del self.rid_to_state[state.rid]
                del self._by_wire_rid[state.wire_rid]

    async def _submit(self, state: ReqState, *, resume: bool = False, alone: bool = False) -> None:
        """Send ``state`` to a replica that is up (waiting for one while none is); a resume continues
        from the ids received so far, as a new incarnation (``alone``: on probation).

        Nothing awaits between choosing the incarnation and sending it; after the send, one that the
        client left meanwhile, or that another resume took over, is aborted where it went (N5)."""
        epoch = state.epoch
        await self.replicas.wait_any_up()
        if state.finished is not None or self._failed:  # ended while it waited
            return
        if state.epoch != epoch or state.replica is not None:  # another resume sent it while this one waited
            return
        tokens = state.prompt_ids + state.output_ids if resume else state.prompt_ids
        replica = self.replicas.route(tokens)
        state.replica = replica
        replaces = old = previous = None
        if resume:
            old = state.wire_rid
            del self._by_wire_rid[old]
            state.epoch += 1  # from here, the old incarnation's outputs are ignored
            self._by_wire_rid[state.wire_rid] = state
            if state.last_replica == replica:
                replaces = old  # the scheduler drops the incarnation it may still run
            elif state.last_replica is not None:
                self.migrated += 1
                previous = state.last_replica
        state.submitted = True
        state.heard_at = trio.current_time()
        state.since_submit, state.progressed = 0, trio.Event()
        request = self._request(state, resume=resume, replaces=replaces, alone=alone)
        if (problem := self._wire.problem(request)) is not None:  # (a resume's: the first was checked)
            log.error("request %s cannot be sent: %s", state.rid, problem)
            self._unassign(state)
            state.end(FinishReason("abort", status_code=400, message=f"{problem} (this request cannot be sent)"))
            if replaces is not None:  # the incarnation it was to replace may still run there
                await self.ctx.send(self.replicas[replica].scheduler, AbortReq(replaces, "its resume cannot be sent"))
            return
        await self.ctx.send(self.replicas[replica].scheduler, request)
        self.resumed += resume
        if state.finished is not None or state.epoch != epoch + resume:  # the client left, or it resumed again
            with trio.move_on_after(1.0):  # (an abort of a rid already ended is nothing to the scheduler)
                await self.ctx.send(self.replicas[replica].scheduler, AbortReq(request.rid, "ended while it was sent"))
        if old is not None and previous is not None:
            await self._end_old(old, previous, replica)

    async def _end_old(self, old: str, last_replica: int, replica: int) -> None:
        """End incarnation ``old`` on ``last_replica``, after its resume went to ``replica``: it may still
        run there (only its detokenizer crashed), or hold the abort in a socket's queue for its restart
        (a dead replica costs at most a moment)."""
        last = self.replicas[last_replica]
        with trio.move_on_after(1.0):
            await self.ctx.send(last.scheduler, AbortReq(old, f"resumed on replica {replica}"))
            if last.detokenizer is not None:  # which, if it lives on, still holds its decoding state
                await self.ctx.send(last.detokenizer, ForgetRequests([old]))

    def _request(self, state: ReqState, *, resume: bool = False, replaces: str | None = None,
                 alone: bool = False) -> GenerateReq:
        """The message that sends ``state`` (as a resume: from the ids received so far)."""
        tokens = state.prompt_ids + state.output_ids if resume else state.prompt_ids
        return GenerateReq(
            state.wire_rid, np.asarray(tokens, dtype=np.int32), state.sampling, state.stream, state.return_logprob,
            state.top_logprobs_num, self.worker, len(state.output_ids) if resume else 0, replaces, alone, resume,
            self.boot,
        )

    def _unassign(self, state: ReqState) -> None:
        """``state`` no longer runs on its replica (it ended there, or must resume elsewhere)."""
        if state.replica is not None:
            self.replicas.release(state.replica)
            state.last_replica, state.replica = state.replica, None

    async def _abort_downstream(self, state: ReqState, message: str) -> None:
        if state.replica is not None:
            await self.ctx.send(self.replicas[state.replica].scheduler, AbortReq(state.wire_rid, message))

    async def abort(self, rid: str, message: str = "aborted by request") -> bool:
        """Abort a request by id; False when no such request is in flight.

        It ends here at once, so a resume (the scheduler restarting) cannot bring
        it back; one still on its way in (waiting to be admitted) ends unrun. A
        request of another tokenizer worker is aborted by the scheduler, which
        knows every request; its owner then sees it end."""
        state = self.rid_to_state.get(rid)
        arriving = next((a for a in self._admissions if rid in a.rids), None) if state is None else None
        if arriving is not None:
            arriving.abort(message)
            return True
        if state is None:
            try:
                return bool(await self.call_scheduler(AbortWhere(rid=rid, message=message), timeout=5.0))
            except CallError:
                return False
        if state.finished is not None:
            return False
        state.end(FinishReason("abort", message=message))
        await self._abort_downstream(state, message)
        return True

    async def _end_unheard(self, timeout: float) -> None:
        """End (504) and abort downstream each request that heard nothing of its own for
        ``timeout`` s since its last output or (re)submission."""
        while True:
            await trio.sleep(min(timeout / 4, 1.0))
            now = trio.current_time()
            for state in [s for s in self.rid_to_state.values() if s.finished is None and s.submitted]:
                if now - state.heard_at > timeout:
                    message = f"no output for this request in {timeout:g} s (server.request_timeout); it was ended"
                    log.error("request %s: %s", state.rid, message)
                    state.end(FinishReason("abort", status_code=504, message=message))
                    with trio.move_on_after(5.0):
                        await self._abort_downstream(state, message)

    # -- after a restart downstream, or a replica lost -----------------------------------

    async def resubmit_in_flight(self, crash: str = "a restart downstream") -> int:
        """Continue every unfinished request from what it has (``crash``: what happened,
        for the error of a request that is not resumed again). With one replica: after
        its scheduler or detokenizer restarted."""
        return await self._resume(crash, lambda replica: True)

    async def replica_down(self, replica: int, crash: str, *, cache_lost: bool = True) -> int:
        """``replica`` lost its requests (``crash``: how): they resume at once on the replicas up;
        when none is (a server without replicas: always), once the first is back, together, as
        its first work (``replica_up``). ``cache_lost``: its scheduler restarts (forget what was
        routed there). How many resumed now."""
        self.replicas.set_down(replica, cache_lost=cache_lost)
        if not self.replicas.serving():  # (the journal is read now: it names the step that died)
            self._lost[replica] = (crash, read_step(self.replicas[replica].journal))
            return 0
        return await self._resume(crash, lambda r: r == replica)

    def replica_up(self, replica: int) -> None:
        """``replica`` takes requests again (back after a restart); what replicas lost while none was
        up resumes now."""
        self.watchdogs[replica].feed()
        self.replicas.set_up(replica)
        self._expander = None  # its context window counts too (N16)
        if not self._running:
            return
        # (a remote one may still run what an earlier front end sent it)
        self.ctx.nursery.start_soon(self._end_orphans, replica)
        if self._lost:
            lost, self._lost = self._lost, {}
            self.ctx.nursery.start_soon(self._resume_lost, lost)

    async def _resume_lost(self, lost: dict[int, tuple[str, set[str] | None]]) -> None:
        for replica, (crash, step) in lost.items():
            await self._resume(crash, lambda r, replica=replica: r == replica, steps={replica: step})

    async def _resume(self, crash: str, lost: Callable[[int], bool],
                      steps: dict[int, set[str] | None] | None = None) -> int:
        """Resume the requests running on the replicas that ``lost`` says lost them; count the
        crash against those that ran in the step that died (``_blamed``; ``steps``: a replica's,
        as its journal said at the crash)."""
        in_flight = [s for s in self.rid_to_state.values()
                     if s.finished is None and s.replica is not None and lost(s.replica)]
        blamed = self._blamed(crash, in_flight, steps)
        for state in in_flight:
            self._unassign(state)
        for state in blamed:
            state.crashes += 1
        tried = [s for s in self._on_trial if s in blamed]
        if tried:  # of the group on trial, these were in the step that died: one of them crashed it
            group = set(self._on_trial)
            in_flight = [s for s in in_flight if s not in group]  # the group's next trials send them
            rest = [s for s in self._on_trial if s not in set(tried) and s.finished is None]
            if len(tried) == 1:
                self._quarantine(tried[0], crash)
                trials = [rest]
            else:  # each half gets a trial of its own, first (without a journal: they shared the step)
                half = len(tried) // 2
                trials = [tried[:half], tried[half:], rest]
            self._suspects.extendleft(reversed([t for t in trials if t]))
            self._trials += 1  # this trial is over: the next begins
            if self._trial is not None:
                self._trial.cancel()
        resuming = set(in_flight)
        suspects = [s for s in blamed if s in resuming and s.crashes >= self.quarantine_after
                    and not s.progressed.is_set()]
        held, trial = set(suspects), set(self._on_trial)
        for state in in_flight:  # the others go on at once (those on trial still alone)
            if state not in held:
                await self._submit(state, resume=True, alone=state in trial)
        self.suspected += len(suspects)
        if suspects:
            log.warning("%d requests were in the step that died for %d crashes in a row: resuming them on "
                        "probation, %d at a time", len(suspects), self.quarantine_after, PROBATION_GROUP)
            self._suspects.extend(suspects[i:i + PROBATION_GROUP] for i in range(0, len(suspects), PROBATION_GROUP))
        if self._suspects and self._no_probation.is_set():
            self._no_probation = trio.Event()
            self.ctx.nursery.start_soon(self._run_probation)
        if in_flight or tried:
            log.warning("resumed %d requests in flight", len(in_flight) + len(tried))
        return len(in_flight) + len(tried)

    def _blamed(self, crash: str, in_flight: list[ReqState],
                steps: dict[int, set[str] | None] | None = None) -> list[ReqState]:
        """Those of ``in_flight`` (still assigned to their replica) that can have caused ``crash``: none
        unless it can be a request's fault (``blames``); else those in the step that died, as the
        replica's step journal says, or all of them where there is no journal."""
        if not blames(crash):
            return []
        steps = dict(steps or {})
        blamed = []
        for state in in_flight:
            replica = state.replica
            if replica not in steps:
                steps[replica] = read_step(self.replicas[replica].journal)
            step = steps[replica]
            if step is None or state.wire_rid in step:
                blamed.append(state)
        return blamed

    async def _run_probation(self) -> None:
        """A group of suspects at a time, each until every one made progress (or ended) or its
        ``trial_timeout`` passed; new requests wait meanwhile (at most ``hold_timeout``)."""
        while self._suspects:
            group = [s for s in self._suspects.popleft() if s.finished is None]
            if not group:
                continue
            self._on_trial = group
            self._trials += 1
            trial = self._trials
            for state in group:  # each in a model call of its own: a crash there names it
                if self._trials != trial:  # a crash ended this trial while it was sent: its next ones send them
                    break
                await self._submit(state, resume=True, alone=True)
            if self._trials == trial:
                with trio.move_on_after(self.trial_timeout) as deadline:
                    with trio.CancelScope() as self._trial:
                        for state in group:
                            await state.progressed.wait()
                if deadline.cancelled_caught:  # it crashed nothing meanwhile: it goes on as any request
                    log.warning("%d requests on probation made no progress in %g s; their trial ends",
                                len(group), self.trial_timeout)
            self._on_trial, self._trial = [], None
        self._no_probation.set()

    def suspect_crashed(self, replica: int) -> bool:
        """Whether a crash of ``replica``'s scheduler now is one more by a known suspect: its step journal
        names a request that was already in the step of an earlier crash and has made no progress since
        (one on trial, alone, among them: then it is the culprit, and is quarantined when this manager
        resumes). The runtime counts such a crash against its restart intensity once per culprit, at its
        first crash, not at each repeat: it builds the case against a request already blamed, and each
        request takes at most ``min(quarantine_after, FORGIVEN_REPEATS)`` such crashes before it is held and
        tried alone, where one more convicts it. So two poisons cost two counted crashes, like one, and the
        server stays up; a crash loop that names no suspect, or a quarantine set very high, still counts."""
        if not 0 <= replica < len(self.replicas):
            return False
        step = read_step(self.replicas[replica].journal)
        repeats = min(self.quarantine_after, FORGIVEN_REPEATS)  # (a quarantine turned off does not turn this on)
        trial = set(self._on_trial)
        return bool(step) and any(
            s.finished is None and s.replica == replica and s.wire_rid in step and not s.progressed.is_set()
            and (1 <= s.crashes < repeats or s in trial) for s in self.rid_to_state.values())

    def _quarantine(self, state: ReqState, crash: str) -> None:
        self.quarantined += 1
        log.error("request %s crashed the server on probation (%s); it is not resumed again", state.rid, crash)
        state.end(FinishReason("abort", status_code=500, message=(
            f"this request was in the step that died for {state.crashes} crashes in a row and crashed the server "
            f"when it was tried alone ({crash}); it is not resumed again")))

    def fail_all(self, message: str, status_code: int = 503) -> int:
        """End every request in flight with an error (the runtime gave up)."""
        count = 0
        for state in self.rid_to_state.values():
            if state.finished is None:
                state.end(FinishReason("abort", message=message, status_code=status_code))
                count += 1
        self._failed = True
        self._lost.clear()
        self.replicas.close()  # what waits for a replica ends
        self._suspects.clear()
        if self._trial is not None:
            self._trial.cancel()
        self._no_probation.set()
        return count

    # -- questions to the replicas ---------------------------------------------------------

    async def call_scheduler(self, msg: Any, *, timeout: float = 10.0) -> Any:
        """Ask the scheduler of the first replica up."""
        return await self.replicas.call(self.replicas.asked(), msg, timeout=timeout)

    async def call_detokenizer(self, msg: Any, *, timeout: float = 10.0) -> Any:
        return await self.replicas.call(self.replicas.asked(), msg, timeout=timeout, detokenizer=True)


def blames(crash: str) -> bool:
    """Whether ``crash``, as the runtime words it, can be a request's fault: a scheduler that crashed
    (``the scheduler crashed: ...``, ``the scheduler-1 crashed: ...``), not one killed because outputs
    stalled (an idle scheduler stalls too, when a message was lost or the detokenizer is slow), nor a
    detokenizer restart, nor a replica that left, stopped answering or restarted elsewhere."""
    stalled = "tokenizer manager receive" in crash or "OutputStalled" in crash
    return crash.startswith("the scheduler") and not stalled


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

"""The Scheduler actor: receive, schedule, run one model step, send deltas.

It owns the model runner (weights, KV pool), the prefix cache and the
waiting/running queues (``BatchState``). Messages are handled between
steps; the step itself runs in a worker thread under a step watchdog, so
the actor keeps answering (health, aborts) while the model computes, and a
step that never returns crashes the actor into a restart.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import uuid
from typing import Any

import msgspec
import trio

import torch

from actors import Actor, ActorChild, Context, StepWatchdog
from transports import Refused
from models import cpu_kernels
from models.errors import ModelLoadError, NonFiniteLogits
from models.loading import load_model, load_tokenizer, tiny_model
from models.runner import ModelRunner, StepOutput

from .batching import Batch, BatchState, Limits, Output
from .grammar import Grammars, constraint_of
from .journal import StepJournal, journal_path
from .messages import (
    AbortReq,
    AbortWhere,
    BatchTokenIDOut,
    DecodeInit,
    FinishReason,
    FlushCacheReq,
    GenerateReq,
    GenerateReqId,
    HealthProbe,
    SchedulerInbox,
    ServerInfo,
    ServerInfoReq,
    StopStringHit,
    UpdateWeightsReq,
    Weights,
    WeightsResult,
    wire_field,
)
from .radix_cache import RadixCache
from .speculative import SpeculativeConfig

__all__ = ["Scheduler", "SchedulerConfig", "scheduler_child"]

log = logging.getLogger(__name__)


class SchedulerConfig(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None  # a path; None = the embedded SmolLM2; "tiny" = a tiny random model
    dtype: str = "auto"  # auto: the fastest for the device (models.runner.default_dtype)
    device: str = "cpu"  # cpu, cuda, cuda:N, or auto (CUDA when torch sees a GPU)
    activations: str = "exact"  # "int8": the opt-in int8 mode (models.runner.ModelRunner's int8_activations)
    page_size: int = 1
    kv_budget_bytes: int = 1 << 30
    max_running_requests: int = 64
    max_queued_requests: int = 1024
    chunked_prefill_size: int = 512
    schedule_policy: str = "fcfs"
    stream_interval: int = 1
    enable_prefix_cache: bool = True
    deterministic: bool = True  # batch-invariant kernels: the same logits whatever else runs (CPU)
    speculative: str = "none"  # "ngram": speculative decoding by prompt lookup (speculative.py)
    speculative_num_draft: int = 4
    speculative_max_ngram: int = 3
    speculative_min_ngram: int = 2
    speculative_max_batch: int = 4
    speculative_max_batch_sampled: int = 0
    step_timeout: float = 120.0
    threads: int | None = None  # torch's intra-op threads in this scheduler; None: torch's default
    detokenizer: str = "inproc://detokenizer"
    tokenizer: str | None = None  # for constrained decoding; None: the embedded SmolLM2's
    # where new weights may come from (resolved paths); checked here too, not only by HTTP. None: anywhere
    weights_roots: list[str] | None = None


def build_runner(config: SchedulerConfig) -> ModelRunner:
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    loaded = tiny_model() if config.model == "tiny" else load_model(config.model)
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    device = resolve_device(config.device)
    deterministic = config.deterministic and torch.device(device).type == "cpu"
    if config.deterministic and not deterministic:
        log.warning("deterministic inference is measured on CPU only: off on %s", device)
    try:
        runner = ModelRunner(loaded, dtype=dtype, device=device,
                             page_size=config.page_size, kv_budget_bytes=config.kv_budget_bytes,
                             deterministic=deterministic, int8_activations=config.activations == "int8")
    except ValueError as exc:
        if config.activations == "int8":  # (the start fails, saying why and which setting)
            raise ValueError(f"model.activations: int8: {exc}") from None
        raise
    projections = runner.model.projections()
    coded = sum(lin.codes is not None for lin in projections)
    tiles = runner.dtype == torch.bfloat16 and runner.model.kernel and cpu_kernels.bf16_amx_serves()
    amx = "; AMX tiles for 4-bit codes at every row count, other products from 4 rows" if tiles else ""
    int8 = f", {runner.model.int8_projections} with int8 activations" if runner.int8_activations else ""
    gemm = (f", tercet's {str(runner.dtype).removeprefix('torch.')} GEMM ({coded} of {len(projections)} projections "
            f"as GGUF block codes{int8}{amx})"
            if runner.model.kernel else ", prepacked weights" if runner.model.packed else "")
    log.info("model runner: %s (dtype %s), %s, %d threads%s%s; deterministic inference %s", runner.dtype,
             config.dtype, runner.device, torch.get_num_threads(), ", CPU kernels" if runner.cpu_kernel else "", gemm,
             _described(runner.invariance()) if runner.deterministic else "off")
    return runner


def speculative_config(config: SchedulerConfig, deterministic: bool) -> SpeculativeConfig:
    """What ``config`` asks for; no drafts without deterministic inference (a draft verified where a row's
    logits depend on the rows beside it could change the text)."""
    c = config
    spec = SpeculativeConfig(c.speculative, c.speculative_num_draft, c.speculative_max_ngram, c.speculative_min_ngram,
                             c.speculative_max_batch, c.speculative_max_batch_sampled)
    if spec.enabled and not deterministic:
        log.info("speculative decoding is off: it needs deterministic inference to keep the text")
        return SpeculativeConfig()
    if spec.enabled:
        log.info("speculative decoding: %s drafts of up to %d tokens (%d..%d-grams), while at most %d requests run "
                 "(%d for a sampled one)", spec.method, spec.num_draft, spec.min_ngram, spec.max_ngram, spec.max_batch,
                 spec.max_batch_sampled)
    return spec


def _described(invariance: dict[str, Any]) -> str:
    projections = invariance["projections"]
    if isinstance(projections, dict):
        projections = ", ".join(f"{n} by {path}" for path, n in projections.items())
    return f"on (attention: {invariance['attention']}; projections: {projections})"


def resolve_device(device: str) -> str:
    """``auto``: the first CUDA device when torch sees one, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class _StepThreads:
    """Model steps running in worker threads, and waiting for them at interpreter exit:
    a step abandoned by a cancelled actor goes on in its (daemon) thread, and a thread
    still inside torch when the interpreter finalizes aborts the process. So exit waits
    for running steps, and the last step's model is kept here: the worker thread must
    never drop the last reference to its tensors (freeing them in the thread, during
    finalization, aborts too)."""

    def __init__(self) -> None:
        self._running = 0
        self._changed = threading.Condition()
        self._last: Any = None
        atexit.register(self.wait, 30.0)

    def run(self, step: Any, *args: Any) -> Any:
        with self._changed:
            self._running += 1
            self._last = step
        try:
            return step(*args)
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()

    def wait(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._running == 0, timeout)


STEP_THREADS = _StepThreads()  # one per process: it guards the process's exit


class Scheduler(Actor):
    inbox = SchedulerInbox
    salvage = GenerateReqId  # a GenerateReq the mailbox refuses ends with an error, not in silence

    def __init__(self, config: SchedulerConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.runner = runner
        self.weights = config.model  # the path of the weights serving (one an update loaded, resolved)
        self.boot = uuid.uuid4().hex  # this incarnation: a watcher elsewhere sees a restart by it
        self.state: BatchState | None = None
        self._wakeup = trio.Event()
        self._pending: list[Output] = []  # ends decided between steps, sent with the next batch
        self._stopping = False
        self._idle = trio.Event()  # no step in progress
        self._idle.set()
        self._grammars_ready = trio.Event()
        self._awaiting_grammars: list[GenerateReq] = []  # constrained requests, until the tables are built
        self._aborted_waiting: set[str] = set()
        self._compiling: dict[str, GenerateReq] = {}  # constrained requests whose grammar compiles in a thread
        self._journal: StepJournal | None = None  # which requests the step running now holds (journal.py)
        self.steps = 0
        self.started_at = time.time()
        self._loaded = trio.Event()  # the model is in (``_load``)
        self._held: list[Any] = []  # what came to be scheduled while it loaded

    async def on_start(self, ctx: Context) -> None:
        """Bound: load the model beside answering the mailbox (``until_ready``: the child is ready
        once it is in). Meanwhile the scheduler says it is loading (``ServerInfo.loading``), and
        what comes to be scheduled waits for the model, in order."""
        self.ctx = ctx
        self.watchdog = StepWatchdog("scheduler step", self.config.step_timeout)
        await ctx.nursery.start(self.watchdog.run)
        ctx.nursery.start_soon(self._load)

    async def until_ready(self) -> None:
        await self._loaded.wait()

    async def _load(self) -> None:
        """The model, then the state around it; a failure here fails the start (the child says why)."""
        if self.runner is None:
            self.runner = await trio.to_thread.run_sync(build_runner, self.config)
        runner = self.runner
        cache = RadixCache(runner.kv.free, page_size=runner.kv.page_size) if self.config.enable_prefix_cache else None
        limits = Limits(
            self.config.max_running_requests, self.config.max_queued_requests,
            self.config.chunked_prefill_size, self.config.schedule_policy, runner.context_len,
            self.config.stream_interval,
        )
        self.state = BatchState(runner.kv, cache, runner.eos_token_ids, limits,
                                vocab_size=int(runner.config.vocab_size), speculative=speculative_config(
                                    self.config, runner.deterministic))
        if (path := journal_path(self.ctx.address)) is not None:
            try:
                self._journal = StepJournal(path)
            except OSError as exc:  # then every request in flight is blamed for a crash, as without one
                log.warning("no step journal at %s: %s", path, exc)
        self.on_loaded()
        self._loaded.set()
        held, self._held = self._held, []
        for msg in held:
            await self.handle(msg)
        self.ctx.nursery.start_soon(self._loop)

    def on_loaded(self) -> None:
        """Runs once the model and the state around it are in, before the first step (a subclass
        that wraps the runner does it here: ``on_start`` returns before the model is loaded)."""

    def _while_loading(self, msg: Any) -> Any:
        """A message that came before the model was in: calls are answered (the scheduler is loading);
        what is to be scheduled waits, in order (its count is bounded upstream: the front end admits a
        bounded number of requests, and sends none to a scheduler not up)."""
        match msg:
            case ServerInfoReq():
                return self.info()
            case HealthProbe() | FlushCacheReq():
                return True  # (alive; nothing cached)
            case UpdateWeightsReq():
                return WeightsResult(False, "the scheduler is loading its model; try again once it serves",
                                     status=503)
            case AbortWhere(rid, worker, _, spare_boot):  # not queued yet: dropped before they are, uncounted
                self._held = [m for m in self._held if not (
                    isinstance(m, GenerateReq) and (rid is None or m.rid.rpartition("#")[0] == rid or m.rid == rid)
                    and (worker is None or m.worker == worker) and (spare_boot is None or m.boot != spare_boot))]
                return 0
            case StopStringHit():
                return None  # (nothing runs here yet)
        self._held.append(msg)
        return None

    def _wait_for_grammars(self, msg: GenerateReq) -> None:
        """The first constrained request of this process: build the tokenizer tables of
        constrained decoding (seconds, once) beside serving; queue it and those after it."""
        self._awaiting_grammars.append(msg)
        if len(self._awaiting_grammars) == 1:
            self.ctx.nursery.start_soon(self._load_grammars)

    async def _load_grammars(self) -> None:
        def build() -> Grammars:
            return Grammars(load_tokenizer(self.config.tokenizer), int(self.runner.config.vocab_size))

        try:
            self.state.grammars = await trio.to_thread.run_sync(build)
        except Exception:  # noqa: BLE001 - constrained requests are refused; the rest serve
            log.exception("constrained decoding is not available")
        self._grammars_ready.set()
        waiting, self._awaiting_grammars = self._awaiting_grammars, []
        for msg in waiting:
            if msg.rid not in self._aborted_waiting:
                self._end(self._add(msg))
        self._aborted_waiting.clear()
        self._wakeup.set()  # they are queued: schedule them

    # -- messages -------------------------------------------------------------------

    async def handle(self, msg: Any) -> Any:
        state = self.state
        if state is None:
            return self._while_loading(msg)
        match msg:
            case GenerateReq():
                if _constrained(msg) and not self._grammars_ready.is_set():
                    self._wait_for_grammars(msg)
                elif _constrained(msg) and (constraint := self._uncompiled(msg)) is not None:
                    self._compiling[msg.rid] = msg
                    self.ctx.nursery.start_soon(self._compile_then_add, msg, constraint)
                else:
                    self._end(self._add(msg))
            case Refused(GenerateReqId() as refused, error):
                self._refused(refused, error.detail)
            case AbortReq(rid, message):
                if any(m.rid == rid for m in self._awaiting_grammars):
                    self._aborted_waiting.add(rid)
                self._compiling.pop(rid, None)
                self._end(state.abort(rid, FinishReason("abort", message=message)))
            case AbortWhere(rid, worker, message, spare_boot):
                return self._abort_where(rid, worker, message, spare_boot)
            case StopStringHit(rid):
                if rid in state.by_rid:
                    state.drop(rid)  # the detokenizer already ended it downstream
            case FlushCacheReq():
                if not state.idle:
                    return False
                if state.cache is not None:
                    state.cache.reset()
                return True
            case HealthProbe():
                return True
            case ServerInfoReq():
                return self.info()
            case UpdateWeightsReq(path):
                return await self._update_weights(path)
        self._wakeup.set()
        return None

    def _uncompiled(self, msg: GenerateReq) -> tuple[str, str] | None:
        """The constraint of ``msg`` when its grammar is not compiled yet (else None: ``_add`` has it at once,
        or refuses it)."""
        grammars = self.state.grammars
        try:
            constraint = constraint_of(msg.sampling)
        except Exception:  # noqa: BLE001 - a malformed constraint: _add refuses it
            return None
        if grammars is None or constraint is None or grammars.compiled(*constraint):
            return None
        return constraint

    async def _compile_then_add(self, msg: GenerateReq, constraint: tuple[str, str]) -> None:
        """A grammar not seen before compiles in a worker thread (a schema of up to 1 MiB takes long enough
        to stall every request of this scheduler); then the request is queued. An abort meanwhile drops it."""
        try:
            await trio.to_thread.run_sync(self.state.grammars.compile, *constraint)
            problem = None
        except Exception as exc:  # noqa: BLE001 - the request's fault: it ends alone
            problem = exc
        if self._compiling.get(msg.rid) is not msg:  # aborted while it compiled
            return
        del self._compiling[msg.rid]
        if problem is None:
            self._end(self._add(msg))
        else:
            self._end(self.state.refuse(msg, FinishReason(
                "abort", status_code=400, message=f"the request could not be scheduled: {problem!r}")))
        self._wakeup.set()

    def _add(self, msg: GenerateReq) -> Output | None:
        """Queue a request; one that cannot be queued (whatever the reason) ends alone."""
        try:
            return self.state.add(msg)
        except Exception as exc:  # noqa: BLE001 - the request's fault, not the scheduler's
            log.exception("request %s could not be queued", msg.rid)
            return self.state.refuse(msg, FinishReason(
                "abort", status_code=400, message=f"the request could not be scheduled: {exc!r}"))

    def _refused(self, refused: GenerateReqId, detail: str) -> None:
        """A GenerateReq the mailbox could not read: it ends with an error naming the field
        (never in silence: its client would wait forever), unless its rid runs here already."""
        log.warning("request %s refused on receipt: %s", refused.rid, detail)
        if refused.rid in self.state.by_rid:  # a message that is not the one running: that one goes on
            return
        replaced = refused.replaces
        if isinstance(replaced, str) and replaced in self.state.by_rid:  # what it was to replace ends too
            self._end(self.state.abort(replaced, FinishReason("abort", message="its resume was refused")))
        self._end(self.state.refuse(refused, FinishReason(
            "abort", status_code=400, message=f"the scheduler refused this request: {wire_field(detail)}")))

    def _weights_path(self, path: str) -> str | None:
        """``path`` resolved, when it lies under one of ``config.weights_roots`` (else None): a peer on the
        wire may send any path; the resolved one is what loads, so a link changed later cannot redirect it."""
        real = os.path.realpath(path)
        roots = self.config.weights_roots
        if roots is None:
            return real
        return real if any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots) else None

    async def _update_weights(self, path: str) -> WeightsResult:
        """New weights of the same shape; only between requests (the HTTP layer drains first). They are
        committed only once a one-token step on them works (else the old ones keep serving)."""
        if not self.state.idle:
            return WeightsResult(False, "requests are in flight; drain them first")
        real = self._weights_path(path)
        if real is None:
            return WeightsResult(False, f"{path} is outside the directories weights may be loaded from (the model's "
                                 "own and server.weights_roots / --weights-root)", status=400)
        if self.state.cache is not None:
            self.state.cache.reset()  # (its pages free for the probe; their K/V would be stale after the swap)
        try:
            await trio.to_thread.run_sync(self.runner.reload_weights, real)
        except ModelLoadError as exc:
            message = str(exc)
            return WeightsResult(False, message if path in message else f"{path}: {message}")
        except Exception as exc:  # noqa: BLE001 - unreadable, malformed or unexpected: the old weights stay
            log.exception("weights from %s could not be loaded", path)
            return WeightsResult(False, f"{path}: cannot load these weights: {exc!r}")
        self.weights = real
        log.info("weights updated from %s (digest %s)", real, self.runner.weights_digest)
        return WeightsResult(True, f"weights loaded from {path}", weights=self.weights_info())

    def weights_info(self) -> Weights:
        """The weights this scheduler serves: where they were loaded from, and their digest."""
        return Weights(self.weights, self.runner.weights_digest)

    def _abort_where(self, rid: str | None, worker: int | None, message: str, spare_boot: str | None = None) -> int:
        state = self.state
        chosen = [req.rid for req in state.by_rid.values()
                  if (rid is None or req.rid.rpartition("#")[0] == rid or req.rid == rid)
                  and (worker is None or req.worker == worker) and (spare_boot is None or req.boot != spare_boot)]
        for wire_rid in chosen:
            self._end(state.abort(wire_rid, FinishReason("abort", message=message)))
        for msg in [*self._compiling.values(), *self._awaiting_grammars]:  # not queued yet: dropped before they are
            if (rid is None or msg.rid.rpartition("#")[0] == rid or msg.rid == rid) and \
                    (worker is None or msg.worker == worker) and (spare_boot is None or msg.boot != spare_boot):
                self._compiling.pop(msg.rid, None)
                if msg in self._awaiting_grammars:
                    self._aborted_waiting.add(msg.rid)
        if chosen:
            log.info("aborted %d requests (rid %s, worker %s): %s", len(chosen), rid, worker, message)
        self._wakeup.set()
        return len(chosen)

    def _end(self, output: Output | None) -> None:
        if output is not None:
            self._pending.append(output)
            self._wakeup.set()

    def info(self) -> ServerInfo:
        state = self.state
        if state is None:  # loading: what the configuration says, no figures yet
            return ServerInfo(
                boot=self.boot, scheduler=msgspec.to_builtins(self.config), device=self.config.device,
                deterministic_inference=False, invariance=None, max_context_len=0,
                weights=Weights(self.weights), waiting=sum(isinstance(m, GenerateReq) for m in self._held),
                running=0, requests_by_worker={}, kv_pages_total=0, kv_pages_free=0, kv_page_size=0,
                cached_pages=0, retracted=0, aborted=0, steps=0, loading=True)
        kv = self.runner.kv
        return ServerInfo(
            boot=self.boot, scheduler=msgspec.to_builtins(self.config), device=str(self.runner.device),
            deterministic_inference=self.runner.deterministic, invariance=self.runner.invariance(),
            max_context_len=self.runner.context_len, weights=self.weights_info(),
            waiting=len(state.waiting), running=len(state.running), requests_by_worker=_count_by_worker(state),
            kv_pages_total=kv.num_pages, kv_pages_free=kv.num_free, kv_page_size=kv.page_size,
            cached_pages=state.cache.cached_pages if state.cache is not None else 0,
            retracted=state.retracted, aborted=state.aborted, steps=self.steps,
            speculative_draft_tokens=state.draft_tokens, speculative_accepted_tokens=state.accepted_tokens,
        )

    # -- the loop -----------------------------------------------------------------------

    async def on_stop(self) -> None:
        """An orderly stop: no new step; the one in progress finishes (a thread left inside
        the model when the process exits aborts it)."""
        self._stopping = True
        self._wakeup.set()
        with trio.move_on_after(self.config.step_timeout):
            await self._idle.wait()

    async def _loop(self) -> None:
        state, runner = self.state, self.runner
        while True:
            self._wakeup = trio.Event()  # before scheduling: a message from now on wakes us
            if self._stopping:
                self._idle.set()
                await trio.sleep_forever()
            batch = state.schedule()
            for output in state.take_refused():  # requests that could not be laid out for the step
                self._end(output)
            if not batch:
                if self._journal is not None:
                    self._journal.clear()
                await self._flush([])
                await self._wakeup.wait()
                continue
            self._idle = trio.Event()
            with self.watchdog.step():
                try:
                    sampled = await self._run(batch)
                except Exception as exc:  # noqa: BLE001 - find out whose fault it is
                    sampled = await self._isolate(batch, exc)
            self._idle.set()
            self.steps += 1
            await self._flush(state.postprocess(batch, sampled))

    async def _run(self, batch: Batch) -> StepOutput:
        """One step of ``batch``: one model call, and one more for each request on probation
        (``alone``), so that a call that kills the process names it alone in the journal."""
        if not any(req.alone for req in batch.reqs):
            return await self._call(batch)
        together = [i for i, req in enumerate(batch.reqs) if not req.alone]
        parts = ([together] if together else []) + [[i] for i, req in enumerate(batch.reqs) if req.alone]
        n = len(batch.seqs)
        out = StepOutput([None] * n, [None] * n, [None] * n)
        for part in parts:
            got = await self._call(Batch([batch.reqs[i] for i in part], [batch.seqs[i] for i in part]))
            for j, i in enumerate(part):
                out.token_ids[i], out.logprobs[i], out.top_logprobs[i] = \
                    got.token_ids[j], got.logprobs[j], got.top_logprobs[j]
                if got.drafts and got.drafts[j] is not None:  # the draws after a draft (speculative.py)
                    out.drafts = out.drafts or [None] * n
                    out.drafts[i] = got.drafts[j]
        return out

    async def _call(self, batch: Batch) -> StepOutput:
        if self._journal is not None:  # before the call: if it kills the process, these were in it
            self._journal.record(req.rid for req in batch.reqs)
        return await trio.to_thread.run_sync(STEP_THREADS.run, self._step, batch, abandon_on_cancel=True)

    def _step(self, batch: Any) -> StepOutput:
        """One model step (in a worker thread), the grammars' next-token masks filled first."""
        constrained = self.state.constrained(batch)
        if constrained:
            grammars = self.state.grammars
            masks = grammars.allocate(len(constrained))
            grammars.fill([matcher for _, matcher in constrained], masks)
            for row, (i, _) in enumerate(constrained):
                batch.seqs[i].allowed = masks[row]
        return self.runner.step(batch.seqs)

    def _step_alone(self, req: Any, seq: Any) -> StepOutput:
        """``seq`` stepped alone; a constrained one with its own mask (filled here when the batch's fill
        failed): a request with a grammar is never sampled unconstrained."""
        if req.matcher is not None and seq.sample and seq.allowed is None:
            mask = self.state.grammars.allocate(1)
            self.state.grammars.fill([req.matcher], mask)
            seq.allowed = mask[0]
        return self.runner.step([seq])

    async def _isolate(self, batch: Any, error: Exception) -> StepOutput:
        """A step failed: run each request of it alone. Those that fail alone end with
        the error; the others go on. If every one fails, it is nobody's fault: re-raise
        (the scheduler restarts and the requests resume)."""
        log.error("a step of %d requests failed (%r); running each alone", len(batch.seqs), error)
        out = StepOutput([None] * len(batch.seqs), [None] * len(batch.seqs), [None] * len(batch.seqs))
        failed: list[tuple[int, Exception]] = []
        for i, seq in enumerate(batch.seqs):
            if self._journal is not None:  # alone: if it kills the process, it is the one blamed
                self._journal.record([batch.reqs[i].rid])
            try:
                one = await trio.to_thread.run_sync(STEP_THREADS.run, self._step_alone, batch.reqs[i], seq,
                                                    abandon_on_cancel=True)
            except Exception as exc:  # noqa: BLE001
                failed.append((i, exc))
                continue
            out.token_ids[i], out.logprobs[i], out.top_logprobs[i] = \
                one.token_ids[0], one.logprobs[0], one.top_logprobs[0]
        # NaN logits are the request's answer, not a crash a restart could cure: they end it even alone
        if len(failed) == len(batch.seqs) and not all(isinstance(exc, NonFiniteLogits) for _, exc in failed):
            raise error
        for i, exc in failed:
            req = batch.reqs[i]
            log.error("request %s fails on its own: %r", req.rid, exc)
            self._end(self.state.abort(req.rid, FinishReason(
                "abort", status_code=500, message=f"the model failed on this request: {exc!r}")))
        return out

    async def _flush(self, outputs: list[Output]) -> None:
        outputs, self._pending = self._pending + outputs, []
        if outputs:
            await self.ctx.send(self.config.detokenizer, _batch_out(outputs, self.boot))


def _constrained(msg: GenerateReq) -> bool:
    s = msg.sampling
    return any(x is not None for x in (s.json_schema, s.regex, s.ebnf, s.grammar))


def _count_by_worker(state: BatchState) -> dict[str, int]:
    counts: dict[str, int] = {}
    for req in state.by_rid.values():
        counts[str(req.worker)] = counts.get(str(req.worker), 0) + 1
    return counts


def _batch_out(outputs: list[Output], boot: str = "") -> BatchTokenIDOut:
    inits = []
    for o in outputs:
        req = o.req
        if not req.sent_init:
            req.sent_init = True
            s = req.sampling
            inits.append(DecodeInit(
                req.rid, req.worker, list(s.stop), s.skip_special_tokens,
                s.spaces_between_special_tokens, s.no_stop_trim,
                req.tokens[req.num_prompt : req.num_prompt + req.num_prior], req.replaces,
            ))
    with_logprobs = any(o.req.return_logprob for o in outputs)
    return BatchTokenIDOut(
        rids=[o.req.rid for o in outputs],
        new_token_ids=[o.new_ids for o in outputs],
        finished=[o.req.finished for o in outputs],
        prompt_tokens=[o.req.num_prompt for o in outputs],
        completion_tokens=[o.req.num_generated for o in outputs],
        cached_tokens=[max(o.req.cached_tokens, 0) for o in outputs],
        inits=inits,
        logprobs=[o.logprobs for o in outputs] if with_logprobs else None,
        top_logprobs=[o.top_logprobs for o in outputs] if with_logprobs else None,
        boot=boot,
    )


def scheduler_child(hub: Any, *, address: str, config: dict[str, Any]) -> ActorChild:
    """The scheduler as a supervisor child (used in a child process)."""
    parsed = msgspec.convert(config, SchedulerConfig)
    return ActorChild(lambda: Scheduler(parsed), address, hub)

"""What the HTTP routes share: the runtime, admission of new requests, metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from actors import CallError

from ..managers.messages import DetokenizerInfo, DetokenizerInfoReq, HealthProbe, ServerInfo, ServerInfoReq
from ..runtime.interface import Runtime
from .errors import BadRequest
from .metrics import Metrics
from .openai_api import TokenStrings

log = logging.getLogger(__name__)

__all__ = ["ReplicaInfo", "ServerState", "merged_detokenizers", "merged_info"]


class ServerState:
    """The routes' view of one server: ``runtime`` (a ``Runtime``) and its metrics."""

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self.runtime = runtime
        self.topology = runtime.topology
        self.metrics = metrics
        self.started_at = time.time()
        path = self.topology.model.path
        self.model_name = self.topology.model.served_model_name or (
            "SmolLM2-135M-Instruct" if path is None else Path(path).name.removesuffix(".gguf")
        )
        self._context_len: int | None = None
        scheduler = self.topology.scheduler
        self.max_in_flight = scheduler.max_running_requests + scheduler.max_queued_requests
        self.health = HealthMonitor(self)
        self._token_strings: TokenStrings | None = None

    @property
    def token_strings(self) -> TokenStrings:
        """Each token's text for logprobs, decoded once per id (one cache for every request)."""
        if self._token_strings is None:
            self._token_strings = TokenStrings(self.runtime.tokenizer)
        return self._token_strings

    @asynccontextmanager
    async def admitted(self, weight: int = 1) -> AsyncIterator[None]:
        """Wait while generation is paused or weights are replaced, and (bounded)
        while the scheduler restarts; then count as ``weight`` requests in flight
        (its sub-requests: prompts × n)."""
        gate, status = self.runtime.gate, self.runtime.status
        wait = self.topology.server.request_wait
        weight = min(max(weight, 1), self.max_in_flight)  # one larger than the server runs when it is alone
        self.refuse_if_overloaded(weight)
        deadline = trio.current_time() + wait  # the whole wait: the scheduler may go down again as it wakes us
        while True:
            with trio.move_on_at(deadline):
                await gate.wait_open()
            if not gate.is_open:
                raise BadRequest(f"generation is paused (waited {wait:g} s); try again", status=503)
            with trio.move_on_at(deadline):
                await status.scheduler_up()
            if status.failure is not None:
                raise BadRequest(f"the server failed: {status.failure}", status=503)
            if status.scheduler_running() and gate.is_open:  # still: no checkpoint from here to entering
                break
            if trio.current_time() >= deadline:
                raise BadRequest("the scheduler is restarting; try again", status=503)
        with gate.reading(weight):
            yield

    def refuse_if_overloaded(self, weight: int = 1) -> None:
        """503 at once, before any work (the body is not even read), when ``weight`` more requests
        would pass as many in flight as the scheduler runs and queues, or when the event loop
        already runs late."""
        readers = self.runtime.gate.readers
        if readers + weight > self.max_in_flight:
            more = "" if weight == 1 else f"; this one adds {weight}"
            raise BadRequest(f"server overloaded: {readers} requests in flight{more}", status=503)
        if self.health.loop_lag > self.topology.server.max_loop_lag:
            raise BadRequest(f"server overloaded: it answers {self.health.loop_lag * 1000:.0f} ms late", status=503)

    async def set_paused(self, paused: bool) -> None:
        try:
            await self.runtime.set_paused(paused)
        except CallError as exc:
            raise BadRequest(f"could not reach the other workers: {exc}", status=503) from None

    def weights_roots(self) -> list[Path]:
        """Where new weights may come from: the model's own directory and ``server.weights_roots``."""
        return [Path(root) for root in self.topology.weights_roots()]

    async def update_weights(self, path: str) -> str:
        """Load new weights (drained first); the message, or BadRequest (the old weights stay). The roots
        are checked first (outside them, whether a path exists is not told), and the resolved path is
        what loads (each scheduler checks it against the roots again)."""
        real = Path(path).resolve()
        if not any(real == root or root in real.parents for root in self.weights_roots()):
            raise BadRequest(f"model_path: {path} is outside the directories weights may be loaded from "
                             "(the model's own and server.weights_roots / --weights-root)", "model_path")
        if not real.exists():
            raise BadRequest(f"model_path: {path} does not exist", "model_path")
        try:
            result = await self.runtime.update_weights(str(real))
        except CallError as exc:
            raise BadRequest(f"the weights could not be updated: {exc}", status=503) from None
        if not result.success:
            raise BadRequest(result.message, "model_path", status=result.status or 400)
        return result.message

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r} not found; this server serves {self.model_name!r}", "model",
                             status=404)

    @property
    def replicated(self) -> bool:
        return self.topology.replicated

    async def replica_infos(self, *, timeout: float = 10.0) -> dict[int, ReplicaInfo]:
        """Each replica up whose scheduler answers: its ``ServerInfo``, and its detokenizer's
        ``DetokenizerInfo`` (or the error it gave)."""
        replicas = self.runtime.tokenizer_manager.replicas
        async with trio.open_nursery() as nursery:
            schedulers: dict[int, Any] = {}
            detokenizers: dict[int, Any] = {}

            async def ask(into: dict[int, Any], msg: Any, detokenizer: bool) -> None:
                into.update(await replicas.call_all(msg, timeout=timeout, detokenizer=detokenizer))

            nursery.start_soon(ask, schedulers, ServerInfoReq(), False)
            nursery.start_soon(ask, detokenizers, DetokenizerInfoReq(), True)
        return {i: ReplicaInfo(info, detokenizers.get(i, CallError("not asked")))
                for i, info in sorted(schedulers.items()) if isinstance(info, ServerInfo)}

    def replica_figures(self, infos: dict[int, ReplicaInfo]) -> list[dict[str, Any]]:
        """Per replica: up (taking requests), in the pool, requests in flight and routed there,
        prompt tokens finished there and the share of them served from its prefix cache,
        and its scheduler's queue and KV figures (``infos``: as ``replica_infos`` gave)."""
        status = self.runtime.status
        figures = []
        for replica in self.runtime.tokenizer_manager.replicas.figures():
            info = infos.get(replica["replica"])
            figures.append({**replica, "in_pool": replica["replica"] in status.pool, **({} if info is None else {
                "waiting": info.scheduler.waiting, "running": info.scheduler.running,
                "kv_pages_total": info.scheduler.kv_pages_total, "kv_pages_free": info.scheduler.kv_pages_free,
                "cached_pages": info.scheduler.cached_pages})})
        return figures

    async def call(self, msg: Any, *, timeout: float = 10.0) -> Any:
        """Ask the scheduler; 503 when it does not answer (restarting, or swamped)."""
        try:
            return await self.runtime.tokenizer_manager.call_scheduler(msg, timeout=timeout)
        except CallError as exc:
            raise BadRequest(f"the scheduler does not answer: {exc}", status=503) from None

    async def context_len(self) -> int:
        """The longest sequence the scheduler serves (asked once: a restart keeps the model)."""
        if self._context_len is None:
            with trio.move_on_after(self.topology.server.request_wait):  # (bounded as a request's wait is)
                await self.runtime.status.scheduler_up()
                await self.runtime.tokenizer_manager.replicas.wait_any_up()  # (a remote one: once it reloaded)
            info = await self.call(ServerInfoReq(), timeout=10.0)
            if info.loading:  # (none up: the first replica answered, bound but not loaded yet)
                raise BadRequest("the scheduler is loading its model; try again", status=503)
            self._context_len = info.max_context_len
        return self._context_len

    def quick_health(self) -> str | None:
        """None when the server is healthy as last seen (at most ``HEALTH_INTERVAL`` ago), else why
        not; answers at once, whatever the load (/health)."""
        status = self.runtime.status
        if status.failure is not None:
            return f"the server failed: {status.failure}"
        if not status.scheduler_running():
            return "no replica is serving (restarting)" if self.replicated else "scheduler restarting"
        return self.health.problem()

    async def health_problem(self) -> str | None:
        """None when the scheduler and the detokenizer answer now, else why not."""
        status = self.runtime.status
        if status.failure is not None:
            return f"the server failed: {status.failure}"
        if not status.scheduler_running():
            return "scheduler restarting"
        tm = self.runtime.tokenizer_manager
        try:
            await tm.call_scheduler(HealthProbe(), timeout=5.0)
        except CallError as exc:
            return f"scheduler does not answer: {exc}"
        try:
            await tm.call_detokenizer(DetokenizerInfoReq(), timeout=5.0)
        except CallError as exc:
            return f"detokenizer does not answer: {exc}"
        return None


HEALTH_INTERVAL = 1.0  # how often the monitor asks the scheduler and the detokenizer
HEALTH_STALE = 10.0  # no answer for this long: unhealthy, even while a probe is still waiting


class HealthMonitor:
    """Asks the scheduler and the detokenizer every ``HEALTH_INTERVAL`` s, and measures how
    late the event loop runs (``loop_lag``), so that /health answers from what it saw
    without waiting on a busy mailbox, and admission can refuse work before the loop saturates."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.last_problem: str | None = None
        self.info: ServerInfo | None = None  # the scheduler's last answer (summed over the replicas: /metrics)
        self.answered_at = trio.current_time()
        self.loop_lag = 0.0  # seconds, a moving average of how late a 50 ms sleep wakes

    def problem(self) -> str | None:
        silent = trio.current_time() - self.answered_at
        if silent > HEALTH_STALE:
            return f"the scheduler or the detokenizer has not answered for {silent:.0f} s"
        return self.last_problem

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await self._probe()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._measure_lag)
            task_status.started()
            while True:
                await trio.sleep(HEALTH_INTERVAL)
                await self._probe()

    async def _probe(self) -> None:
        """One look; whatever it raises is a problem seen, never the monitor's end (it runs in the
        lifespan's nursery: an error here would take the server down, issue 29 N6)."""
        try:
            await self._look()
        except Exception as exc:  # noqa: BLE001 (a probe of a manager between incarnations, a bad answer)
            log.warning("health probe failed: %r", exc)
            self.last_problem = f"the health probe failed: {exc!r}"

    async def _look(self) -> None:
        if self.state.replicated:
            await self._probe_replicas()
            return
        tm = self.state.runtime.tokenizer_manager
        try:
            self.info = await tm.call_scheduler(ServerInfoReq(), timeout=5.0)
            await tm.call_detokenizer(DetokenizerInfoReq(), timeout=5.0)
        except CallError as exc:
            self.last_problem = f"the scheduler or the detokenizer does not answer: {exc}"
            return
        self.last_problem = None
        self.answered_at = trio.current_time()

    async def _probe_replicas(self) -> None:
        """Healthy while any replica answers (the others' requests moved to it)."""
        infos = await self.state.replica_infos(timeout=5.0)
        answered = [info.scheduler for info in infos.values() if isinstance(info.detokenizer, DetokenizerInfo)]
        if not answered:
            self.last_problem = "no replica's scheduler and detokenizer answer"
            return
        self.info = merged_info(answered)
        self.last_problem = None
        self.answered_at = trio.current_time()

    async def _measure_lag(self) -> None:
        while True:
            start = trio.current_time()
            await trio.sleep(0.05)
            late = trio.current_time() - start - 0.05
            self.loop_lag = 0.7 * self.loop_lag + 0.3 * late


SUMMED = ("waiting", "running", "kv_pages_total", "kv_pages_free", "cached_pages", "retracted", "aborted", "steps",
          "speculative_draft_tokens", "speculative_accepted_tokens")


@dataclass
class ReplicaInfo:
    """What a replica's scheduler and detokenizer answered (``detokenizer``: or the error it gave)."""

    scheduler: ServerInfo
    detokenizer: DetokenizerInfo | BaseException


def merged_info(infos: list[ServerInfo]) -> ServerInfo:
    """One ``ServerInfo`` for several replicas: counts added up, the rest the first's."""
    by_worker: dict[str, int] = {}
    for info in infos:
        for worker, count in info.requests_by_worker.items():
            by_worker[worker] = by_worker.get(worker, 0) + count
    return msgspec.structs.replace(infos[0], requests_by_worker=by_worker,
                                   **{key: sum(getattr(info, key) for info in infos) for key in SUMMED})


def merged_detokenizers(answers: list[DetokenizerInfo | BaseException]) -> dict[str, Any]:
    """The replicas' detokenizers as /server_info shows them: counts added up (the boot the first's),
    or the errors some gave."""
    errors = [str(a) for a in answers if isinstance(a, BaseException)]
    if errors:
        return {"error": "; ".join(errors)}
    merged = msgspec.to_builtins(answers[0])
    for key in ("requests", "unknown_rids", "swept"):
        merged[key] = sum(getattr(a, key) for a in answers)
    return merged

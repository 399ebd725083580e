"""What the HTTP routes share: the engine, pause and weight-update gates, metrics."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from starlette.requests import Request

from actors import CallError

from .messages import HealthProbe, ServerInfoReq, UpdateWeightsReq
from .tokenizer_manager import Chunk
from .topology import Topology

__all__ = ["BadRequest", "Metrics", "ServerState", "decode_body"]


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


async def decode_body(request: Request, type_: Any) -> Any:
    body = await request.body()
    try:
        return msgspec.json.decode(body or b"{}", type=type_)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.split("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise BadRequest(f"invalid request: {text}", param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None


class Metrics:
    """Prometheus metrics of one server (its own registry: no global state).

    In a tokenizer worker (``PROMETHEUS_MULTIPROC_DIR`` set by the main process
    before the worker started), every worker writes its values to that
    directory and ``render`` adds up all of them, dead workers' included: any
    worker answers /metrics for the whole server. Gauges say how: the
    scheduler's figures and the restart counts are the same everywhere
    (latest, max), resumed requests add up.
    """

    def __init__(self) -> None:
        self.multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tercet_requests", "Generation requests finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("tercet_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("tercet_generation_tokens", "Tokens generated", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("tercet_time_to_first_token_seconds", "Time to first token", buckets=buckets,
                              registry=r)
        self.itl = Histogram("tercet_inter_token_latency_seconds", "Time between tokens", buckets=buckets,
                             registry=r)
        self.e2e = Histogram("tercet_e2e_request_latency_seconds", "Request latency", buckets=buckets, registry=r)
        self.waiting = Gauge("tercet_num_queue_reqs", "Requests waiting in the scheduler", registry=r,
                             multiprocess_mode="mostrecent")
        self.running = Gauge("tercet_num_running_reqs", "Requests running in the scheduler", registry=r,
                             multiprocess_mode="mostrecent")
        self.kv_usage = Gauge("tercet_kv_cache_usage", "Fraction of KV pages in use or cached", registry=r,
                              multiprocess_mode="mostrecent")
        self.restarts = Gauge("tercet_restarts", "Restarts of an actor by its supervisor", ["actor"], registry=r,
                              multiprocess_mode="max")
        self.crashes = Gauge("tercet_crashes", "Crashes of an actor, by cause", ["actor", "cause"], registry=r,
                             multiprocess_mode="max")
        self.resumed = Gauge("tercet_resumed_requests", "Requests resumed after a restart", registry=r,
                             multiprocess_mode="sum")
        self.recovery = Histogram("tercet_recovery_seconds", "From a crash to the restarted actor's readiness",
                                  buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=r)
        self._recoveries_seen = 0

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    async def render(self, state: ServerState) -> bytes:
        try:
            info = await state.call(ServerInfoReq(), timeout=2.0)
        except CallError:
            info = None
        if info is not None:
            self.waiting.set(info["waiting"])
            self.running.set(info["running"])
            total = info["kv_pages_total"] or 1
            self.kv_usage.set(1 - info["kv_pages_free"] / total)
        engine = state.engine
        for actor, count in engine.restarts.items():
            self.restarts.labels(actor).set(count)
        for (actor, cause), count in engine.crashes.items():
            self.crashes.labels(actor, cause).set(count)
        self.resumed.set(engine.tokenizer_manager.resumed)
        if self.multiprocess:  # recoveries: observed by worker 0 as they happen (see ServerState)
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        for seconds in engine.recoveries[self._recoveries_seen :]:
            self.recovery.observe(seconds)
        self._recoveries_seen = len(engine.recoveries)
        return generate_latest(self.registry)


class RequestTimer:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self.last: dict[int, float] = {}

    def chunk(self, chunk: Chunk) -> None:
        now = time.monotonic()
        if chunk.token_ids:
            previous = self.last.get(chunk.index)
            if previous is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe((now - previous) / len(chunk.token_ids))
            self.last[chunk.index] = now
            self.metrics.generation_tokens.inc(len(chunk.token_ids))
        if chunk.finished is not None:
            self.metrics.requests.labels(chunk.finished.type).inc()
            self.metrics.prompt_tokens.inc(chunk.prompt_tokens)
            self.metrics.e2e.observe(now - self.start)


class ServerState:
    """``engine``: the AsyncEngine (tokenizer manager in this process), or a tokenizer
    worker's WorkerRuntime; both offer the same face (see serving.workers)."""

    def __init__(self, engine: Any, topology: Topology) -> None:
        self.engine = engine
        self.topology = topology
        self.metrics = Metrics()
        self.started_at = time.time()
        path = topology.model.path
        self.model_name = topology.model.served_model_name or (
            "SmolLM2-135M-Instruct" if path is None else Path(path).name.removesuffix(".gguf")
        )
        self.max_model_len = 8192
        self._unpaused = trio.Event()
        self._unpaused.set()
        self._readers = 0
        self._no_readers = trio.Event()
        self._no_readers.set()
        self._writer = trio.Lock()
        self._writing = False
        self._writer_done = trio.Event()
        self._writer_done.set()
        # a tokenizer worker: pause and weight updates are server-wide, through the main process
        self.shared = hasattr(engine, "on_gate")
        if self.shared:
            engine.on_gate = self._set_gate
            engine.on_resumed = self.metrics.resumed.set
            if engine.worker == 0:  # one worker counts the server's recoveries
                engine.on_recovery = self.metrics.recovery.observe

    def _set_gate(self, closed: bool) -> None:
        if closed:
            self.pause()
        else:
            self.resume()

    async def set_paused(self, paused: bool) -> None:
        if not self.shared:
            self._set_gate(paused)
            return
        try:
            await self.engine.set_paused(paused)
        except CallError as exc:
            raise BadRequest(f"could not reach the other workers: {exc}", status=503) from None

    # -- gates: pause, and the reader/writer lock around weight updates ----------

    async def admit(self) -> None:
        """Wait while paused, while weights are replaced, or (bounded) while the
        scheduler restarts; then count as a reader."""
        while not self._unpaused.is_set() or self._writing:
            await self._unpaused.wait()
            await self._writer_done.wait()
        with trio.move_on_after(self.topology.server.request_wait):
            await self.engine.scheduler_up()
        if self.engine.failure is not None:
            raise BadRequest(f"the server failed: {self.engine.failure}", status=503)
        if not self.engine.scheduler_running():
            raise BadRequest("the scheduler is restarting; try again", status=503)
        self._readers += 1
        self._no_readers = trio.Event()

    def read_unlock(self) -> None:
        self._readers -= 1
        if self._readers == 0:
            self._no_readers.set()

    def pause(self) -> None:
        if self._unpaused.is_set():
            self._unpaused = trio.Event()

    def resume(self) -> None:
        self._unpaused.set()

    async def update_weights(self, path: str) -> tuple[bool, str]:
        if not os.path.exists(path):
            return False, f"model_path: {path} does not exist"
        if self.shared:
            try:
                result = await self.engine.update_weights(path)
            except CallError as exc:
                raise BadRequest(f"could not reach the main process: {exc}", status=503) from None
            return result["success"], result["message"]
        async with self._writer:
            self._writing = True
            self._writer_done = trio.Event()
            try:
                await self._no_readers.wait()  # requests in flight finish on the old weights
                result = await self.call(UpdateWeightsReq(path), timeout=600.0)
            finally:
                self._writing = False
                self._writer_done.set()
        return result["success"], result["message"]

    # -- helpers --------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r} not found; this server serves {self.model_name!r}", "model",
                             status=404)

    async def call(self, msg: Any, *, timeout: float = 10.0) -> Any:
        return await self.engine.tokenizer_manager.call_scheduler(msg, timeout=timeout)

    async def health_problem(self) -> str | None:
        """None when the scheduler really answers, else why not."""
        if self.engine.failure is not None:
            return f"the server failed: {self.engine.failure}"
        if not self.engine.scheduler_running():
            return "scheduler restarting"
        try:
            await self.call(HealthProbe(), timeout=5.0)
        except CallError as exc:
            return f"scheduler does not answer: {exc}"
        return None

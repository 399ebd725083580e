"""Prometheus metrics of one server: request figures observed here, runtime
figures read from the runtime's status at scrape time.

The scheduler's queue, running and KV-usage gauges are also exposed under
SGLang's and vLLM's names (``ALIASES``), with the same values: the Kubernetes
Gateway API Inference Extension's endpoint picker and llm-d route on those
(docs/gateway.md)."""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from ..managers.messages import ServerInfo
from ..managers.tokenizer_manager import Chunk
from ..runtime.interface import Runtime

__all__ = ["ALIASES", "Metrics", "RequestTimer"]

# tercet's gauge → the same figure under SGLang's and vLLM's names (vLLM's KV gauge by its old name and its new)
ALIASES = {
    "tercet_num_queue_reqs": ("sglang:num_queue_reqs", "vllm:num_requests_waiting"),
    "tercet_num_running_reqs": ("sglang:num_running_reqs", "vllm:num_requests_running"),
    "tercet_kv_cache_usage": ("sglang:token_usage", "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc"),
}


class Metrics:
    """Prometheus metrics of one server (its own registry: no global state).

    In a tokenizer worker (``PROMETHEUS_MULTIPROC_DIR`` set by the main process
    before the worker started), every worker writes its values to that
    directory and ``render`` adds up all of them, dead workers' included: any
    worker answers /metrics for the whole server. Gauges say how: the
    scheduler's figures and the restart counts are the same everywhere
    (latest, max), resumed requests add up; recoveries are observed by
    worker 0 alone, as the main process reports them.
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
        self.replica_up = Gauge("tercet_replica_up", "1 while a replica takes requests", ["replica"], registry=r,
                                multiprocess_mode="mostrecent")
        self.replica_in_flight = Gauge("tercet_replica_requests_in_flight", "Requests running on a replica",
                                       ["replica"], registry=r, multiprocess_mode="mostrecent")
        self.replica_routed = Gauge("tercet_replica_routed_requests", "Requests routed to a replica (resumes too)",
                                    ["replica"], registry=r, multiprocess_mode="mostrecent")
        self.replica_hit_rate = Gauge("tercet_replica_cache_hit_rate",
                                      "Share of the prompt tokens finished on a replica that its prefix cache held",
                                      ["replica"], registry=r, multiprocess_mode="mostrecent")
        self.migrated = Gauge("tercet_migrated_requests", "Requests resumed on another replica", registry=r,
                              multiprocess_mode="sum")
        self.aliases = {own: [Gauge(name, f"{own}, by the name gateways read", registry=r,
                                    multiprocess_mode="mostrecent") for name in names]
                        for own, names in ALIASES.items()}

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self, runtime: Runtime, info: ServerInfo | None) -> bytes:
        """The metrics page; ``info``: the scheduler's latest figures, if any."""
        tm = runtime.tokenizer_manager
        if info is not None:
            total = info.kv_pages_total or 1
            for own, gauge, value in (("tercet_num_queue_reqs", self.waiting, info.waiting),
                                      ("tercet_num_running_reqs", self.running, info.running),
                                      ("tercet_kv_cache_usage", self.kv_usage, 1 - info.kv_pages_free / total)):
                gauge.set(value)
                for alias in self.aliases[own]:
                    alias.set(value)
        status = runtime.status
        for actor, count in status.restarts.items():
            self.restarts.labels(actor).set(count)
        for (actor, cause), count in status.crashes.items():
            self.crashes.labels(actor, cause).set(count)
        self.resumed.set(tm.resumed)
        self.migrated.set(tm.migrated)
        for replica in tm.replicas.figures():
            label = str(replica["replica"])
            self.replica_up.labels(label).set(replica["up"])
            self.replica_in_flight.labels(label).set(replica["in_flight"])
            self.replica_routed.labels(label).set(replica["routed"])
            self.replica_hit_rate.labels(label).set(replica["cache_hit_rate"])
        if self.multiprocess:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        for seconds in status.take_recoveries():
            self.recovery.observe(seconds)
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

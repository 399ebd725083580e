"""The child specs of a replica (its scheduler and its detokenizer) and the supervisors
that run them: shared by the server (``launch``), a replica started on its own
(``tercet replica``, ``replicas.run_replica``) and the Ray launcher."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import torch

from actors import ActorChild, Backoff, ChildSpec, Supervisor, SupervisorEvent
from actors.process import ProcessChild, Standby

from ..managers.detokenizer import DetokenizerManager
from ..managers.scheduler import Scheduler, SchedulerConfig
from .topology import ReplicaPlacement, Topology, parse_size, tokenizer_source

__all__ = ["core_specs", "make_supervisor", "scheduler_config", "scheduler_threads"]


def scheduler_threads(topology: Topology) -> int | None:
    """``scheduler.threads``, or the cores shared among the replicas started on this host."""
    local = topology.local_replicas()
    if topology.scheduler.threads is not None or local <= 1:
        return topology.scheduler.threads
    return max(1, torch.get_num_threads() // local)


def scheduler_config(topology: Topology, detokenizer: str) -> SchedulerConfig:
    """What a scheduler of ``topology`` is started with (sending its outputs to ``detokenizer``)."""
    s, model = topology.scheduler, topology.model
    return SchedulerConfig(
        model=model.path, dtype=model.dtype, device=model.device, activations=model.activations,
        page_size=s.page_size,
        kv_budget_bytes=parse_size(s.kv_budget, "scheduler.kv_budget"),
        max_running_requests=s.max_running_requests, max_queued_requests=s.max_queued_requests,
        chunked_prefill_size=s.chunked_prefill_size, schedule_policy=s.schedule_policy,
        stream_interval=s.stream_interval, enable_prefix_cache=s.enable_prefix_cache,
        deterministic=s.enable_deterministic_inference, speculative=s.speculative,
        speculative_num_draft=s.speculative_num_draft, speculative_max_ngram=s.speculative_max_ngram,
        speculative_min_ngram=s.speculative_min_ngram, speculative_max_batch=s.speculative_max_batch,
        speculative_max_batch_sampled=s.speculative_max_batch_sampled,
        step_timeout=topology.watchdogs.step_timeout, threads=scheduler_threads(topology),
        detokenizer=detokenizer, tokenizer=tokenizer_source(model), weights_roots=topology.weights_roots(),
    )


def core_specs(topology: Topology, addresses: dict[str, str], workers: list[str], hub: Any, tokenizer: Any,
               weights: Callable[[], str | None], placement: ReplicaPlacement | None = None,
               binds: dict[str, str] | None = None) -> list[ChildSpec]:
    """The scheduler and the detokenizer, in start order; ``workers``: the mailboxes
    of the tokenizer managers the detokenizer sends to; ``weights()``: what each
    start of the scheduler loads (the weights an update made current); ``placement``,
    ``addresses`` (where they are reached) and ``binds`` (where they listen, default
    the same): of one replica (default: the topology's only one). A remote placement
    runs here as a child process (``tercet replica`` starts it so)."""
    grace = topology.supervision.shutdown_grace
    base = scheduler_config(topology, addresses["detokenizer"])
    placement = placement or topology.replica_placements()[0]
    sched, detok = placement.scheduler, placement.detokenizer
    binds = binds or addresses

    def config() -> SchedulerConfig:
        return msgspec.structs.replace(base, model=weights())

    def standby(target: str, preload: str) -> Standby | None:
        """A spare process for the restarts of ``target``'s process (``supervision.standby``): its
        module and ``models.loading``'s ``preload`` imported, seconds of a restart done ahead."""
        if not topology.supervision.standby:
            return None
        return Standby([target.partition(":")[0], f"models.loading:{preload}"])

    scheduler_spare = detokenizer_spare = None
    if sched.process in ("child", "remote"):
        target = sched.target or "serving.managers.scheduler:scheduler_child"
        scheduler_spare = standby(target, "preload")
        scheduler = lambda: ProcessChild(  # noqa: E731
            target, {"address": binds["scheduler"], "config": msgspec.to_builtins(config()), **sched.args},
            name="scheduler", kill_after=grace, hub=hub.options, ready_timeout=topology.watchdogs.start_timeout,
            load_timeout=topology.watchdogs.load_timeout, standby=scheduler_spare)
    else:
        scheduler = lambda: ActorChild(lambda: Scheduler(config()), addresses["scheduler"], hub)  # noqa: E731
    if detok.process in ("child", "remote"):
        args = {"address": binds["detokenizer"], "tokenizer": tokenizer_source(topology.model),
                "workers": workers, "scheduler": addresses["scheduler"], **detok.args}
        detok_target = detok.target or "serving.managers.detokenizer:detokenizer_child"
        detokenizer_spare = standby(detok_target, "preload_tokenizer")
        detokenizer = lambda: ProcessChild(  # noqa: E731
            detok_target, args, name="detokenizer", kill_after=grace, hub=hub.options,
            ready_timeout=topology.watchdogs.start_timeout, load_timeout=topology.watchdogs.load_timeout,
            standby=detokenizer_spare)
    else:
        detokenizer = lambda: ActorChild(  # noqa: E731
            lambda: DetokenizerManager(tokenizer, workers, addresses["scheduler"]), addresses["detokenizer"], hub)
    together = topology.supervision.start == "together"  # they need nothing of each other to start
    return [ChildSpec("scheduler", scheduler, shutdown=grace, close=_closer(scheduler_spare)),
            ChildSpec("detokenizer", detokenizer, shutdown=grace, with_previous=together,
                      close=_closer(detokenizer_spare))]


def _closer(spare: Standby | None) -> Callable[[], Awaitable[None]] | None:
    return None if spare is None else spare.aclose


def make_supervisor(topology: Topology, specs: list[ChildSpec],
                    observer: Callable[[SupervisorEvent], None], name: str = "server",
                    forgive: Callable[[str, BaseException | None], bool] | None = None) -> Supervisor:
    s = topology.supervision
    return Supervisor(name, specs, strategy=s.strategy, max_restarts=s.max_restarts, within=s.within,
                      backoff=Backoff(s.backoff_initial, 2.0, s.backoff_max), observer=observer, forgive=forgive)

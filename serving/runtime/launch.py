"""Starting a topology under supervision.

``open_runtime(topology)`` starts the three managers — each replica's scheduler
and detokenizer where the topology places them (this process over ``inproc://``,
or child processes over ``ipc://`` / ``tcp://``), the tokenizer manager here
— under one supervisor, and yields a ``LocalRuntime``. Step by step:

1. check the topology and load the tokenizer (in a thread);
2. make a private runtime directory (``{runtime_dir}`` in addresses) and a hub;
3. the replicas (``replicas.ReplicaSet``; one without ``scheduler.replicas``),
   their status (``ReplicaStatus``) and the front end's child specs;
4. the server's supervisor, built by the replica set: the replicas, then the
   front end (the Ray replicas' supervisor, the tokenizer manager);
5. run it until the caller is done, then stop the children in reverse order.

A replica that goes down (a crash or hang of its scheduler or detokenizer)
has its requests resumed on the replicas up, or on itself once it is back;
past the restart intensity the server ends them all with an error (with
several replicas: once the last replica left the pool).
``serving.runtime.workers`` does the same with tokenizer worker processes
as the front end.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import trio

from actors import ActorChild, CallError, ChildSpec, RestartIntensityExceeded, Supervisor, SupervisorEvent
from actors.process import ProcessExited
from models.loading import load_tokenizer
from transports import open_hub

from ..managers.messages import ServerInfoReq, UpdateWeightsReq, WeightsResult
from ..managers.tokenizer_manager import TokenizerManager, blames
from .interface import Gate, StatusTracker, TokenizerManagerSlot
from .replicas import NoReplicaLeft, ReplicaSet, ReplicaStatus
from .specs import core_specs
from .frontend import make_tokenizer_manager
from .topology import Topology, tokenizer_source

__all__ = ["LocalRuntime", "Supervised", "core_specs", "open_runtime", "open_supervised"]

log = logging.getLogger(__name__)

S = TypeVar("S", bound="Supervised")


class Supervised:
    """A topology under its supervisor, and the status that its events make.

    Subclasses build ``self.supervisor`` (and ``self.status`` from it) in their
    constructor, and say what a change means to their front end (``_changed``)
    and what a failure does (``_failed``)."""

    supervisor: Supervisor
    status: StatusTracker

    def __init__(self, topology: Topology, tokenizer: Any, runtime_dir: Path) -> None:
        self.topology = topology
        self.tokenizer = tokenizer
        self.addresses = topology.addresses(runtime_dir)
        self.weights = topology.model.path  # the weights serving now: a restarted scheduler loads them
        self.weights_digest: str | None = None  # theirs, once an update reported it (None: not compared)

    async def supervise(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the supervisor; ready once every child started. A start that fails raises;
        a failure after that (restart intensity exceeded) ends the runtime."""
        ready = _Ready(task_status)
        try:
            await self.supervisor.run(task_status=ready)
        except Exception as exc:
            if not ready.done:
                raise
            self.fail(exc)

    def fail(self, failure: BaseException) -> None:
        """The runtime is beyond repair: end every request with an error, now."""
        if self.status.fail(failure):
            self._failed(failure)

    def kill_scheduler(self, reason: BaseException) -> None:
        """The scheduler hangs where no watchdog of its own sees it: restart it. Not while the
        detokenizer restarts: no output can come until it is back, and the scheduler is not to blame."""
        if "detokenizer" not in self.supervisor.running():
            log.warning("outputs stalled while the detokenizer restarts; the scheduler is left alone (%s)", reason)
            return
        self.supervisor.kill("scheduler", reason)

    def _on_event(self, event: SupervisorEvent) -> None:
        if event.kind == "escalated" and event.supervisor == self.supervisor.name:
            s = self.topology.supervision
            self.fail(RestartIntensityExceeded(event.supervisor, s.max_restarts, s.within, event.reason))
            return
        self._changed(event, crash=self.status.observe(event))

    def _changed(self, event: SupervisorEvent, *, crash: str | None) -> None:
        """After an event; ``crash``: a scheduler or detokenizer is back after it (resume)."""
        raise NotImplementedError

    def _failed(self, failure: BaseException) -> None:
        raise NotImplementedError


class _Ready:
    """A task status that remembers whether ``started`` was called."""

    def __init__(self, task_status: Any) -> None:
        self.task_status = task_status
        self.done = False

    def started(self, value: Any = None) -> None:
        self.done = True
        self.task_status.started(value)


def killed_from_outside(reason: BaseException | None) -> bool:
    """Whether ``reason`` (a child's crash) is a process that was killed or stopped, not one that faulted."""
    while reason is not None:
        if isinstance(reason, ProcessExited):
            return not reason.faulted
        if isinstance(reason, BaseExceptionGroup) and len(reason.exceptions) == 1:
            reason = reason.exceptions[0]
        else:
            reason = reason.__cause__
    return False


class LocalRuntime(Supervised):
    """A topology whose tokenizer manager runs in this process: the ``Runtime``
    of a single-process server and of the offline Engine. Its replicas (one,
    without ``scheduler.replicas``) are a ``ReplicaSet`` in its supervisor, and
    a replica going down moves its requests to the others, or has them wait
    until it is back (``serving.runtime.replicas``)."""

    worker = None

    def __init__(self, topology: Topology, tokenizer: Any, runtime_dir: Path, hub: Any,
                 nursery: trio.Nursery) -> None:
        super().__init__(topology, tokenizer, runtime_dir)
        self.gate = Gate()
        self._nursery = nursery
        self._tm = TokenizerManagerSlot(self._new_tokenizer_manager)
        workers = [self.addresses["tokenizer"]]
        placements = topology.replica_placements()
        self.replicas = ReplicaSet(
            topology, runtime_dir, hub,
            lambda i, addresses: core_specs(topology, addresses, workers, hub, tokenizer, lambda: self.weights,
                                            placements[i]),
            lambda i: partial(self._convicts, i), self._remote_loading)
        self.status = ReplicaStatus(self.replicas, self._replica_changed)
        bind = topology.actors.tokenizer.bind
        front = [ChildSpec("tokenizer", lambda: ActorChild(
            self._tm.build, self.addresses["tokenizer"], hub,
            bind=bind and bind.replace("{runtime_dir}", str(runtime_dir))), shutdown=topology.supervision.shutdown_grace)]
        if topology.server.launcher == "ray":
            from .ray_launcher import ray_specs  # (Ray is imported only when it launches)

            front = [*ray_specs(topology, self._ray_started, self._ray_lost), *front]
        self.supervisor = self.replicas.server(front, self._on_event)  # (its events need self.status: made above)

    def _convicts(self, replica: int, child: str, reason: BaseException | None) -> bool:
        """Whether a crash of ``child`` (of ``replica``) is one more by a request already blamed for an
        earlier one (``TokenizerManager.suspect_crashed``): such crashes do not count against the restart
        intensity, so each culprit costs one counted crash however many it takes to convict it, and two
        poisons do not bring the server down (issue 29). Only a crash the scheduler made itself can be
        forgiven: a process killed from outside (SIGKILL, SIGTERM: an operator, the OOM killer, a
        watchdog) always counts, whatever was in its step, so repeated kills still exhaust the intensity."""
        if child != "scheduler" or not self._tm.started or not blames(f"the scheduler crashed: {reason!r}"):
            return False  # (a scheduler killed because its outputs stalled convicts nobody)
        if killed_from_outside(reason):
            return False
        return self._tm.current.suspect_crashed(replica)

    def _new_tokenizer_manager(self) -> TokenizerManager:
        # (a restarted tokenizer manager starts from things as they stand)
        return make_tokenizer_manager(self.topology, self.tokenizer, self.addresses, replicas=self.replicas.addresses,
                                      serving=self.status.serving, on_stall=self.kill_scheduler)

    @property
    def tokenizer_manager(self) -> TokenizerManager:
        return self._tm.current

    def _remote_loading(self, replica: int, loading: bool) -> None:
        if self._tm.started:
            self._tm.current.replicas.set_loading(replica, loading)

    def kill_scheduler(self, reason: BaseException, replica: int = 0) -> None:
        """Replica ``replica``'s outputs stalled: restart its scheduler, and move its requests now, not once
        the hung process is dead (that can take the kill's grace). Not while its detokenizer restarts: no
        output can come until it is back, and the scheduler is not to blame."""
        if replica in self.status.remote:  # not ours to kill: its own watchdogs restart it; its requests move
            self.status.mark_down(replica, f"replica {replica} stalled: {reason!r}", cache_lost=True)
            self.replicas.give_up(replica, reason)  # (it takes requests again once it restarted)
            return
        supervisor = self.replicas.supervisors[replica]
        if supervisor is None or "detokenizer" not in supervisor.running():
            log.warning("outputs stalled while the %s restarts; the scheduler is left alone (%s)",
                        self.replicas.name("detokenizer", replica), reason)
            return
        if supervisor.kill("scheduler", reason):
            name = self.replicas.name("scheduler", replica)
            self.status.mark_down(replica, f"the {name} hung: {reason!r}", cache_lost=True)

    async def set_paused(self, paused: bool) -> None:
        self.gate.set_closed(paused)

    async def update_weights(self, path: str) -> WeightsResult:
        timeout = self.topology.server.weights_drain_timeout
        try:
            async with self.gate.writing(timeout):  # requests in flight finish on the old weights
                result = await self._load_weights(path)
        except trio.TooSlowError:
            return WeightsResult(False, f"requests still in flight after {timeout:g} s; the old weights keep serving",
                                 status=409)
        if result.success:
            self.weights = path  # a restarted scheduler loads these
            self.weights_digest = result.weights.digest if result.weights is not None else None
        return result

    async def _load_weights(self, path: str) -> WeightsResult:
        replicas = self.tokenizer_manager.replicas
        answers = await replicas.call_all(UpdateWeightsReq(path), timeout=600.0)
        for i, answer in answers.items():
            if isinstance(answer, CallError):  # no answer in time: unknown, not failed; ask again
                try:
                    answers[i] = await self._weights_after(i, path, answer)
                except CallError as exc:
                    answers[i] = exc
        loaded = [i for i, a in answers.items() if isinstance(a, WeightsResult) and a.success]
        if not loaded:  # the same load error everywhere (a bad path), or no replica answered
            answer = next(iter(answers.values()), CallError("no replica is up"))
            if isinstance(answer, BaseException):
                raise answer
            return answer
        self.weights = path
        for i in answers.keys() - set(loaded):  # every replica serves the same weights: restart on them
            self.kill_scheduler(RuntimeError(f"replica {i} did not load {path}: {answers[i]}"), i)
        return answers[loaded[0]]

    def _changed(self, event: SupervisorEvent, *, crash: str | None) -> None:
        """(Nothing: what an event changes reaches the tokenizer manager as a replica's change.)"""

    def _replica_changed(self, change: str, replica: int, cause: str, cache_lost: bool) -> None:
        if change == "gone" and not self.status.pool:
            self.fail(NoReplicaLeft(f"every replica left the pool (the last: {cause})"))
            return
        if not self._tm.started:
            return
        tm = self._tm.current
        if change == "up":
            if replica in self.status.remote:  # whatever it loaded (a restart, another front end's update)
                self._nursery.start_soon(self._reload_then_up, replica)
            else:
                tm.replica_up(replica)
        elif change == "down":
            self._nursery.start_soon(partial(tm.replica_down, replica, cause, cache_lost=cache_lost))
        else:
            log.error("%s; %d replicas serve on", cause, len(self.status.pool))

    async def _weights_after(self, replica: int, path: str, error: CallError, tries: int = 3) -> WeightsResult:
        """The outcome of a load of ``path`` whose answer did not come (``error``): ``replica``'s scheduler is
        asked which weights it serves (it answers once the load is over), up to ``tries`` times."""
        replicas = self._tm.current.replicas
        for _ in range(tries):
            try:
                info = await replicas.call(replica, ServerInfoReq(), timeout=600.0)
            except CallError as exc:
                error = exc
                continue
            if info.weights.path == path:
                return WeightsResult(True, f"weights loaded from {path} (confirmed after: {error})",
                                     weights=info.weights)
            return WeightsResult(False, f"{path}: no answer to the load ({error}); the scheduler serves "
                                 f"{info.weights.path}", status=503)
        raise error

    async def _reload_then_up(self, replica: int) -> None:
        """A remote replica (re)started: it takes requests once it serves the weights serving now (as it
        reports them: path and digest; an update made them current), so every replica answers alike."""
        tm = self._tm.current
        try:
            weights = (await tm.replicas.call(replica, ServerInfoReq(), timeout=600.0)).weights
            if weights.path == self.weights and self.weights_digest in (None, weights.digest):
                tm.replica_up(replica)
                return
            result = await tm.replicas.call(replica, UpdateWeightsReq(self.weights), timeout=600.0)
        except CallError as exc:
            result = WeightsResult(False, str(exc))
        if result.success:
            tm.replica_up(replica)
        else:  # left out of the routing until it restarts again (and is given them again)
            log.error("replica %d could not load the weights serving now (%s): it takes no requests",
                      replica, result.message)

    def _ray_started(self, replica: int, addresses: dict[str, str]) -> None:
        """A replica's Ray actor runs (again), there: it is watched at these addresses."""
        current = self.replicas.addresses[replica]
        moved = {part: addresses[part] for part in current if addresses[part] != current[part]}
        current.update(moved)
        if moved and self._tm.started:
            self._tm.current.replicas.set_addresses(replica, current["scheduler"], current["detokenizer"])

    def _ray_lost(self, replica: int, cause: str) -> None:
        self.status.mark_down(replica, cause, cache_lost=True)

    def _failed(self, failure: BaseException) -> None:
        if self._tm.started:
            count = self._tm.current.fail_all(f"the server failed: {failure}")
            log.critical("runtime failed (%r); ended %d requests in flight", failure, count)


@asynccontextmanager
async def open_supervised(topology: Topology, build: Callable[[Any, Path, Any, trio.Nursery], S]) -> AsyncIterator[S]:
    """Steps 1, 2 and 5 of the module docstring around ``build(tokenizer, runtime_dir, hub, nursery)``."""
    topology.check()
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, tokenizer_source(topology.model))
    with tempfile.TemporaryDirectory(prefix="tercet-") as runtime_dir:
        async with open_hub(topology.hub_options()) as hub, trio.open_nursery() as nursery:
            runtime = build(tokenizer, Path(runtime_dir), hub, nursery)
            await nursery.start(runtime.supervise)
            try:
                yield runtime
            finally:
                await runtime.supervisor.stop()
                nursery.cancel_scope.deadline = trio.current_time() + 30.0


@asynccontextmanager
async def open_runtime(topology: Topology) -> AsyncIterator[LocalRuntime]:
    """Start ``topology`` (one tokenizer manager, in this process); stop it after."""
    if topology.server.workers > 1:
        raise ValueError("server.workers > 1: start the tokenizer workers with serving.runtime.workers")

    def build(tokenizer: Any, runtime_dir: Path, hub: Any, nursery: trio.Nursery) -> LocalRuntime:
        return LocalRuntime(topology, tokenizer, runtime_dir, hub, nursery)

    async with open_supervised(topology, build) as runtime:
        yield runtime

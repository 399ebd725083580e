"""The replicas a server starts and watches (``scheduler.replicas: N``, ``tercet serve --dp-size N``).

A replica is a scheduler and its own detokenizer. A detokenizer per replica,
not one shared: the stop strings it finds go back to its own scheduler, a
crash of one loses one replica's outputs only, and a replica is one unit to
place (one pod, one Ray node). A server without replicas is a set of one.

``ReplicaSet`` builds the server's supervisor with the replicas in it. One
replica started here runs its two parts as children of the server's supervisor
(named ``scheduler`` and ``detokenizer``; past the restart intensity the
server fails). Several run each under a supervisor of its own (``replica-i``,
its parts named ``scheduler-i``, ``detokenizer-i``) within the topology's
supervision; a replica past its intensity leaves the pool (its supervisor's
child spec is temporary) and the server serves on while any replica is in it.
Replicas started elsewhere (``process: remote``: a pod, a Ray node) are watched
by heartbeats (``actors.remote``): each has a supervisor of its own here
(``replica-i``, not waited for at start: the front end serves as soon as any
replica is up) over a ``RemoteChild`` per part, named as a local replica's.
A part that stops answering within ``watchdogs.remote_timeout``, or answers
from another start of its process (it restarted: what it ran is lost), is a
crash of that child, and its restart waits until the part serves again (one
still loading its model answers that it is not ready). Such a supervisor never
gives up: a pod comes back. The answers come to the front end's ``monitor``
mailbox (``actors.monitor``), which the replicas dial.

``ReplicaStatus`` turns the supervisors' events into what the tokenizer
manager must do: a replica is *down* from the first crash of its scheduler
or detokenizer (its requests resume elsewhere at once, or on it once it is
back), *up* again once both run, and *gone* when it left the pool (never a
remote one).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import trio

from actors import ChildSpec, Restart, Supervisor, SupervisorEvent
from actors.actor import Pulse
from actors.remote import Monitor, RemoteChild
from transports import Hub, open_hub

from .interface import StatusTracker
from .specs import core_specs, make_supervisor
from .topology import Topology, TopologyError

__all__ = ["HEARTBEAT_S", "NoReplicaLeft", "ReplicaSet", "ReplicaStatus", "run_replica"]

PARTS = ("scheduler", "detokenizer")
HEARTBEAT_S = 0.5  # how often a remote replica's parts are asked how they are

Change = Literal["down", "up", "gone"]


class NoReplicaLeft(Exception):
    """Every replica left the pool."""


class ReplicaSet:
    """The replicas of ``topology``: each one's addresses, and the supervisor its parts run under.
    ``make_specs(i, addresses)``: replica ``i``'s child specs; ``forgive(i)``: replica ``i``'s
    supervisor's ``forgive`` (see ``actors.Supervisor``); ``on_loading(i, loading)``: remote
    replica ``i``'s scheduler answers that it is loading its model, or no longer. Nothing runs
    until ``server`` builds the server's supervisor (with the observer of every supervisor's events)."""

    def __init__(self, topology: Topology, runtime_dir: Path, hub: Hub,
                 make_specs: Callable[[int, dict[str, str]], list[ChildSpec]],
                 forgive: Callable[[int], Callable[[str, BaseException | None], bool]],
                 on_loading: Callable[[int, bool], None] = lambda index, loading: None) -> None:
        self.topology = topology
        self.addresses = topology.replica_addresses(runtime_dir)
        self.remote = {i for i, r in enumerate(topology.replica_placements()) if r.scheduler.process == "remote"}
        self.supervisors: list[Supervisor | None] = [None] * len(self.addresses)
        self._make_specs = make_specs
        self._observer: Callable[[SupervisorEvent], None] = _unobserved
        self._forgive = forgive
        self._on_loading = on_loading
        self._server: Supervisor | None = None
        self._shunned: dict[int, set[str]] = {i: set() for i in self.remote}  # starts given up on (stalled)
        # one replica started here: its parts are the server's own children, as without replicas
        self.flat = len(self.addresses) == 1 and not self.remote
        grace = topology.supervision.shutdown_grace
        # a replica's supervisor stops its two children one after the other
        self.specs = [] if self.flat else [
            ChildSpec(f"replica-{i}", self._starter(i), restart=Restart.TEMPORARY, shutdown=2 * grace + 1)
            for i in range(len(self.addresses)) if i not in self.remote]
        if self.remote:  # the monitor, then a supervisor per remote replica, ready in the background
            monitor = topology.monitor_placement()
            assert monitor is not None  # (the topology's check: it has one with remote replicas)
            self.specs += [ChildSpec("monitor", lambda: Monitor(hub, monitor.address, bind=monitor.bind),
                                     shutdown=grace)]
            self.specs += [ChildSpec(f"replica-{i}", self._remote_starter(i), wait=False, shutdown=grace)
                           for i in sorted(self.remote)]

    def __len__(self) -> int:
        return len(self.addresses)

    def server(self, specs: list[ChildSpec], observer: Callable[[SupervisorEvent], None]) -> Supervisor:
        """The server's supervisor: the replicas started here, then ``specs`` (the front end's children);
        ``observer`` hears every supervisor's events (the server's and each replica's)."""
        self._observer = observer
        if not self.flat:
            self._server = make_supervisor(self.topology, [*self.specs, *specs], self._observer, "server")
            return self._server
        supervisor = make_supervisor(self.topology, [*self._make_specs(0, self.addresses[0]), *specs],
                                     self._observer, "server", self._forgive(0))
        self.supervisors[0] = supervisor
        return supervisor

    def _starter(self, index: int) -> Callable[[], Supervisor]:
        def start() -> Supervisor:
            supervisor = make_supervisor(self.topology, self._make_specs(index, self.addresses[index]),
                                         self._observer, f"replica-{index}", self._forgive(index))
            self.supervisors[index] = supervisor
            return supervisor

        return start

    def _remote_starter(self, index: int) -> Callable[[], Supervisor]:
        """Remote replica ``index``'s supervisor: a ``RemoteChild`` per part. It never gives up (a pod
        comes back); a restart of a part waits until it serves again."""
        def part(name: str) -> RemoteChild:
            on_pulse = partial(self._pulse, index) if name == "scheduler" else None
            return RemoteChild(lambda: self.addresses[index][name], self._monitor, interval=HEARTBEAT_S,
                               timeout=self.topology.watchdogs.remote_timeout, shun=set(self._shunned[index]),
                               on_pulse=on_pulse)

        def start() -> Supervisor:
            supervisor = Supervisor(f"replica-{index}", [
                ChildSpec("scheduler", partial(part, "scheduler"), shutdown=1.0),
                ChildSpec("detokenizer", partial(part, "detokenizer"), shutdown=1.0, with_previous=True)],
                max_restarts=None, observer=self._observer)
            self.supervisors[index] = supervisor
            return supervisor

        return start

    def _monitor(self) -> Monitor | None:
        return None if self._server is None else self._server.child("monitor")

    def _pulse(self, index: int, pulse: Pulse) -> None:
        self._on_loading(index, not pulse.ready)

    def give_up(self, index: int, reason: BaseException) -> bool:
        """Remote replica ``index`` is not to be trusted until it restarted (its outputs stalled): its
        scheduler's watch ends with ``reason`` (a crash), and the next one waits for another start."""
        supervisor = self.supervisors[index]
        watch = None if supervisor is None else supervisor.child("scheduler")
        if watch is None:
            return False
        if watch.boot is not None:
            self._shunned[index].add(watch.boot)
        return supervisor.kill("scheduler", reason)

    def index_of(self, supervisor: str) -> int | None:
        """The replica whose parts ``supervisor`` (a name) runs; None for another supervisor."""
        if self.flat:
            return 0 if supervisor == "server" else None
        return replica_of(supervisor)

    def name(self, part: str, index: int) -> str:
        """``part`` of replica ``index`` as the status names it."""
        return part if self.flat else f"{part}-{index}"

    def running(self, index: int) -> list[str]:
        supervisor = self.supervisors[index]
        return [] if supervisor is None else supervisor.running()


def _unobserved(event: SupervisorEvent) -> None:
    raise AssertionError("a replica's supervisor started before ReplicaSet.server")


def replica_of(supervisor_or_child: str) -> int | None:
    name, _, index = supervisor_or_child.rpartition("-")
    return int(index) if name == "replica" and index.isdigit() else None


class ReplicaStatus(StatusTracker):
    """The status of a server's replicas. The scheduler "is running" while any replica serves.
    ``on_change(change, replica, cause, cache_lost)`` hears when a replica goes down, comes up
    or leaves the pool."""

    def __init__(self, replicas: ReplicaSet, on_change: Callable[[Change, int, str, bool], None]) -> None:
        super().__init__()
        self.replicas = replicas
        self.on_change = on_change
        self.pool = set(range(len(replicas)))  # not gone
        self.serving: set[int] = set()  # in the pool, with both parts running
        self.remote = set(replicas.remote)  # started elsewhere: watched by heartbeats
        self._down: set[int] = set(self.remote)  # lost their requests, not back yet (remote: not seen yet)
        self._restarts_seen: dict[str, int] = {}
        self._set_up(False)  # nothing serves until the replicas start

    @property
    def restarts(self) -> dict[str, int]:
        for i, supervisor in enumerate(self.replicas.supervisors):
            if supervisor is not None:
                for child, count in supervisor.restarts.items():
                    self._restarts_seen[self.replicas.name(child, i) if child in PARTS else child] = count
        return dict(self._restarts_seen)

    def pids(self) -> dict[str, int]:
        pids = {}
        for i, supervisor in enumerate(self.replicas.supervisors):
            if supervisor is not None:
                for child in supervisor.running():
                    pid = getattr(supervisor.child(child), "pid", None)
                    if pid:
                        pids[self.replicas.name(child, i) if child in PARTS else child] = pid
        return pids

    def scheduler_running(self) -> bool:
        return self.failure is None and bool(self.serving)

    def observe(self, event: SupervisorEvent) -> str | None:
        replica = self.replicas.index_of(event.supervisor)
        if replica is not None and event.child in PARTS:
            self._part_event(replica, event)
        elif (gone := replica_of(event.child)) is not None and event.kind in ("crashed", "exited") \
                and gone not in self.remote:  # (a remote one's supervisor never gives up)
            self.pool.discard(gone)
            self._serving(gone, False)
            self.on_change("gone", gone, f"replica {gone} left the pool: {event.reason!r}", True)
        else:  # the front end's own children
            self.record(event.child, event)
        return None

    def _part_event(self, replica: int, event: SupervisorEvent) -> None:
        name = self.replicas.name(event.child, replica)
        self.record(name, event)
        if event.kind in ("crashed", "exited"):
            self.mark_down(replica, f"the {name} crashed: {event.reason!r}", cache_lost=event.child == "scheduler")
        elif event.kind in ("restarting", "stopped"):
            self._serving(replica, False)
        elif event.kind == "started":
            if set(PARTS) <= set(self.replicas.running(replica)) and replica in self.pool:
                self._serving(replica, True)
                if replica in self._down:
                    self._down.discard(replica)
                    self.on_change("up", replica, "", False)

    def mark_down(self, replica: int, cause: str, *, cache_lost: bool) -> None:
        """``replica`` lost its requests (from its first crash, or once it is being killed)."""
        self._serving(replica, False)
        if replica not in self._down:
            self._down.add(replica)
            self.on_change("down", replica, cause, cache_lost)

    def _serving(self, replica: int, serving: bool) -> None:
        if serving:
            self.serving.add(replica)
        else:
            self.serving.discard(replica)
        self._set_up(bool(self.serving))


async def run_replica(topology: Topology, index: int, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """``tercet replica``: replica ``index`` of ``topology`` here — its scheduler and detokenizer in
    child processes, bound where its placements say, sending outputs to the front end's tokenizer
    address — under a supervisor with the topology's supervision. Runs until cancelled; past the
    restart intensity it raises (the pod, or Ray, starts it again)."""
    placements = topology.replica_placements()
    if not 0 <= index < len(placements):
        raise TopologyError(f"--index {index}: the topology has replicas 0..{len(placements) - 1}")
    with tempfile.TemporaryDirectory(prefix="tercet-replica-") as runtime_dir:
        where = Path(runtime_dir)
        addresses = topology.replica_addresses(where)[index]
        binds = topology.replica_addresses(where, bind=True)[index]
        workers = [topology.addresses(where)["tokenizer"]]
        async with open_hub(topology.hub_options()) as hub:
            specs = core_specs(topology, addresses, workers, hub, None, lambda: topology.model.path,
                               placements[index], binds)
            supervisor = make_supervisor(topology, specs, lambda event: None, f"replica-{index}")
            try:
                await supervisor.run(task_status=task_status)
            finally:
                with trio.CancelScope(shield=True):
                    await supervisor.stop()

"""Replicas placed on a Ray cluster (``server.launcher: ray``, ``tercet serve --launcher ray``).

Ray is the placement and process layer only. For each replica with
``process: remote`` the front end creates a Ray actor (``ReplicaActor``)
asking for the resources its scheduler's placement names (``CPU``, ``GPU``,
custom ones); the actor runs the replica there (``run_replica``: its
scheduler and detokenizer in child processes of the actor's worker, which
exit when it dies) and says where they listen (``{node_ip}`` in an address
is the node's). An actor whose process or node died is replaced by a new
one, which Ray places on any node with the resources.

tercet's transports stay the data plane (no Ray object store on the token
path) and tercet's supervision the authority: ``RayReplica``, a supervisor
child per replica under the front end's ``ray-replicas`` supervisor (its own
restart intensity: a Ray replica's failures never count against the front
end's), starts the actor, reports its death at
once (the replica is down: its requests move to the others) and the
addresses of each new incarnation (watched as any remote replica, it
rejoins when it answers). Any error of Ray's starting or watching an actor
(``RayTaskError`` when the replica cannot start on that node, its actor or
node dead, a placement refused) is that replica's failure, never the front
end's: it is reported down, its actor is killed (so it holds no GPU while
another starts), and a new one is tried, after a longer wait each time it
fails to start. Actor arguments are kept in Ray's GCS, readable across the
cluster: the topology sent holds no API key. Only this module imports Ray,
and only a topology with ``server.launcher: ray`` imports this module.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import ray
import trio
from ray.exceptions import GetTimeoutError, RayActorError

from actors import Backoff, ChildSpec, Supervisor

from .replicas import run_replica
from .topology import Topology

__all__ = ["RayReplica", "ReplicaActor", "ray_specs", "replica_topology"]

log = logging.getLogger(__name__)

RETRY_S = 1.0  # between an actor's end and the next one's start; doubled after each failed start...
RETRY_MAX_S = 30.0  # ...up to this


class ReplicaActor:
    """One replica in a Ray actor's process: ``start`` runs it (in a thread of its own, with its
    own trio loop) and returns its addresses, ``wait`` returns when it ended (why), ``stop``
    ends it."""

    def __init__(self, topology: dict[str, Any], index: int) -> None:
        ip = ray.util.get_node_ip_address()
        self.topology = msgspec.convert(_fill(topology, "{node_ip}", ip), Topology)
        self.index = index
        self._started = threading.Event()
        self._ended = threading.Event()
        self._error: str | None = None
        self._stop: Callable[[], None] | None = None

    def start(self) -> dict[str, str]:
        if not self._started.is_set():
            threading.Thread(target=self._run, name=f"replica-{self.index}", daemon=True).start()
            self._started.wait()
        if self._error is not None:
            raise RuntimeError(self._error)
        where = self.topology.replica_addresses(_NO_DIR)[self.index]
        return {**where, "node": ray.get_runtime_context().get_node_id()}

    def wait(self) -> str | None:
        self._ended.wait()
        return self._error

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
        self._ended.wait(60)

    def _run(self) -> None:
        async def main() -> None:
            token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                await nursery.start(run_replica, self.topology, self.index)
                self._stop = lambda: token.run_sync_soon(nursery.cancel_scope.cancel)
                self._started.set()

        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - past its restart intensity, or it could not start
            self._error = f"replica {self.index} ended: {exc!r}"
        finally:
            self._started.set()
            self._ended.set()


_NO_DIR = Path("/nonexistent")  # remote addresses are tcp://: no {runtime_dir} in them


def _fill(value: Any, placeholder: str, text: str) -> Any:
    if isinstance(value, str):
        return value.replace(placeholder, text)
    if isinstance(value, dict):
        return {k: _fill(v, placeholder, text) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, placeholder, text) for v in value]
    return value


def replica_topology(topology: Topology) -> dict[str, Any]:
    """What an actor needs to run a replica, as plain data: the topology without the server's
    API keys (actor arguments are stored in Ray's GCS, which anyone on the cluster can read)."""
    server = msgspec.structs.replace(topology.server, api_key=None, admin_api_key=None)
    return msgspec.to_builtins(msgspec.structs.replace(topology, server=server))


class RayReplica:
    """A supervisor child in the front end: replica ``index`` as a Ray actor, kept running, one
    actor at a time. ``on_started(index, addresses)`` hears each incarnation's addresses (and its
    node), ``on_lost(index, cause)`` each death or failed start."""

    def __init__(self, topology: Topology, index: int, on_started: Callable[[int, dict[str, str]], None],
                 on_lost: Callable[[int, str], None]) -> None:
        self.topology = topology
        self.index = index
        self.on_started = on_started
        self.on_lost = on_lost
        self.actor: Any = None
        self._stopping = trio.Event()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)
        delay = RETRY_S
        try:
            while not self._stopping.is_set():
                served = await self._connected() and await self._incarnation()
                delay = RETRY_S if served else min(2 * delay, RETRY_MAX_S)
                with trio.move_on_after(delay):
                    await self._stopping.wait()
        finally:
            with trio.CancelScope(shield=True):
                await self._kill()

    async def _connected(self) -> bool:
        """Whether this process is connected to the Ray cluster (a cluster that cannot be reached is
        this replica's failure: it is down, and tried again after the back-off)."""
        try:
            await trio.to_thread.run_sync(_connect, self.topology.server.ray_address)
        except Exception as exc:  # noqa: BLE001 - ConnectionError, a version mismatch, ...: any
            self.on_lost(self.index, f"replica {self.index}: the Ray cluster cannot be reached: {_cause(exc)}")
            return False
        return True

    async def _incarnation(self) -> bool:
        """One actor: made, started, watched to its end, killed. Whether it served."""
        try:
            try:
                self.actor = self._new_actor()
                addresses = await trio.to_thread.run_sync(ray.get, self.actor.start.remote(), abandon_on_cancel=True)
            except Exception as exc:  # noqa: BLE001 - any Ray error (RayTaskError: it could not start there)
                self.on_lost(self.index, f"replica {self.index} could not start on Ray: {_cause(exc)}")
                return False
            log.info("replica %d runs on Ray node %s", self.index, addresses["node"])
            self.on_started(self.index, addresses)
            try:
                ended = await trio.to_thread.run_sync(ray.get, self.actor.wait.remote(), abandon_on_cancel=True)
            except Exception as exc:  # noqa: BLE001 - its process or its node died (RayActorError), or worse
                ended = f"replica {self.index}'s Ray actor died: {_cause(exc)}"
            self.on_lost(self.index, ended or f"replica {self.index} ended")
            return True
        finally:
            with trio.CancelScope(shield=True):
                await self._kill()  # before another starts: it holds its resources (GPUs) until it is gone

    def _new_actor(self) -> Any:
        resources = dict(self.topology.replica_placements()[self.index].scheduler.resources)
        options = {"num_cpus": resources.pop("CPU", 1), "num_gpus": resources.pop("GPU", 0),
                   "resources": resources, "max_restarts": 0, "max_task_retries": 0, "max_concurrency": 4}
        return ray.remote(ReplicaActor).options(**options).remote(replica_topology(self.topology), self.index)

    async def _kill(self) -> None:
        actor, self.actor = self.actor, None
        if actor is not None:
            await trio.to_thread.run_sync(_kill, actor)

    async def stop(self) -> None:
        self._stopping.set()
        if self.actor is not None:
            with trio.move_on_after(60):
                await trio.to_thread.run_sync(_end, self.actor, abandon_on_cancel=True)


def _connect(address: str | None) -> None:
    if not ray.is_initialized():
        ray.init(address=address or "auto", log_to_driver=False, configure_logging=False)


def _end(actor: Any) -> None:
    """Ask the replica to stop (its children end cleanly), then kill its actor."""
    try:
        ray.get(actor.stop.remote(), timeout=60)
    except (RayActorError, GetTimeoutError):
        pass
    _kill(actor)


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # noqa: BLE001 - gone already, or Ray cannot say: nothing more to do
        log.debug("ray.kill: %s", _cause(exc))


def _cause(exc: BaseException) -> str:
    """One line for a Ray error (a RayTaskError carries the actor's whole traceback)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1][:500]}" if text else type(exc).__name__


def ray_specs(topology: Topology, on_started: Callable[[int, dict[str, str]], None],
              on_lost: Callable[[int, str], None]) -> list[ChildSpec]:
    """One supervisor child, ``ray-replicas``: a supervisor of its own over a ``RayReplica`` for each
    remote replica of ``topology`` (``ray-replica-i``), so that however a Ray replica fails, its
    restarts count against its own supervisor's intensity, not the front end's."""
    grace = topology.supervision.shutdown_grace
    specs = [ChildSpec(f"ray-replica-{i}", lambda i=i: RayReplica(topology, i, on_started, on_lost),
                       shutdown=2 * grace + 5)
             for i, r in enumerate(topology.replica_placements()) if r.scheduler.process == "remote"]
    s = topology.supervision
    return [ChildSpec("ray-replicas", lambda: Supervisor("ray-replicas", specs, max_restarts=s.max_restarts,
                                                         within=s.within, backoff=Backoff(1.0, 2.0, RETRY_MAX_S)),
                      shutdown=2 * grace + 10)]

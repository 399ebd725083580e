"""The Ray launcher's failure paths (N11), without a cluster: ``RayReplica`` drives a fake of the
few Ray calls it makes (``remote``, ``get``, ``kill``), scripted actor by actor. A replica that
cannot start, or whose actor dies, is that replica's failure: reported down, its actor killed
before the next one is made, never an exception that reaches the front end's supervisor. The
topology sent to an actor (kept in Ray's GCS) carries no API key. test_ray.py runs the real
thing on a two-node local cluster."""

import threading

import msgspec
import pytest
import trio
import trio.testing

ray = pytest.importorskip("ray")

from ray.exceptions import RayActorError, RayTaskError  # noqa: E402

from serving.runtime import ray_launcher  # noqa: E402
from serving.runtime.ray_launcher import RayReplica, replica_topology  # noqa: E402
from serving.runtime.topology import load_topology  # noqa: E402

ADDRESSES = {"scheduler": "tcp://10.0.0.2:30101", "detokenizer": "tcp://10.0.0.2:30102", "node": "n2"}


def no_model_here():
    """What ``ray.get`` raises when ``ReplicaActor.start`` raised (a RayTaskError that is also the cause's type)."""
    error = RayTaskError("ReplicaActor.start", "Traceback (most recent call last):\nRuntimeError: replica 0 ended: "
                         "ModelLoadError('/models/x: no such file')", RuntimeError("no model"))
    return error.as_instanceof_cause()


class FakeActor:
    """One actor: ``start`` and ``wait`` do what the script says (raise, return, or block until
    the actor is killed)."""

    def __init__(self, fake, n, args, script):
        self.fake, self.n, self.args = fake, n, args
        self.start_outcome, self.wait_outcome = script
        self.killed = threading.Event()
        self.start = self._method(self._start)
        self.wait = self._method(self._wait)
        self.stop = self._method(lambda: None)

    @staticmethod
    def _method(fn):
        return type("Method", (), {"remote": staticmethod(lambda: fn)})()

    def _start(self):
        if isinstance(self.start_outcome, BaseException):
            raise self.start_outcome
        return ADDRESSES

    def _wait(self):
        if self.wait_outcome == "until killed":
            self.killed.wait()
            raise RayActorError()
        if isinstance(self.wait_outcome, BaseException):
            raise self.wait_outcome
        return self.wait_outcome


class FakeRay:
    """``ray`` as ray_launcher uses it; ``events`` in order: ("new", n), ("kill", n, no_restart),
    and the callbacks' ("started", index) and ("lost", index, cause), each with trio's time."""

    exceptions = ray.exceptions

    def __init__(self, scripts):
        self.scripts = list(scripts)
        self.actors = []
        self.events = []
        self.options = []

    unreachable = 0  # so many ``init`` calls fail first (a cluster that cannot be reached)

    def is_initialized(self):
        return False

    def init(self, **options):
        if self.unreachable > 0:
            self.unreachable -= 1
            self.events.append(("unreachable",))  # (in a worker thread: no trio clock here)
            raise ConnectionError("Could not find any running Ray instance")

    def remote(self, cls):
        fake = self

        class Handle:
            def options(self, **options):
                fake.options.append(options)
                return self

            def remote(self, *args):
                actor = FakeActor(fake, len(fake.actors), args, fake.scripts[len(fake.actors)])
                fake.actors.append(actor)
                fake.events.append(("new", actor.n, trio.current_time()))
                return actor

        return Handle()

    def get(self, ref, timeout=None):
        return ref()

    def kill(self, actor, no_restart=True):
        self.events.append(("kill", actor.n, no_restart))
        actor.killed.set()


@pytest.fixture
def topology(tmp_path):
    path = tmp_path / "ray.yaml"
    path.write_bytes(msgspec.yaml.encode({
        "model": {"path": "/models/x"}, "server": {"launcher": "ray", "api_key": "sesame", "admin_api_key": "open-up"},
        "scheduler": {"replicas": 1},
        "actors": {"tokenizer": {"process": "main", "address": "tcp://127.0.0.1:30100"},
                   "monitor": {"address": "tcp://127.0.0.1:30103"},
                   "replicas": [{"scheduler": {"process": "remote", "address": "tcp://127.0.0.1:30101",
                                               "resources": {"CPU": 2, "GPU": 1}},
                                 "detokenizer": {"process": "remote", "address": "tcp://127.0.0.1:30102"}}]}}))
    return load_topology(path)


async def run_script(monkeypatch, topology, scripts, *, until, unreachable=0):
    """Run replica 0 on ``scripts`` (one per actor) until ``until(events)``, then stop the front end."""
    fake = FakeRay(scripts)
    fake.unreachable = unreachable
    monkeypatch.setattr(ray_launcher, "ray", fake)
    done = trio.Event()

    def on_started(index, addresses):
        fake.events.append(("started", index))
        if until(fake.events):
            done.set()

    def on_lost(index, cause):
        fake.events.append(("lost", index, cause, trio.current_time()))
        if until(fake.events):
            done.set()

    replica = RayReplica(topology, 0, on_started, on_lost)
    async with trio.open_nursery() as nursery:
        await nursery.start(replica.run)  # (it raises nothing: whatever Ray does is this replica's)
        await done.wait()
        nursery.cancel_scope.cancel()
    return fake


def count(kind, n):
    return lambda events: sum(e[0] == kind for e in events) == n


async def test_a_replica_that_cannot_start_is_reported_down_killed_and_tried_again_later(
        monkeypatch, topology, autojump_clock):
    fake = await run_script(monkeypatch, topology, [
        (no_model_here(), None), (no_model_here(), None), (no_model_here(), None),
        (None, RayActorError()),  # then it starts, and its node dies
        (None, "until killed")], until=count("started", 2))
    kinds = [event[:2] for event in fake.events]
    assert kinds == [("new", 0), ("lost", 0), ("kill", 0), ("new", 1), ("lost", 0), ("kill", 1),
                     ("new", 2), ("lost", 0), ("kill", 2),
                     ("new", 3), ("started", 0), ("lost", 0), ("kill", 3),
                     ("new", 4), ("started", 0), ("kill", 4)]  # the last: killed as the front end stops
    assert all(event[2] is True for event in fake.events if event[0] == "kill")  # for good: Ray restarts nothing
    lost = [event[2] for event in fake.events if event[0] == "lost"]
    assert lost[0] == "replica 0 could not start on Ray: RayTaskError(RuntimeError): " \
        "RuntimeError: replica 0 ended: ModelLoadError('/models/x: no such file')"
    assert lost[3] == "replica 0's Ray actor died: RayActorError: The actor experienced an error before finishing " \
        "this task."
    # each failed start waits twice as long; a replica that served starts over at RETRY_S
    made = [event[2] for event in fake.events if event[0] == "new"]
    gaps = [round(b - a, 6) for a, b in zip(made, made[1:])]
    assert gaps == [2.0, 4.0, 8.0, ray_launcher.RETRY_S]
    assert fake.options[0] == {"num_cpus": 2, "num_gpus": 1, "resources": {}, "max_restarts": 0,
                               "max_task_retries": 0, "max_concurrency": 4}


async def test_failed_starts_wait_at_most_retry_max(monkeypatch, topology, autojump_clock):
    fake = await run_script(monkeypatch, topology, [(no_model_here(), None)] * 8, until=count("lost", 8))
    made = [event[2] for event in fake.events if event[0] == "new"]
    assert [round(b - a, 6) for a, b in zip(made, made[1:])] == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


async def test_no_api_key_travels_to_an_actor(monkeypatch, topology, autojump_clock):
    fake = await run_script(monkeypatch, topology, [(None, "until killed")], until=count("started", 1))
    (actor,) = fake.actors
    sent, index = actor.args
    assert index == 0 and b"sesame" not in msgspec.json.encode(sent) and b"open-up" not in msgspec.json.encode(sent)
    assert sent["server"]["api_key"] is None and sent["model"]["path"] == "/models/x"
    assert msgspec.convert(sent, type(topology)).actors == topology.actors  # the rest as it was
    assert topology.server.api_key == "sesame"  # (the front end's own is untouched)


def test_replica_topology_keeps_everything_but_the_keys(topology):
    sent = replica_topology(topology)
    keys = msgspec.structs.replace(topology.server, api_key=None, admin_api_key=None)
    assert msgspec.convert(sent, type(topology)) == msgspec.structs.replace(topology, server=keys)


async def test_stop_ends_the_replica_and_kills_its_actor(monkeypatch, topology):
    fake = FakeRay([(None, "until killed")])
    monkeypatch.setattr(ray_launcher, "ray", fake)
    replica = RayReplica(topology, 0, lambda *a: None, lambda *a: None)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(replica.run)
            while not fake.actors:
                await trio.testing.wait_all_tasks_blocked()
            await replica.stop()
    # run returned by itself (nothing cancelled it); the one actor was asked to stop, then killed
    assert [e[:2] for e in fake.events] == [("new", 0), ("kill", 0), ("kill", 0)]
    assert replica.actor is None and len(fake.actors) == 1


async def test_a_cluster_that_cannot_be_reached_is_the_replicas_failure(monkeypatch, topology, autojump_clock):
    fake = await run_script(monkeypatch, topology, [(None, "until killed")], until=count("started", 1), unreachable=3)
    kinds = [event[0] for event in fake.events]
    assert kinds == ["unreachable", "lost", "unreachable", "lost", "unreachable", "lost", "new", "started", "kill"]
    lost = [event[2] for event in fake.events if event[0] == "lost"]
    assert lost[0] == "replica 0: the Ray cluster cannot be reached: ConnectionError: Could not find any running " \
        "Ray instance"
    tries = [event[3] for event in fake.events if event[0] == "lost"]
    assert [round(b - a, 6) for a, b in zip(tries, tries[1:])] == [2.0, 4.0]  # backing off, as failed starts do


def test_the_ray_replicas_have_a_supervisor_of_their_own(topology):
    from actors import Supervisor

    from serving.runtime.ray_launcher import ray_specs

    (spec,) = ray_specs(topology, lambda *a: None, lambda *a: None)
    supervisor = spec.start()
    assert spec.name == "ray-replicas" and isinstance(supervisor, Supervisor)
    assert [child.name for child in supervisor.specs] == ["ray-replica-0"]
    assert supervisor.max_restarts == topology.supervision.max_restarts

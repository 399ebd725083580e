"""The Ray launcher: a local Ray cluster of two nodes (``ray.cluster_utils.Cluster``, two raylets
on this machine), one replica per node over tcp; removing a node mid-stream moves its requests to
the other replica with the fault-free text. Ray's start-up here: about 4 s for both nodes."""

import subprocess
import sys

import httpx
import pytest
import trio
import yaml

from ..conftest import free_tcp_port
from .test_http import start_server
from .test_recovery import baseline, requests_for, runner  # noqa: F401
from .test_replicas import stream_and_strike

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # Ray starts in seconds here; bounded anyway


def ray_topology(tmp_path, address):
    def at(port):
        return {"process": "remote", "address": f"tcp://127.0.0.1:{port}"}

    replicas = []
    for slot in ("slot_a", "slot_b"):  # one replica per node: each node holds one slot
        scheduler = {**at(free_tcp_port()), "resources": {"CPU": 1, slot: 1}}
        replicas.append({"scheduler": scheduler, "detokenizer": at(free_tcp_port())})
    data = {"model": {"path": "tiny", "dtype": "float32"},
            "server": {"launcher": "ray", "ray_address": address},
            "scheduler": {"replicas": 2, "threads": 1},
            "router": {"policy": "round_robin"},
            "supervision": {"max_restarts": 20, "quarantine_after": 1000},
            "watchdogs": {"remote_timeout": 3.0},
            "actors": {"tokenizer": {"process": "main", "address": f"tcp://127.0.0.1:{free_tcp_port()}"},
                       "monitor": {"address": f"tcp://127.0.0.1:{free_tcp_port()}"}, "replicas": replicas}}
    path = tmp_path / "ray.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"slot_a": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=2, resources={"slot_b": 1})
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


async def test_replicas_on_two_ray_nodes_and_a_node_removed_mid_stream(nursery, baseline, tmp_path, cluster):
    bodies = requests_for(25, n=8)
    expected = baseline(bodies)
    url, app = await start_server(nursery, str(ray_topology(tmp_path, cluster.address)))
    runtime = app.state.server.runtime
    tm, status = runtime.tokenizer_manager, runtime.status
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        with trio.fail_after(120):
            while tm.replicas.up != [True, True]:
                await trio.sleep(0.05)
        nodes = {node.node_id: node for node in cluster.list_all_nodes()}
        actor = runtime.supervisor.child("ray-replicas").child("ray-replica-1").actor
        on_b = ray.get(actor.start.remote())["node"]  # (slot_b: the added node)
        assert on_b in nodes and nodes[on_b] is not cluster.head_node

        async def remove_node(app, client):
            await trio.to_thread.run_sync(cluster.remove_node, nodes[on_b])

        texts, info = await stream_and_strike(app, client, bodies, remove_node, victim=1)
        assert texts == expected
        assert tm.migrated > 0 and tm.replicas.up == [True, False] and 1 not in status.serving
        # /health answers from the monitor's last look: under load a look at the surviving replica
        # can time out while it takes the moved requests, so wait for a look made since (bounded)
        with trio.fail_after(30):
            while (health := (await client.get("/health")).text) != "OK: 1 of 2 replicas serving":
                assert "replica" in health or "answered" in health, health
                await trio.sleep(0.2)
        cluster.add_node(num_cpus=2, resources={"slot_b": 1})  # Ray restarts the actor there: it rejoins
        with trio.fail_after(120):
            while not tm.replicas.up[1]:
                await trio.sleep(0.05)


def test_single_host_serving_never_imports_ray():
    code = ("import sys, serving.cli, serving.runtime.launch, serving.http.app; "
            "from serving.runtime.topology import load_topology; load_topology('default', {'scheduler.replicas': 2}); "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"

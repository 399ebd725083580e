"""Several tokenizer/HTTP worker processes on one port (configs/multi-worker.yaml),
through real HTTP: outputs reach the worker that owns the request, an abort
reaches a request of another worker, a worker's death frees its requests while
the others keep serving, and a scheduler kill resumes the requests of every worker."""

import json
import os
import signal
from contextlib import AsyncExitStack

import httpx
import pytest
import trio

from serving.cli import serve_workers
from serving.runtime.topology import TopologyError, load_topology

from ..conftest import free_tcp_port
from .test_http import assert_held_until_continued, metric
from .test_recovery import RECOVERY, assert_drained, baseline, requests_for, runner  # noqa: F401 - fixtures
from .test_update_weights import GREEDY, model_dirs, serving_a  # noqa: F401 - a fixture

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # several worker processes per test


async def start_workers(nursery, **overrides):
    topology = load_topology("multi-worker", {"model.path": "tiny", "server.port": free_tcp_port(), **overrides})
    pool = await nursery.start(serve_workers, topology)
    return f"http://127.0.0.1:{topology.server.port}", pool


async def pinned_clients(stack, url, per_worker=1, workers=2):
    """Clients of one keep-alive connection each, ``per_worker`` on every worker: the
    kernel hands a new connection to whichever worker accepts first, so open them
    until each worker has its share. Use each for one request at a time."""
    pinned = {worker: [] for worker in range(workers)}
    for _ in range(50 * per_worker * workers):
        client = await stack.enter_async_context(
            httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=1)))
        worker = (await client.get("/server_info")).json()["worker"]
        if len(pinned[worker]) < per_worker:
            pinned[worker].append(client)
        if all(len(clients) == per_worker for clients in pinned.values()):
            return pinned
    raise AssertionError(f"could not reach every worker: {({w: len(c) for w, c in pinned.items()})}")


def parse_sse(text):
    """(text, ids, finish_reason) of a /generate stream that ended with [DONE]."""
    assert text.endswith("data: [DONE]\n\n"), text[-300:]
    last = None
    for block in text.split("\n\n"):
        if block.startswith("data: {"):
            event = json.loads(block.removeprefix("data: "))
            assert last is None or event["text"].startswith(last["text"]), "a streamed text went back on itself"
            last = event
    return last["text"], last["output_ids"], last["meta_info"]["finish_reason"]


async def wait_for(client, predicate):
    """Poll /server_info (the scheduler's own view) until ``predicate(info)``. A 503 (no
    scheduler answers: it is restarting, which a loaded host can bring before the test
    looks) is asked again."""
    with trio.fail_after(120):
        while True:
            r = await client.get("/server_info")
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200 and predicate(info := r.json()):
                return info
            await trio.sleep(0.01)


def test_workers_need_ipc_or_tcp_links(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("server:\n  workers: 2\nactors:\n  scheduler: {address: 'inproc://scheduler'}\n")
    with pytest.raises(TopologyError, match=r"broken.yaml:4: actors.scheduler.address: .*ipc:// or tcp://"):
        load_topology(broken)
    topology = load_topology("multi-worker", {"server.workers": 3})
    assert topology.worker_addresses("/run") == [f"ipc:///run/tokenizer-{i}" for i in range(3)]
    tcp = load_topology("tcp", {"server.workers": 2})
    assert [a.rsplit(":", 1)[1] for a in tcp.worker_addresses("/run")] == ["30103", "30104"]


async def test_two_workers_serve_route_abort_pause_and_update_weights(nursery, model_dirs):
    url, pool = await start_workers(nursery, **serving_a(model_dirs))
    async with AsyncExitStack() as stack:
        pinned = await pinned_clients(stack, url, per_worker=3)
        clients = {worker: pinned[worker][0] for worker in pinned}
        info = (await clients[0].get("/server_info")).json()
        assert {"worker-0", "worker-1", "scheduler", "detokenizer"} <= set(info["pids"])
        assert (await clients[1].get("/health")).status_code == 200

        # concurrent requests on both workers: every output reaches its own worker and request
        def body_for(k, **extra):
            return {"input_ids": [5 + k, 6, 7], **extra,
                    "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0}}

        references = []
        for k in range(3):  # one at a time: nothing to mix up
            r = (await clients[k % 2].post("/generate", json=body_for(k))).json()
            references.append((r["text"], r["output_ids"]))
        assert len({tuple(ids) for _, ids in references}) == 3  # a swapped output would show
        results = {}

        async def run(worker, k):
            for stream in (True, False):
                body = body_for(k, stream=stream)
                r = await pinned[worker][k].post("/generate", json=body)
                assert r.status_code == 200, r.text
                if stream:
                    text, ids, finish = parse_sse(r.text)
                else:
                    text, ids, finish = r.json()["text"], r.json()["output_ids"], r.json()["meta_info"]["finish_reason"]
                results[worker, k, stream] = (text, ids, finish)

        async with trio.open_nursery() as inner:
            for worker in (0, 1):
                for k in range(3):
                    inner.start_soon(run, worker, k)
        assert len(results) == 12
        assert all(len(ids) == 12 and finish == {"type": "length", "matched": 12}
                   for _, ids, finish in results.values())
        assert all(text == pool.tokenizer.decode(ids) for text, ids, _ in results.values())
        assert all((text, ids) == references[k] for (_, k, _), (text, ids, _) in results.items())
        # either worker reports the whole server's figures
        for worker in (0, 1):
            assert await metric(clients[worker], 'tercet_requests_total{finish_reason="length"}') == 12 + 3
            assert await metric(clients[worker], "tercet_generation_tokens_total") == (12 + 3) * 12

        # two clients give the same rid to requests on different workers: each gets its own answer
        twins = {}

        async def twin(worker):
            r = await pinned[worker][1].post("/generate", json=body_for(worker, rid="twin"))
            twins[worker] = (r.status_code, r.json()["text"], r.json()["output_ids"])

        async with trio.open_nursery() as inner:
            for worker in (0, 1):
                inner.start_soon(twin, worker)
        assert twins == {w: (200, *references[w]) for w in (0, 1)}

        # /abort_request that lands on the other worker still aborts the request
        body = {"input_ids": [9, 10], "rid": "far-away", "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        async with trio.open_nursery() as inner:
            ended = {}

            async def long_stream():
                ended["response"] = await clients[0].post("/generate", json=body)

            inner.start_soon(long_stream)
            await wait_for(clients[1], lambda info: info["requests_by_worker"].get("0"))
            r = await clients[1].post("/abort_request", json={"rid": "far-away"})
            assert r.json() == {"rid": "far-away", "aborted": True}
        _, _, finish = parse_sse(ended["response"].text)
        assert finish["type"] == "abort"
        assert (await clients[1].post("/abort_request", json={"rid": "nobody"})).json()["aborted"] is False
        assert_drained(await wait_for(clients[1], lambda info: info["running"] == 0))

        before = (await pinned[1][0].post("/generate", json=GREEDY)).json()["output_ids"]

        # paused through worker 0: worker 1 holds new requests too, until continued through worker 1
        await assert_held_until_continued(pinned[0][0], pinned[1][1], pinned[1][0])

        # a weight update through worker 0 waits for a request in flight on worker 1
        order = []

        async def long_request():
            r = await pinned[1][1].post("/generate", json={**GREEDY, "sampling_params": {
                "max_new_tokens": 300, "ignore_eos": True, "temperature": 0}})
            assert r.status_code == 200
            order.append("request finished")

        async def update():
            r = await pinned[0][0].post("/update_weights_from_disk", json={"model_path": model_dirs["b"]})
            assert r.status_code == 200, r.text
            order.append("weights updated")

        async with trio.open_nursery() as inner:
            inner.start_soon(long_request)
            await wait_for(pinned[1][0], lambda info: info["requests_by_worker"])  # in flight
            inner.start_soon(update)
        assert order == ["request finished", "weights updated"]
        after = [(await pinned[w][0].post("/generate", json=GREEDY)).json()["output_ids"] for w in (0, 1)]
        assert after[0] == after[1] != before
        r = await pinned[1][0].post("/update_weights_from_disk", json={"model_path": model_dirs["wide"]})
        assert r.status_code == 400 and "hidden_size" in r.json()["error"]["message"]
    assert not pool.paused and not pool.updating
    nursery.cancel_scope.cancel()


async def test_a_dead_worker_frees_its_requests_and_the_other_keeps_serving(nursery):
    url, pool = await start_workers(nursery)
    async with AsyncExitStack() as stack:
        pinned = await pinned_clients(stack, url, per_worker=3)
        clients = {worker: pinned[worker][0] for worker in pinned}
        doomed = {"input_ids": [3, 4, 5], "stream": True,
                  "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        survivor = {"input_ids": [7, 8, 9], "stream": True,
                    "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}
        cut, completed = [], []

        async def on_doomed_worker(client):
            try:
                await client.post("/generate", json=doomed)
            except httpx.TransportError as exc:  # the worker's process died under the connection
                cut.append(exc)

        async def on_surviving_worker(client):
            r = await client.post("/generate", json=survivor)
            completed.append(parse_sse(r.text))

        probe = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=300))
        async with trio.open_nursery() as inner:
            for k in range(3):
                inner.start_soon(on_doomed_worker, pinned[0][k])
                inner.start_soon(on_surviving_worker, pinned[1][k])
            before = await wait_for(probe, lambda info: info["requests_by_worker"].get("0") == 3
                                    and info["requests_by_worker"].get("1") == 3)
            os.kill(before["pids"]["worker-0"], signal.SIGKILL)
            await pool.status.started("worker-0", 2)  # restarted, after the scheduler aborted its requests
            # (the workers hear of the new pid by the main process's next status broadcast)
            info = await wait_for(probe, lambda info: info["pids"].get("worker-0") not in (None, before["pids"]["worker-0"]))
            assert "0" not in info["requests_by_worker"]
            # the restarted worker serves too, while the survivors still stream
            fresh = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=300))
            r = await fresh.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 3}})
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3

        assert len(cut) == 3
        assert len(completed) == 3 and all(len(ids) == 400 and finish["type"] == "length"
                                           for _, ids, finish in completed)
        assert pool.status.restarts == {"scheduler": 0, "detokenizer": 0, "control": 0, "worker-0": 1, "worker-1": 0}
        assert_drained(await wait_for(probe, lambda info: info["running"] == 0))
    nursery.cancel_scope.cancel()


async def test_faults_downstream_resume_the_requests_of_every_worker(nursery, baseline, tmp_path):
    """8 streams on two workers through three faults: the scheduler's step hangs (each worker's
    output watchdog reports the stall, WorkerStalled, and the main process kills the scheduler),
    then a kill -9 of the scheduler, then one of the detokenizer. Each time every request of
    every worker resumes; each ends with the text of a fault-free run."""
    bodies = requests_for(21, n=8, max_new_tokens=300)
    expected = baseline(bodies)
    hang = {"process": "child", "address": "ipc://{runtime_dir}/scheduler",
            "target": "tests.serving.faults:hanging_scheduler_child",
            "args": {"steps": 30, "marker": str(tmp_path / "hung-once")}}
    url, pool = await start_workers(nursery, **RECOVERY, **{"actors.scheduler": hang, "watchdogs.output_timeout": 8.0})
    texts = {}
    async with AsyncExitStack() as stack:
        pinned = await pinned_clients(stack, url, per_worker=4)

        async def one(client, body):
            r = await client.post("/generate", json={**body, "stream": True})
            text, ids, _ = parse_sse(r.text)
            texts[body["rid"]] = (text, ids)

        async with trio.open_nursery() as inner:
            for i, body in enumerate(bodies):
                inner.start_soon(one, pinned[i % 2][i // 2], body)
            probe = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=300))
            await wait_for(probe, lambda info: info["requests_by_worker"] == {"0": 4, "1": 4})
            with trio.fail_after(120):  # the step hangs after 30 steps; the stall is reported in 8 s
                await pool.status.started("scheduler", 2)
            assert (tmp_path / "hung-once").exists()
            assert pool.status.crashes == {("scheduler", "OutputStalled"): 1}
            info = await wait_for(probe, lambda info: info["steps"] >= 10)  # the new scheduler decodes
            os.kill(info["pids"]["scheduler"], signal.SIGKILL)
            await pool.status.started("scheduler", 3)
            info = await wait_for(probe, lambda info: info["steps"] >= 10)
            os.kill(info["pids"]["detokenizer"], signal.SIGKILL)
            await pool.status.started("detokenizer", 2)
        info = (await probe.get("/server_info")).json()
        assert await metric(probe, 'tercet_restarts{actor="scheduler"}') == 2
        assert await metric(probe, 'tercet_restarts{actor="detokenizer"}') == 1
        assert await metric(probe, "tercet_recovery_seconds_count") == 3
        assert await metric(probe, "tercet_resumed_requests") == 3 * len(bodies)
    assert texts == expected
    assert info["restarts"]["scheduler"] == 2 and info["restarts"]["detokenizer"] == 1
    assert_drained(info, stale_outputs=True)  # (the scheduler's outputs while the detokenizer restarted)
    nursery.cancel_scope.cancel()


async def test_past_the_restart_intensity_every_worker_fails_its_requests_fast(nursery):
    topology = load_topology("multi-worker", {"model.path": "tiny", "server.port": free_tcp_port(),
                                              "supervision.max_restarts": 0})
    url = f"http://127.0.0.1:{topology.server.port}"
    returned = {}

    async def serve(task_status=trio.TASK_STATUS_IGNORED):
        returned["failure"] = await serve_workers(topology, failure_grace=0.5, task_status=task_status)

    pool = await nursery.start(serve)
    ended = {}
    async with AsyncExitStack() as stack:
        pinned = await pinned_clients(stack, url, per_worker=2)
        pids = (await pinned[0][0].get("/server_info")).json()["pids"]

        streaming = trio.Semaphore(0)

        async def long_request(worker, k):
            body = {"input_ids": [5, 6, 7], "stream": k == 0,
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
            async with pinned[worker][k].stream("POST", "/generate", json=body) as r:
                text = ""
                async for piece in r.aiter_text():  # read to the end
                    if not text and body["stream"]:
                        streaming.release()
                    text += piece
            ended[worker, k] = (r.status_code, text, trio.current_time())

        probe = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=300))
        async with trio.open_nursery() as inner:
            for worker in (0, 1):
                for k in (0, 1):
                    inner.start_soon(long_request, worker, k)
            await wait_for(probe, lambda info: info["requests_by_worker"] == {"0": 2, "1": 2})
            for _ in (0, 1):  # both streams are flowing
                await streaming.acquire()
            os.kill(pids["scheduler"], signal.SIGKILL)
            killed_at = trio.current_time()
    assert pool.status.failed.is_set()
    for (worker, k), (status, text, at) in ended.items():
        assert at - killed_at < 1.0, (worker, k, at - killed_at)
        if k == 0:  # streaming: an error event, then [DONE]
            assert status == 200 and '"error"' in text and text.endswith("data: [DONE]\n\n"), text[-300:]
        else:
            assert status == 503, text
    with trio.fail_after(60):
        while "failure" not in returned:
            await trio.sleep(0.05)  # serve_workers stops the children and returns
    assert "more than 0 restarts" in str(returned["failure"])
    for pid in pids.values():  # every child process is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_a_status_a_worker_did_not_take_is_sent_again_and_a_resume_is_not_lost(autojump_clock):
    """L9: a worker that is not there when a ``resume`` goes out (restarting, swamped) gets it later,
    folded into any newer status; the others are not held up meanwhile."""
    from serving.managers.messages import RuntimeStatus
    from serving.runtime.workers import SEND_TIMEOUT, StatusBroadcaster

    received: dict[str, list[RuntimeStatus]] = {"w0": [], "w1": []}
    away = {"w1": 2}  # w1 takes nothing for its first two tries

    class Sender:  # (a unit fake: the broadcaster's own logic, not the transport, is under test)
        def __init__(self, address):
            self.address = address

        async def send(self, status):
            if away.get(self.address, 0) > 0:
                away[self.address] -= 1
                await trio.sleep_forever()
            received[self.address].append(status)

        async def aclose(self):
            await trio.lowlevel.checkpoint()

    class Hub:
        async def connect(self, address):
            await trio.lowlevel.checkpoint()
            return Sender(address)

    broadcaster = StatusBroadcaster(Hub(), ["w1", "w0"])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(broadcaster.run)
        start = trio.current_time()
        broadcaster.publish(RuntimeStatus(scheduler_up=True, resume=True, crash="the scheduler crashed"))
        broadcaster.publish(RuntimeStatus(scheduler_up=True))
        while len(received["w0"]) < 2:
            await trio.sleep(0.01)
        assert trio.current_time() - start < 2 * SEND_TIMEOUT + 0.5  # w0 was not held up for long
        while not received["w1"]:
            await trio.sleep(0.01)
        assert broadcaster.owed == {}
        broadcaster.close()
    assert [s.resume for s in received["w0"]] == [True, False]
    assert len(received["w1"]) == 1  # the newer status, carrying the resume it missed
    assert received["w1"][0].resume and received["w1"][0].crash == "the scheduler crashed"

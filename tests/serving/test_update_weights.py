"""POST /update_weights_from_disk: in-flight requests finish on the old weights."""

from functools import partial

import httpx
import pytest
import trio

from .test_http import start_server


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from models.loading import tiny_config, tiny_model, to_transformers

    root = tmp_path_factory.mktemp("weights")
    dirs = {"root": str(root)}
    for name, seed, config in (("a", 0, None), ("b", 3, None), ("wide", 0, tiny_config(hidden_size=128)),
                               ("taller", 0, tiny_config(intermediate_size=256))):
        loaded = tiny_model(config, seed=seed)
        path = root / name
        to_transformers(loaded).save_pretrained(path)
        loaded.tokenizer.save_pretrained(path)
        dirs[name] = str(path)
    return dirs


def serving_a(model_dirs, **overrides):
    """Overrides for a server of model a that may load weights from the other directories."""
    return {"model.path": model_dirs["a"], "model.dtype": "float32", "server.weights_roots": [model_dirs["root"]],
            **overrides}


GREEDY = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


async def test_weights_swap_after_in_flight_requests_finish(nursery, model_dirs):
    url, app = await start_server(nursery, "single-process", **serving_a(model_dirs))
    tm = app.state.server.runtime.tokenizer_manager
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        before = (await client.post("/generate", json=GREEDY)).json()["output_ids"]
        order = []

        async def long_request():
            r = await client.post("/generate", json={**GREEDY, "sampling_params": {
                "max_new_tokens": 300, "ignore_eos": True, "temperature": 0}})
            assert r.status_code == 200
            order.append("request finished")

        async def update():
            r = await client.post("/update_weights_from_disk", json={"model_path": model_dirs["b"]})
            assert r.status_code == 200, r.text
            order.append("weights updated")

        async with trio.open_nursery() as inner:
            inner.start_soon(long_request)
            while not tm.rid_to_state:  # the long request is in flight
                await trio.sleep(0.001)
            inner.start_soon(update)
        assert order == ["request finished", "weights updated"]
        after = (await client.post("/generate", json=GREEDY)).json()["output_ids"]
        assert after != before
        r = await client.post("/update_weights_from_disk", json={"model_path": model_dirs["a"]})
        assert r.status_code == 200
        assert (await client.post("/generate", json=GREEDY)).json()["output_ids"] == before

        r = await client.post("/update_weights_from_disk", json={"model_path": model_dirs["wide"]})
        assert r.status_code == 400 and "hidden_size" in r.json()["error"]["message"]
        assert (await client.post("/generate", json=GREEDY)).json()["output_ids"] == before


def broken_copies(model_dirs, tmp):
    """Directories of model a's files, each broken another way."""
    import shutil

    broken = {}
    for name, damage in (
        ("bad-config", lambda d: (d / "config.json").write_text("{not json")),
        ("truncated-weights", lambda d: _truncate(next(d.glob("*.safetensors")))),
        ("missing-tensor", lambda d: _drop_a_tensor(next(d.glob("*.safetensors")))),
        ("no-weights", lambda d: [p.unlink() for p in d.glob("*.safetensors")]),
    ):
        d = tmp / name
        shutil.copytree(model_dirs["a"], d)
        damage(d)
        broken[name] = str(d)
    unreadable = tmp / "unreadable"  # (chmod 0 does not stop root: make the file a directory)
    shutil.copytree(model_dirs["a"], unreadable)
    (unreadable / "config.json").unlink()
    (unreadable / "config.json").mkdir()
    broken["unreadable"] = str(unreadable)
    return broken


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _drop_a_tensor(path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    del tensors[next(k for k in sorted(tensors) if "layers.0.mlp" in k)]
    save_file(tensors, path)


async def test_a_weight_update_that_fails_keeps_the_old_weights_and_the_server(nursery, model_dirs, tmp_path):
    broken = broken_copies(model_dirs, tmp_path)
    overrides = serving_a(model_dirs, **{"server.weights_roots": [model_dirs["root"], str(tmp_path)]})
    url, app = await start_server(nursery, "default", **overrides)  # the scheduler in a child process
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        before = (await client.post("/generate", json=GREEDY)).json()["output_ids"]
        for _ in range(2):  # more failures than the restart intensity allows crashes
            for name, path in sorted(broken.items()):
                r = await client.post("/update_weights_from_disk", json={"model_path": path})
                assert r.status_code == 400, (name, r.text)
                assert r.json()["error"]["param"] == "model_path" and path in r.json()["error"]["message"]
        for name in ("wide", "taller"):  # another shape
            r = await client.post("/update_weights_from_disk", json={"model_path": model_dirs[name]})
            assert r.status_code == 400, r.text
        assert "intermediate_size" in r.json()["error"]["message"]
        r = await client.post("/update_weights_from_disk", json={"model_path": str(tmp_path.parent)})
        assert r.status_code == 400 and "outside" in r.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 200
        assert app.state.server.runtime.status.restarts["scheduler"] == 0
        assert (await client.post("/generate", json=GREEDY)).json()["output_ids"] == before


@pytest.mark.slow  # kills the scheduler of a real server
async def test_a_restarted_scheduler_loads_the_weights_that_were_active(nursery, model_dirs):
    import os
    import signal

    url, app = await start_server(nursery, "default", **serving_a(model_dirs))
    runtime = app.state.server.runtime
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        before = (await client.post("/generate", json=GREEDY)).json()["output_ids"]
        r = await client.post("/update_weights_from_disk", json={"model_path": model_dirs["b"]})
        assert r.status_code == 200, r.text
        updated = (await client.post("/generate", json=GREEDY)).json()["output_ids"]
        assert updated != before
        os.kill(runtime.supervisor.child("scheduler").pid, signal.SIGKILL)
        await runtime.status.started("scheduler", 2)
        assert (await client.post("/generate", json=GREEDY)).json()["output_ids"] == updated


async def test_a_drain_that_takes_too_long_is_409_and_the_gates_reopen(nursery, model_dirs):
    url, app = await start_server(nursery, "single-process",
                                  **serving_a(model_dirs, **{"server.weights_drain_timeout": 0.5}))
    tm = app.state.server.runtime.tokenizer_manager
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        before = (await client.post("/generate", json=GREEDY)).json()["output_ids"]
        async with trio.open_nursery() as inner:
            long = {**GREEDY, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}}
            inner.start_soon(partial(client.post, "/generate", json=long))
            while not tm.rid_to_state:
                await trio.sleep(0.001)
            r = await client.post("/update_weights_from_disk", json={"model_path": model_dirs["b"]})
            assert r.status_code == 409 and "still in flight" in r.json()["error"]["message"], r.text
            # the gate is open again: a new request runs beside the long one, on the old weights
            assert (await client.post("/generate", json=GREEDY)).json()["output_ids"] == before
            inner.cancel_scope.cancel()


def _nan_copy(model_dirs, tmp_path):
    """Model a with one projection full of NaN: it loads (every shape right) but no step gives finite logits."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path / "nan"
    shutil.copytree(model_dirs["a"], path)
    weights = next(path.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(k for k in sorted(tensors) if "layers.0.self_attn.o_proj" in k)
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, weights)
    return str(path)


async def test_weights_are_reported_probed_before_commit_and_checked_by_the_scheduler(nursery, model_dirs, tmp_path):
    """Issue 29 N10, N13a, N15: each scheduler reports the weights it serves (path and digest); weights
    that load but fail a one-token step are rolled back (400, no restart, the old ones serve); the
    scheduler refuses a path outside the roots itself (a peer on the wire skips HTTP); a load whose
    answer is lost is asked about again, not reported failed."""
    from actors import CallError
    from serving.managers.messages import UpdateWeightsReq

    nan = _nan_copy(model_dirs, tmp_path)
    overrides = serving_a(model_dirs, **{"server.weights_roots": [model_dirs["root"], str(tmp_path)]})
    url, app = await start_server(nursery, "default", **overrides)  # the scheduler in a child process
    runtime = app.state.server.runtime
    tm = runtime.tokenizer_manager
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        before = (await client.post("/generate", json=GREEDY)).json()["output_ids"]
        first = (await client.get("/server_info")).json()["weights"]
        assert first["path"] == model_dirs["a"] and len(first["digest"]) == 16, first
        with trio.fail_after(60):
            r = await client.post("/update_weights_from_disk", json={"model_path": nan})
        assert r.status_code == 400, r.text
        assert "fail a one-token step" in r.json()["error"]["message"], r.text
        assert (await client.get("/server_info")).json()["weights"] == first
        assert (await client.post("/generate", json=GREEDY)).json()["output_ids"] == before
        # the scheduler checks the roots itself
        answer = await tm.call_scheduler(UpdateWeightsReq("/etc"), timeout=30)
        assert not answer.success and "outside" in answer.message, answer
        # a load whose answer is lost: the front end asks which weights serve, and finds the new ones
        real_call = tm.replicas.call

        async def answer_lost(replica, msg, **kwargs):
            answer = await real_call(replica, msg, **kwargs)
            if isinstance(msg, UpdateWeightsReq):
                raise CallError("no answer within 600 s")
            return answer

        tm.replicas.call = answer_lost
        try:
            r = await client.post("/update_weights_from_disk", json={"model_path": model_dirs["b"]})
        finally:
            tm.replicas.call = real_call
        assert r.status_code == 200 and "confirmed after" in r.json()["message"], r.text
        now = (await client.get("/server_info")).json()["weights"]
        assert now["path"] == model_dirs["b"] and now["digest"] != first["digest"], now
        assert (await client.post("/generate", json=GREEDY)).json()["output_ids"] != before
        with trio.fail_after(10):  # (a probe that went unanswered during the load is seen again at the next)
            while (await client.get("/health")).status_code != 200:
                await trio.sleep(0.1)
        assert runtime.status.restarts["scheduler"] == 0

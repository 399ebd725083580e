"""POST /update_weights_from_disk: in-flight requests finish on the old weights."""

import httpx
import pytest
import trio

from .test_http import start_server


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from models.loading import tiny_config, tiny_model, to_transformers

    dirs = {}
    for name, seed, config in (("a", 0, None), ("b", 3, None), ("wide", 0, tiny_config(hidden_size=128))):
        loaded = tiny_model(config, seed=seed)
        path = tmp_path_factory.mktemp(name)
        to_transformers(loaded).save_pretrained(path)
        loaded.tokenizer.save_pretrained(path)
        dirs[name] = str(path)
    return dirs


GREEDY = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


async def test_weights_swap_after_in_flight_requests_finish(nursery, model_dirs):
    url, app = await start_server(nursery, "single-process", **{"model.path": model_dirs["a"], "model.dtype": "float32"})
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

"""A dense family with sliding-window layers (Gemma 3, from a directory transformers saved) served by
the real server: a kill -9 of the scheduler while requests stream changes no request's text."""

import httpx
import pytest

from ..models.test_families import save_tiny
from .test_http import start_server
from .test_recovery import RECOVERY, assert_clean, assert_drained, requests_for, run_through_kills

pytestmark = pytest.mark.slow  # kills and restarts a real child process


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return save_tiny("gemma3_text", tmp_path_factory.mktemp("gemma3_text"))


def fault_free(directory, bodies):
    """What a fault-free server answers: the runner's greedy output, decoded as the detokenizer does
    (a request's greedy tokens do not depend on its batch: the deterministic mode)."""
    import torch

    from models.loading import load_model
    from models.runner import ModelRunner, generate

    loaded = load_model(directory)
    runner = ModelRunner(loaded, dtype=torch.float32, kv_budget_bytes=32 << 20)
    answers = generate(runner, [body["input_ids"] for body in bodies], bodies[0]["sampling_params"]["max_new_tokens"])
    return {body["rid"]: (loaded.tokenizer.decode(ids, skip_special_tokens=True), ids)
            for body, ids in zip(bodies, answers)}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_kill_9_the_scheduler_of_a_gemma3_model_mid_stream(nursery, gemma3_dir, stream):
    bodies = requests_for(7, n=8)  # prompts of 4-40 tokens and 96 new ones: far past the window of 8
    expected = fault_free(gemma3_dir, bodies)
    url, app = await start_server(nursery, "default", **RECOVERY, **{"model.path": str(gemma3_dir)})
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        kills, rounds = await run_through_kills(app, client, bodies, stream, kills=2)
        info = (await client.get("/server_info")).json()
    assert kills == 2 and info["restarts"]["scheduler"] == kills
    assert all(texts == expected for texts in rounds)
    assert_clean(app)
    assert_drained(info)

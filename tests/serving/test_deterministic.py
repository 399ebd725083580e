"""Deterministic inference through the server: with ``enable_deterministic_inference`` a greedy
request's tokens do not depend on what else runs, on the prefix cache, on the chunked-prefill
size, nor on a crash resume — in bf16, where the default kernels round differently."""

import os
import random
import signal

import httpx
import pytest
import trio

from models.runner import cpu_has_bf16
from serving.runtime.engine import open_engine

from .test_http import start_server
from .test_recovery import run_all, scheduler_pid

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 60))] for _ in range(n)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
async def test_greedy_tokens_do_not_depend_on_the_batch_the_cache_or_chunking(dtype):
    batch = prompts(12, seed=3)
    options = {"dtype": dtype, "enable_deterministic_inference": True}
    async with open_engine("tiny", **options) as engine:
        alone = [(await engine.generate([p], GREEDY))[0]["output_ids"] for p in batch]
        together = [r["output_ids"] for r in await engine.generate(batch, GREEDY)]  # cached prefixes now
        assert together == alone
        shared = [batch[0][:30] + p for p in batch[1:6]]  # a common prefix, computed once, then cached
        shared_alone = [(await engine.generate([p], GREEDY))[0]["output_ids"] for p in shared]
    async with open_engine("tiny", chunked_prefill_size=7, enable_prefix_cache=False, **options) as engine:
        assert [r["output_ids"] for r in await engine.generate(batch, GREEDY)] == alone
        assert [r["output_ids"] for r in await engine.generate(shared, GREEDY)] == shared_alone


@pytest.mark.slow  # loads SmolLM2
@pytest.mark.skipif(not cpu_has_bf16(), reason="no bf16 units: bf16 products run as fp32 sgemm on upcasts and "
                    "round back to bf16, and this tiny model's tokens did not change with the batch (AVX2 EPYC)")
async def test_without_the_mode_bf16_tokens_do_depend_on_the_batch(monkeypatch):
    """The control: the same check with torch's kernels fails, so the one above can (tercet's C++
    attention is batch-invariant by construction, so it is off here)."""
    from models import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    batch = prompts(24, seed=5)
    differ = 0
    for chunk in (1, 7):
        async with open_engine("tiny", dtype="bfloat16", chunked_prefill_size=chunk) as engine:
            alone = [(await engine.generate([p], {**GREEDY, "max_new_tokens": 48}))[0]["output_ids"] for p in batch]
            together = [r["output_ids"] for r in await engine.generate(batch, {**GREEDY, "max_new_tokens": 48})]
        differ += sum(a != b for a, b in zip(alone, together))
    assert differ > 0


SMOL = {"model.path": None, "model.dtype": "bfloat16", "scheduler.enable_deterministic_inference": True,
        "supervision.max_restarts": 20, "supervision.quarantine_after": 1000}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
           "The three primary colours are", "import numpy as np\n", "My favourite book is", "In 1969,",
           "The best way to learn a language is", "SELECT * FROM", "Dear Sir or Madam,", "The mitochondria",
           "To be or not to be,", "A haiku about rain:", "Photosynthesis converts", "The quick brown fox"]


@pytest.mark.slow
async def test_smollm2_bf16_streams_are_identical_run_to_run_and_through_three_kills(nursery):
    url, app = await start_server(nursery, "default", **SMOL)
    bodies = [{"text": p, "rid": f"det-{i}", "sampling_params": {"max_new_tokens": 160, "temperature": 0.0,
                                                                 "ignore_eos": True}} for i, p in enumerate(PROMPTS)]
    tm = app.state.server.runtime.tokenizer_manager
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        first, second, killed = {}, {}, {}
        await run_all(client, bodies, True, first)
        await run_all(client, [{**b, "rid": b["rid"] + "-again"} for b in bodies], True, second)  # cache hits now
        assert {rid.removesuffix("-again"): v for rid, v in second.items()} == first
        total = 160 * len(bodies)
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, [{**b, "rid": b["rid"] + "-k"} for b in bodies], True, killed)
            for kill in (1, 2, 3):
                with trio.fail_after(600):
                    while sum(len(s.output_ids) for s in tm.rid_to_state.values()) < total * kill // 4:
                        await trio.sleep(0.01)
                await app.state.server.runtime.status.started("scheduler", kill)
                os.kill(scheduler_pid(app), signal.SIGKILL)
        info = (await client.get("/server_info")).json()
    assert info["restarts"]["scheduler"] == 3
    assert {rid.removesuffix("-k"): v for rid, v in killed.items()} == first  # 16 of 16, none failed

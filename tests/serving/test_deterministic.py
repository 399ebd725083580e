"""Deterministic inference through the server, the default: a greedy request's tokens and
logprobs do not depend on what else runs, on the prefix cache, on the chunked-prefill size, nor
on a crash resume -- and with ``--disable-deterministic-inference`` they do (the control)."""

import os
import random
import signal

import httpx
import pytest
import trio

from models.runner import cpu_has_bf16
from serving.managers.messages import ServerInfoReq
from serving.runtime.engine import open_engine

from .test_http import start_server
from .test_recovery import run_all, scheduler_pid

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
DTYPES = ["bfloat16", "float32"]


def prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 60))] for _ in range(n)]


def tokens_and_logprobs(results):
    return [(r["output_ids"], r["logprobs"]) for r in results]


async def runs(batch, shared, **options):
    """Each prompt alone, then the batch together (cached prefixes by then), then prompts with a
    common prefix, alone; then the same on a server with chunks of 7 tokens and no prefix cache."""
    async with open_engine("tiny", **options) as engine:
        info = engine.runtime.tokenizer_manager
        alone = [tokens_and_logprobs(await engine.generate([p], GREEDY, return_logprob=True))[0] for p in batch]
        together = tokens_and_logprobs(await engine.generate(batch, GREEDY, return_logprob=True))
        shared_alone = [tokens_and_logprobs(await engine.generate([p], GREEDY, return_logprob=True))[0]
                        for p in shared]
        scheduler = await info.call_scheduler(ServerInfoReq(), timeout=10.0)
    async with open_engine("tiny", chunked_prefill_size=7, enable_prefix_cache=False, **options) as engine:
        chunked = tokens_and_logprobs(await engine.generate(batch, GREEDY, return_logprob=True))
        shared_chunked = tokens_and_logprobs(await engine.generate(shared, GREEDY, return_logprob=True))
    return scheduler, (alone, together, chunked), (shared_alone, shared_chunked)


@pytest.mark.parametrize("dtype", DTYPES)
async def test_by_default_greedy_tokens_do_not_depend_on_the_batch_the_cache_or_chunking(dtype):
    batch = prompts(12, seed=3)
    shared = [batch[0][:30] + p for p in batch[1:6]]  # a common prefix, computed once, then cached
    info, (alone, together, chunked), (shared_alone, shared_chunked) = await runs(batch, shared, dtype=dtype)
    assert info.deterministic_inference is True  # no option given: the default
    assert info.invariance["attention"] == "tercet's C++ kernel, every row"  # the kernels build here
    assert together == alone
    assert chunked == alone
    assert shared_chunked == shared_alone


# bf16 without bf16 units multiplies through tercet's fp32 kernel, invariant in either mode, and its bf16 roundings
# hid attention's differences here (models/test_determinism.py's control takes F.linear on the upcasts instead)
UPCAST_HOLDS = pytest.mark.skipif(not cpu_has_bf16(), reason="bf16 on a CPU without bf16 units goes through the "
                                  "fp32 kernel, which held the properties outside the mode too")


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=UPCAST_HOLDS) if d == "bfloat16" else d for d in DTYPES])
async def test_without_the_mode_logprobs_do_depend_on_the_batch_or_the_chunking(dtype):
    """The control: the same runs with the mode off differ somewhere (prefill rows attend through
    SDPA there, decode rows through the kernel, and oneDNN multiplies one row by another kernel), so
    the test above can fail."""
    batch = prompts(12, seed=3)
    shared = [batch[0][:30] + p for p in batch[1:6]]
    info, (alone, together, chunked), (shared_alone, shared_chunked) = await runs(
        batch, shared, dtype=dtype, enable_deterministic_inference=False)
    assert info.deterministic_inference is False and info.invariance is None
    assert together != alone or chunked != alone or shared_chunked != shared_alone


SMOL = {"model.path": None, "supervision.max_restarts": 20}  # the default serve, quarantine included
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
           "The three primary colours are", "import numpy as np\n", "My favourite book is", "In 1969,",
           "The best way to learn a language is", "SELECT * FROM", "Dear Sir or Madam,", "The mitochondria",
           "To be or not to be,", "A haiku about rain:", "Photosynthesis converts", "The quick brown fox"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
async def test_smollm2_streams_are_identical_run_to_run_and_through_three_kills(nursery, dtype):
    """16 greedy streams x 160 tokens through the default topology and settings (deterministic
    inference on, poison quarantine at its default): run twice, identical; then three SIGKILLs
    of the scheduler in flight: 16 of 16 identical, none failed."""
    url, app = await start_server(nursery, "default", **SMOL, **{"model.dtype": dtype})
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


@pytest.mark.slow
async def test_the_int8_mode_keeps_its_streams_through_a_kill_and_says_it_serves(nursery):
    """`--activations int8` on the embedded Q4_1 GGUF: every projection multiplies int8 activations (the server
    says so), greedy streams are identical run to run and through a SIGKILL of the scheduler in flight, since
    the int8 kernel is batch-invariant too; and its text is not the exact mode's (another arithmetic)."""
    url, app = await start_server(nursery, "default", **SMOL, **{"model.activations": "int8"})
    bodies = [{"text": p, "rid": f"i8-{i}", "sampling_params": {"max_new_tokens": 64, "temperature": 0.0,
                                                                "ignore_eos": True}} for i, p in enumerate(PROMPTS[:8])]
    tm = app.state.server.runtime.tokenizer_manager
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        info = (await client.get("/server_info")).json()
        assert info["scheduler"]["activations"] == "int8"
        assert info["invariance"]["projections"] == {"tercet's int8 kernel": 121}  # SmolLM2: 30 x 4 and the head
        first, killed = {}, {}
        await run_all(client, bodies, True, first)
        async with trio.open_nursery() as inner:
            inner.start_soon(run_all, client, [{**b, "rid": b["rid"] + "-k"} for b in bodies], True, killed)
            with trio.fail_after(600):
                while sum(len(s.output_ids) for s in tm.rid_to_state.values()) < 64 * len(bodies) // 2:
                    await trio.sleep(0.01)
            await app.state.server.runtime.status.started("scheduler", 1)
            os.kill(scheduler_pid(app), signal.SIGKILL)
        info = (await client.get("/server_info")).json()
    assert info["restarts"]["scheduler"] == 1
    assert {rid.removesuffix("-k"): v for rid, v in killed.items()} == first  # 8 of 8, none failed
    async with open_engine(None) as engine:  # the exact mode on the same prompts: other tokens somewhere
        exact = await engine.generate([p for p in PROMPTS[:8]], {**GREEDY, "max_new_tokens": 64})
    assert [r["text"] for r in exact] != [first[f"i8-{i}"][0] for i in range(8)]


async def test_the_int8_mode_on_a_model_without_block_codes_fails_the_start_naming_the_setting():
    refused = pytest.RaisesExc(Exception, match="model.activations: int8: .*Q4_1 or Q8_0 block codes")
    with pytest.RaisesGroup(refused, flatten_subgroups=True):
        async with open_engine("tiny", activations="int8"):
            pass

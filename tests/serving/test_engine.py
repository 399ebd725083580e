"""The three managers together, in one process (inproc) and in three (ipc)."""

import random

import pytest
import trio

from models.runner import ModelRunner, generate
from serving.runtime.engine import Engine, open_engine
from serving.managers.messages import FlushCacheReq, SamplingParams, ServerInfoReq
from serving.managers.tokenizer_manager import DuplicateRequestError, GenerateInput, InvalidRequest, fold

GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def random_prompts(n, seed=0, lengths=(4, 40)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_runner(tiny_loaded):
    import torch

    return ModelRunner(tiny_loaded, dtype=torch.bfloat16)


@pytest.mark.parametrize("processes", [False, True], ids=["inproc", "ipc"])
async def test_greedy_output_equals_the_runner(tiny_runner, processes):
    prompts = random_prompts(5)
    expected = [generate(tiny_runner, [p], 12)[0] for p in prompts]
    async with open_engine("tiny", processes=processes) as engine:
        results = await engine.generate(prompts, GREEDY)
    assert [r["output_ids"] for r in results] == expected
    assert all(r["finished"].type == "length" for r in results)
    assert [r["prompt_tokens"] for r in results] == [len(p) for p in prompts]


async def test_streaming_concatenation_equals_the_whole_text():
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    async with open_engine("tiny") as engine:
        whole = await engine.generate(["Bonjour 你好 👍"] * 3, sampling)
        pieces: dict[int, list[str]] = {}
        obj = GenerateInput(text=["Bonjour 你好 👍"] * 3, sampling_params=sampling, stream=True)
        async for chunk in engine.stream(obj):
            pieces.setdefault(chunk.index, []).append(chunk.text)
            assert "\ufffd" not in chunk.text
    assert ["".join(pieces[i]) for i in range(3)] == [r["text"] for r in whole]


async def test_n_samples_and_batches_return_every_output():
    async with open_engine("tiny") as engine:
        results = await engine.generate(["a", "b"], {"max_new_tokens": 4, "n": 3, "temperature": 0.7, "seed": 1})
        assert len(results) == 6 and all(len(r["output_ids"]) <= 4 for r in results)
        again = await engine.generate(["a", "b"], {"max_new_tokens": 4, "n": 3, "temperature": 0.7, "seed": 1})
        assert [r["output_ids"] for r in again] == [r["output_ids"] for r in results]


async def test_duplicate_and_invalid_requests_are_refused():
    async with open_engine("tiny") as engine:
        tm = engine.tokenizer_manager
        with pytest.raises(DuplicateRequestError):
            async for _ in tm.generate(GenerateInput(text=["x", "y"], rid=["same", "same"])):
                pass
        with pytest.raises(InvalidRequest, match="temperature"):
            async for _ in tm.generate(GenerateInput(text="x", sampling_params=SamplingParams(temperature=-1))):
                pass
        with pytest.raises(InvalidRequest, match="exactly one"):
            async for _ in tm.generate(GenerateInput()):
                pass
        assert tm.rid_to_state == {}


async def test_stop_string_is_trimmed(tiny_runner):
    prompt = random_prompts(1, seed=3)[0]
    async with open_engine("tiny") as engine:
        full = (await engine.generate([prompt], GREEDY))[0]
        text = full["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        cut = await engine.generate([prompt], {**GREEDY, "stop": [stop]})
    assert cut[0]["text"] == text[: text.index(stop)]
    assert cut[0]["finished"].type == "stop" and cut[0]["finished"].matched == stop


async def test_prefix_cache_hit_reports_cached_tokens_and_same_output():
    prompt = random_prompts(1, seed=4, lengths=(40, 40))[0]
    async with open_engine("tiny") as engine:
        first = await engine.generate([prompt], GREEDY)
        second = await engine.generate([prompt], GREEDY)
    assert first[0]["cached_tokens"] == 0
    assert second[0]["cached_tokens"] > 0
    assert second[0]["output_ids"] == first[0]["output_ids"]


async def test_retract_under_small_kv_budget_completes_everything(tiny_loaded):
    # fp32: a retracted request recomputes its tokens as a prefill, and bf16's
    # different summation order would flip near-ties of the random tiny model
    import torch

    prompts = random_prompts(8, seed=5, lengths=(20, 30))
    runner = ModelRunner(tiny_loaded, dtype=torch.float32)
    expected = [generate(runner, [p], 24)[0] for p in prompts]
    async with open_engine("tiny", dtype="float32", kv_budget_bytes=150 * 512) as engine:
        results = await engine.generate(prompts, {**GREEDY, "max_new_tokens": 24})
        info = await engine.tokenizer_manager.call_scheduler(ServerInfoReq())
    assert [r["output_ids"] for r in results] == expected
    assert info["retracted"] > 0


async def test_many_requests_with_random_aborts_leave_nothing_behind():
    rng = random.Random(9)
    async with open_engine("tiny", max_running_requests=32) as engine:
        tm = engine.tokenizer_manager

        async def one(i):
            obj = GenerateInput(input_ids=random_prompts(1, seed=i, lengths=(2, 12))[0],
                                sampling_params=SamplingParams(max_new_tokens=rng.randint(1, 6), temperature=0.0),
                                rid=f"r{i}", stream=True)
            with trio.move_on_after(rng.choice([0.0, 0.001, 0.01, 10.0])):
                async for _ in tm.generate(obj):
                    pass
            if rng.random() < 0.1:
                await tm.abort(f"r{i}")

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, i)
                if i % 50 == 0:
                    await trio.sleep(0)
        assert tm.rid_to_state == {}
        for _ in range(100):  # aborts travel on; wait for the scheduler to settle
            info = await tm.call_scheduler(ServerInfoReq())
            if info["running"] == 0 and info["waiting"] == 0:
                break
            await trio.sleep(0.05)
        assert info["running"] == info["waiting"] == 0
        assert await tm.call_scheduler(FlushCacheReq())
        info = await tm.call_scheduler(ServerInfoReq())
        assert info["kv_pages_free"] == info["kv_pages_total"]
        detok = engine.runtime.supervisor.child("detokenizer").actor
        assert detok.states == {}


def test_sync_engine():
    with Engine("tiny") as engine:
        out = engine.generate(["hello"], GREEDY)
    assert len(out[0]["output_ids"]) == 12
    assert fold  # the folding helper is public

"""The three managers together, in one process (inproc) and in three (ipc)."""

import math
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
    return ModelRunner(tiny_loaded)  # the engine's default dtype (auto)


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
        chunks: dict[int, list] = {}
        obj = GenerateInput(text=["Bonjour 你好 👍"] * 3, sampling_params=sampling, stream=True)
        async for chunk in engine.stream(obj):
            chunks.setdefault(chunk.index, []).append(chunk)
            assert "\ufffd" not in chunk.text
    assert ["".join(c.text for c in chunks[i]) for i in range(3)] == [r["text"] for r in whole]
    assert all(len(chunks[i]) > 1 for i in range(3))  # really streamed
    # fold makes of the streamed chunks what the non-streamed call returned
    folded = [fold(chunks[i]) for i in range(3)]
    mine = {"rid": None, "cached_tokens": None}  # the streamed run hit the prefix cache the first one filled
    assert [{**f, **mine} for f in folded] == [{**r, **mine} for r in whole]
    assert [len(f["output_ids"]) for f in folded] == [40] * 3


async def test_n_samples_and_batches_return_every_output():
    """n samples of a prompt are n draws (seeds seed, seed+1, ...): they differ at temperature
    > 0, each prompt's samples equal those of the prompt sent alone, and the same seed gives the
    same samples again. (float32: a sample near a tie must not flip with the batch's rounding.)"""
    params = {"max_new_tokens": 4, "n": 3, "temperature": 0.7, "seed": 1, "ignore_eos": True}
    async with open_engine("tiny", dtype="float32") as engine:
        results = await engine.generate(["a", "b"], params)
        samples = [r["output_ids"] for r in results]
        assert len(samples) == 6 and all(len(ids) == 4 for ids in samples)
        assert len({tuple(ids) for ids in samples[:3]}) == 3 and len({tuple(ids) for ids in samples[3:]}) == 3
        alone = [r["output_ids"] for prompt in ("a", "b") for r in await engine.generate([prompt], params)]
        assert samples == alone
        again = await engine.generate(["a", "b"], params)
        assert [r["output_ids"] for r in again] == samples
        greedy = await engine.generate(["a"], {**params, "temperature": 0.0})
        assert len({tuple(r["output_ids"]) for r in greedy}) == 1  # greedy: n times the same answer


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
    assert info.retracted > 0


LIVE = {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True}  # far longer than any check


async def wait_until_idle(engine):
    """Until neither the scheduler nor the detokenizer holds a request (aborts travel on after
    their callers ended); the scheduler's info."""
    detokenizer = engine.runtime.supervisor.child("detokenizer").actor
    with trio.fail_after(30):
        while (info := await engine.tokenizer_manager.call_scheduler(ServerInfoReq())).running \
                or info.waiting or detokenizer.states:
            await trio.sleep(0.01)
    return info


async def test_aborting_a_live_request_ends_it_everywhere():
    async with open_engine("tiny") as engine:
        tm = engine.tokenizer_manager
        obj = GenerateInput(input_ids=[5, 6, 7], rid="live", stream=True, sampling_params=SamplingParams(**LIVE))
        chunks = []
        with trio.fail_after(60):
            async for chunk in tm.generate(obj):
                chunks.append(chunk)
                if len(chunks) == 3:  # it streams: abort it on its own tokenizer manager
                    assert await tm.abort("live") is True
        assert chunks[-1].finished.type == "abort" and chunks[-1].finished.message == "aborted by request"
        assert 0 < sum(len(c.token_ids) for c in chunks) < LIVE["max_new_tokens"]
        assert await tm.abort("live") is False  # ended: nothing left to abort
        info = await wait_until_idle(engine)
        assert info.aborted == 1  # the scheduler ended it (it did not run out its tokens)
        assert tm.rid_to_state == {}


async def test_many_requests_with_random_aborts_leave_nothing_behind():
    """400 streams: a tenth aborted by rid while they stream (they end with finish reason abort),
    some left by their caller at a random moment; every other one ends with all its tokens.
    Afterwards the tokenizer manager, the scheduler, the KV pool and the detokenizer hold nothing."""
    rng = random.Random(9)
    ends, aborted = {}, set()
    async with open_engine("tiny", max_running_requests=32) as engine:
        tm = engine.tokenizer_manager

        async def one(i):
            victim = rng.random() < 0.1
            leave = not victim and rng.random() < 0.2
            sampling = LIVE if victim else {"max_new_tokens": rng.randint(1, 6), "temperature": 0.0,
                                            "ignore_eos": True}
            obj = GenerateInput(input_ids=random_prompts(1, seed=i, lengths=(2, 12))[0],
                                sampling_params=SamplingParams(**sampling), rid=f"r{i}", stream=True)
            ids = []
            with trio.move_on_after(rng.choice([0.0, 0.001, 0.01]) if leave else math.inf):
                async for chunk in tm.generate(obj):
                    ids += chunk.token_ids
                    if victim and ids and f"r{i}" not in aborted:  # live: it has streamed
                        aborted.add(f"r{i}")
                        assert await tm.abort(f"r{i}") is True
                    if chunk.finished is not None:
                        ends[f"r{i}"] = (chunk.finished.type, len(ids), sampling["max_new_tokens"])

        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                for i in range(400):
                    nursery.start_soon(one, i)
                    if i % 50 == 0:
                        await trio.sleep(0)
        assert tm.rid_to_state == {}
        assert len(aborted) > 20
        assert all(ends[rid][0] == "abort" and ends[rid][1] < LIVE["max_new_tokens"] for rid in aborted)
        finished = [end for rid, end in ends.items() if rid not in aborted]
        assert len(finished) > 200
        assert all(kind == "length" and n == wanted for kind, n, wanted in finished)
        info = await wait_until_idle(engine)
        assert info.aborted >= len(aborted)
        assert await tm.call_scheduler(FlushCacheReq())
        info = await tm.call_scheduler(ServerInfoReq())
        assert info.kv_pages_free == info.kv_pages_total


def test_sync_engine():
    from serving.managers import tokenizer_manager

    with Engine("tiny") as engine:
        out = engine.generate(["hello"], GREEDY)
    assert len(out[0]["output_ids"]) == 12
    assert "fold" in tokenizer_manager.__all__  # the folding helper is public (its result: see the streaming test)

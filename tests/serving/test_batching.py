"""The scheduler's batching state driven directly with the tiny model (no actors)."""

import random

import numpy as np
import pytest
import torch

from models.runner import ModelRunner, generate
from serving.managers.batching import READ_AHEAD_TOKENS, BatchState, Limits
from serving.managers.messages import FinishReason, GenerateReq, SamplingParams
from serving.managers.radix_cache import RadixCache

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def make_runner(loaded, budget_tokens=None):
    budget = 256 * 1024 * 1024 if budget_tokens is None else budget_tokens * 2 * 2 * 2 * 16 * 4
    return ModelRunner(loaded, dtype=torch.float32, kv_budget_bytes=budget)


def make_state(runner, cache=True, **limits):
    radix = RadixCache(runner.kv.free, page_size=runner.kv.page_size) if cache else None
    return BatchState(runner.kv, radix, runner.eos_token_ids, Limits(**limits))


def req(rid, ids, sampling=GREEDY):
    return GenerateReq(rid, np.asarray(ids, dtype=np.int32), sampling)


def drain(state, runner, outputs=None, max_steps=10_000):
    outputs = {} if outputs is None else outputs
    for _ in range(max_steps):
        if state.idle:
            return outputs
        batch = state.schedule()
        assert batch, "requests wait but nothing can run"
        for out in state.postprocess(batch, runner.step(batch.seqs)):
            entry = outputs.setdefault(out.req.rid, {"ids": [], "finished": None})
            entry["ids"] += out.new_ids
            entry["finished"] = out.req.finished
            entry["cached"] = out.req.cached_tokens
    raise AssertionError("did not finish")


def prompts(n, seed=0, lengths=(3, 40)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(*lengths))] for _ in range(n)]


@pytest.fixture(scope="module")
def runner(tiny_loaded):
    return make_runner(tiny_loaded)


def reference(runner, prompt, n=8):
    return generate(runner, [prompt], n)[0]


def assert_pool_clean(state):
    if state.cache is not None:
        state.cache.reset()
    assert state.kv.num_free == state.kv.num_pages


def test_continuous_batching_matches_one_by_one_greedy(runner):
    ps = prompts(6)
    state = make_state(runner, chunked_prefill_size=16)
    for i in range(3):
        assert state.add(req(f"r{i}", ps[i])) is None
    outputs = {}
    for _ in range(2):
        batch = state.schedule()
        for out in state.postprocess(batch, runner.step(batch.seqs)):
            outputs.setdefault(out.req.rid, {"ids": [], "finished": None})["ids"] += out.new_ids
    for i in range(3, 6):
        state.add(req(f"r{i}", ps[i]))
    drain(state, runner, outputs)
    for i, p in enumerate(ps):
        assert outputs[f"r{i}"]["ids"] == reference(runner, p), i
    assert_pool_clean(state)


def test_retract_under_a_small_kv_budget_keeps_outputs(tiny_loaded):
    small = make_runner(tiny_loaded, budget_tokens=120)
    ps = prompts(6, seed=1, lengths=(20, 30))
    state = make_state(small, chunked_prefill_size=64)
    for i, p in enumerate(ps):
        state.add(req(f"r{i}", p, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)))
    outputs = drain(state, small)
    assert state.retracted > 0
    big = make_runner(tiny_loaded)
    for i, p in enumerate(ps):
        assert outputs[f"r{i}"]["ids"] == reference(big, p, 16)
        assert outputs[f"r{i}"]["finished"] == FinishReason("length", matched=16)
    assert_pool_clean(state)


def test_shared_prefix_is_cached_and_output_unchanged(runner):
    base = prompts(1, seed=2, lengths=(30, 30))[0]
    state = make_state(runner)
    state.add(req("a", base))
    drain(state, runner)
    state.add(req("b", base[:25] + [7, 8, 9]))
    out = drain(state, runner)
    assert out["b"]["cached"] == 25
    assert out["b"]["ids"] == reference(runner, base[:25] + [7, 8, 9])
    assert_pool_clean(state)


def test_without_cache_nothing_is_cached(runner):
    base = prompts(1, seed=2, lengths=(30, 30))[0]
    state = make_state(runner, cache=False)
    state.add(req("a", base))
    drain(state, runner)
    state.add(req("b", base))
    assert drain(state, runner)["b"]["cached"] == 0
    assert_pool_clean(state)


def test_abort_waiting_and_running_frees_every_page(runner):
    ps = prompts(4, seed=3)
    state = make_state(runner, max_running_requests=2)
    for i, p in enumerate(ps):
        state.add(req(f"r{i}", p, SamplingParams(max_new_tokens=50, temperature=0.0, ignore_eos=True)))
    batch = state.schedule()
    state.postprocess(batch, runner.step(batch.seqs))
    assert len(state.running) == 2 and len(state.waiting) == 2
    reason = FinishReason("abort", message="bye")
    for rid in ("r0", "r3"):  # one running, one waiting
        assert state.abort(rid, reason).req.finished == reason
    assert state.abort("nope", reason) is None
    drain(state, runner)
    assert_pool_clean(state)


def test_stop_conditions(runner):
    p = prompts(1, seed=4)[0]
    ref = reference(runner, p, 8)
    state = make_state(runner)
    stops = [ref[0], ref[3]]  # the first would end the answer at once
    state.add(req("tok", p, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[ref[3]])))
    state.add(req("len", p, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)))
    state.add(req("early", p, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=stops)))
    state.add(req("min", p, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=stops,
                                            min_new_tokens=4)))
    out = drain(state, runner)
    first = ref.index(ref[3])
    assert out["tok"]["ids"] == ref[: first + 1]
    assert out["tok"]["finished"] == FinishReason("stop", matched=ref[3])
    assert out["len"]["ids"] == ref[:5] and out["len"]["finished"].type == "length"
    assert out["early"]["ids"] == ref[:1] and out["early"]["finished"] == FinishReason("stop", matched=ref[0])
    # min_new_tokens: no stop before the 4th token (the stop token it generated first is kept, as
    # generated: not masked), and the stop that is due comes right at the 4th
    assert out["min"]["ids"] == ref[:4] and out["min"]["finished"] == FinishReason("stop", matched=ref[3])
    assert_pool_clean(state)


def test_eos_and_min_new_tokens(runner):
    """An eos set the greedy answer meets at its 2nd and 4th tokens: the eos ends it at the 2nd;
    with min_new_tokens=4 right at the 4th; with ignore_eos it runs to its length."""
    p = prompts(1, seed=4)[0]
    ref = reference(runner, p, 8)
    assert ref[0] not in {ref[1], ref[3]}  # (the tiny model's greedy answer to this prompt)
    radix = RadixCache(runner.kv.free, page_size=runner.kv.page_size)
    state = BatchState(runner.kv, radix, frozenset({ref[1], ref[3]}), Limits())
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    state.add(req("eos", p, SamplingParams(**greedy)))
    state.add(req("min", p, SamplingParams(**greedy, min_new_tokens=4)))
    state.add(req("ignored", p, SamplingParams(**greedy, min_new_tokens=4, ignore_eos=True)))
    out = drain(state, runner)
    assert out["eos"]["ids"] == ref[:2] and out["eos"]["finished"] == FinishReason("stop", matched=ref[1])
    assert out["min"]["ids"] == ref[:4] and out["min"]["finished"] == FinishReason("stop", matched=ref[3])
    assert out["ignored"]["ids"] == ref and out["ignored"]["finished"] == FinishReason("length", matched=8)
    assert_pool_clean(state)


def test_limits_reject_with_clear_reasons(runner):
    state = make_state(runner, max_queued_requests=2, max_context_len=64)
    state.add(req("a", [5] * 10))
    state.add(req("b", [5] * 10))
    overload = state.add(req("c", [5] * 10))
    assert overload.req.finished.status_code == 503 and "overloaded" in overload.req.finished.message
    too_long = state.add(req("d", [5] * 100))
    assert too_long.req.finished.status_code == 400 and "100 tokens" in too_long.req.finished.message
    empty = state.add(req("e", []))
    assert empty.req.finished.status_code == 400


def test_resumes_are_never_refused_by_the_queue_bound(runner):
    # issue 29 N4: a migrated request names no ``replaces`` (it ran on another replica)
    state = make_state(runner, max_queued_requests=1, max_context_len=64)
    assert state.add(req("a", [5] * 10)) is None
    assert state.add(GenerateReq("m#0.1", np.asarray([5] * 10, dtype=np.int32), GREEDY, resume=True)) is None
    assert state.add(GenerateReq("n#0.1", np.asarray([5] * 12, dtype=np.int32), GREEDY, num_prior_output=2)) is None
    overload = state.add(req("c", [5] * 10))
    assert overload.req.finished.status_code == 503
    assert [r.rid for r in state.waiting] == ["a", "m#0.1", "n#0.1"]


def test_max_running_requests_is_respected(runner):
    state = make_state(runner, max_running_requests=3)
    for i, p in enumerate(prompts(8, seed=5)):
        state.add(req(f"r{i}", p))
    while not state.idle:
        batch = state.schedule()
        assert len(state.running) <= 3
        state.postprocess(batch, runner.step(batch.seqs))


def test_resume_continues_where_it_stopped(runner):
    p = prompts(1, seed=6)[0]
    ref = reference(runner, p, 12)
    state = make_state(runner)
    resumed = GenerateReq("r", np.asarray(p + ref[:5], dtype=np.int32),
                          SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True), num_prior_output=5)
    state.add(resumed)
    out = drain(state, runner)
    assert out["r"]["ids"] == ref[5:]


def test_seeded_sampling_resumes_identically(runner):
    p = prompts(1, seed=7)[0]
    sampling = SamplingParams(max_new_tokens=12, temperature=0.8, seed=1234, ignore_eos=True)
    state = make_state(runner, cache=False)
    state.add(req("full", p, sampling))
    full = drain(state, runner)["full"]["ids"]
    state.add(GenerateReq("part", np.asarray(p + full[:4], dtype=np.int32), sampling, num_prior_output=4))
    assert drain(state, runner)["part"]["ids"] == full[4:]


@pytest.mark.parametrize("interval", [2, 3])
def test_stream_interval_sends_the_first_token_then_every_nth_and_the_last(runner, interval):
    """11 tokens with interval 3: sent after tokens 1, 3, 6, 9 and 11 (the end): every token once,
    in order, the same as interval 1; the logprobs travel with their tokens."""
    p = prompts(1, seed=9)[0]
    ref = reference(runner, p, 11)
    free = runner.kv.num_free
    state = make_state(runner, stream_interval=interval)
    state.add(req("r", p, SamplingParams(max_new_tokens=11, temperature=0.0, ignore_eos=True)))
    sizes, ids, logprobs = [], [], []
    while not state.idle:
        batch = state.schedule()
        for out in state.postprocess(batch, runner.step(batch.seqs)):
            sizes.append(len(out.new_ids))
            ids += out.new_ids
            logprobs += out.logprobs
    assert ids == ref
    sent_after = sorted({1, 11} | set(range(interval, 12, interval)))  # interval 3: 1, 3, 6, 9, 11
    assert sizes == [b - a for a, b in zip([0, *sent_after], sent_after)], sizes
    state.cache.reset()
    assert runner.kv.num_free == free


def test_decoding_requests_keep_their_pages_side_by_side(runner):
    """Each step adds one token to every running request; taken one page at a time they would
    interleave (request a's page, then b's, ...). Pages are taken ahead, in runs, and never
    past a request's last token."""
    state = make_state(runner, cache=False)
    free = runner.kv.num_free
    new = 3 * READ_AHEAD_TOKENS
    sampling = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(4, seed=5)):
        state.add(req(f"r{i}", p, sampling))
    seen = {}
    while not state.idle:
        batch = state.schedule()
        for r in batch.reqs:
            assert len(r.pages) <= len(r.tokens) + new  # never more than its last token needs
            seen[r.rid] = list(r.pages)
        state.postprocess(batch, runner.step(batch.seqs))
    for rid, pages in seen.items():
        runs = 1 + int(np.count_nonzero(np.diff(pages) != 1))
        assert runs <= 4, (rid, runs)  # the prompt's run + one per READ_AHEAD_TOKENS, at most
    assert runner.kv.num_free == free  # what was taken ahead came back


def test_a_tight_pool_takes_no_pages_ahead(runner, tiny_loaded):
    """Taking ahead only ever uses spare room: a pool just big enough still runs every request."""
    ps = prompts(3, seed=6, lengths=(10, 10))
    small = make_runner(tiny_loaded, budget_tokens=3 * (10 + 8))
    state = make_state(small, cache=False)
    for i, p in enumerate(ps):
        state.add(req(f"t{i}", p))
    out = drain(state, small)
    assert state.retracted == 0
    for i, p in enumerate(ps):
        assert out[f"t{i}"]["ids"] == reference(small, p)
    assert_pool_clean(state)

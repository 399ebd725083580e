"""The deterministic mode: a sequence's logits do not depend on how it was run.

For a target sequence, the fp32 logits after every one of its tokens (hence
greedy ids and logprobs) are bitwise equal, in bf16 and fp32, when it runs
(a) alone or beside 1, 7 or 63 random sequences (decode and prefill rows
mixed in each step), (b) after a prefix taken from the cache, (c) with
chunked prefill of 1, 7, 64 or all tokens, (d) decoded token by token or
re-prefilled over prompt + generated tokens after any number of tokens.
Seeded random cases (hypothesis is not installed here).
"""

import random

import pytest
import torch

from models.loading import to_transformers
from models import runner as runner_module
from models.runner import ModelRunner, SeqInput, generate
from models.sampling import GREEDY, SamplingParams

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
DETERMINISTIC = True  # flip to False to see the properties fail on the fast path


def make_runner(model, dtype, page_size=1, kv_budget_bytes=8 << 20):
    return ModelRunner(model, dtype=dtype, page_size=page_size, kv_budget_bytes=kv_budget_bytes,
                       deterministic=DETERMINISTIC)


def random_ids(rnd, n):
    return [rnd.randrange(3, 49000) for _ in range(n)]


def company(runner, rnd, size):
    """`size` random sequences for one step: decode rows and prefill chunks, some after a
    'cached' prefix (its K/V whatever the pages hold), each with fresh pages."""
    seqs = []
    for _ in range(size):
        new = rnd.choice([1, 1, 1, 3, 9, 17])
        cached = rnd.choice([0, rnd.randrange(1, 90)])
        pages = runner.kv.allocate(runner.kv.pages_for(cached + new))
        seqs.append(SeqInput(random_ids(rnd, new), pages, cached))
    return seqs


def run(runner, prompt, steps, *, pages=None, cached=0, chunk=None, others=0, rnd=None, params=GREEDY):
    """Prefill prompt[cached:] (in chunks of `chunk`), then decode `steps - 1` tokens (greedy
    unless `params` say otherwise); each step beside `others` random sequences (the target at
    a random place).

    Returns the logits after every token from prompt[cached] on, the sampled ids and logprobs
    (with the top logprobs, when asked for).
    """
    own = pages is None
    if own:
        pages = runner.kv.allocate(runner.kv.pages_for(len(prompt) + steps))
    logits, ids, logprobs = [], [], []
    while len(ids) < steps:
        if cached < len(prompt):
            new = prompt[cached : cached + (chunk or len(prompt))]
        else:
            new = [ids[-1]]
        last = cached + len(new) >= len(prompt)
        target = SeqInput(new, pages, cached, last, params, prompt, list(ids))
        extra = company(runner, rnd, others) if others else []
        at = rnd.randrange(len(extra) + 1) if others else 0
        batch = [*extra[:at], target, *extra[at:]]
        logits.append(runner.logits(batch, [at])[0])
        out = runner.step(batch)  # the same step again: same K/V, and the sampler's view
        if last:
            ids.append(out.token_ids[at])
            logprobs.append((out.logprobs[at], out.top_logprobs[at]) if params.top_logprobs else out.logprobs[at])
        cached += len(new)
        for s in extra:
            runner.kv.free(s.page_table)
    if own:
        runner.kv.free(pages)
    return torch.cat(logits), ids, logprobs


def assert_same(got, want):
    logits, ids, logprobs = got
    ref_logits, ref_ids, ref_logprobs = want
    assert ids == ref_ids
    assert logprobs == ref_logprobs
    assert logits.shape == ref_logits.shape
    differ = (logits != ref_logits).any(dim=-1).nonzero().flatten().tolist()
    assert not differ, f"logits differ at rows {differ} by {(logits - ref_logits).abs().max().item():.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("others", [1, 7, 63])
def test_a_batch_around_a_sequence_does_not_change_it(tiny_llama, dtype, others):
    runner = make_runner(tiny_llama, dtype)
    rnd = random.Random(others)
    prompt = random_ids(rnd, 21)
    alone = run(runner, prompt, 5)
    assert_same(run(runner, prompt, 5, others=others, rnd=rnd), alone)
    assert runner.kv.num_free == runner.kv.num_pages


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_b_a_cached_prefix_gives_what_computing_it_gives(tiny_llama, dtype, page_size):
    runner = make_runner(tiny_llama, dtype, page_size)
    rnd = random.Random(page_size)
    shared = 32
    prompt = random_ids(rnd, 43)
    computed = run(runner, prompt, 4)
    donor = prompt[:shared] + random_ids(rnd, 9)  # another request filled the prefix pages
    donor_pages = runner.kv.allocate(runner.kv.pages_for(len(donor) + 1))
    runner.step([SeqInput(donor, donor_pages)])
    own = runner.kv.allocate(runner.kv.pages_for(len(prompt) + 4) - shared // page_size)
    pages = donor_pages[: shared // page_size] + own
    cached = run(runner, prompt, 4, pages=pages, cached=shared, others=3, rnd=rnd)
    logits, ids, logprobs = computed
    assert_same(cached, (logits[shared:], ids, logprobs))
    runner.kv.free(donor_pages)
    runner.kv.free(own)


@pytest.mark.parametrize("dtype", DTYPES)
def test_c_chunked_prefill_gives_what_one_prefill_gives(tiny_llama, dtype):
    runner = make_runner(tiny_llama, dtype)
    prompt = random_ids(random.Random(3), 70)
    whole = run(runner, prompt, 4)
    for chunk in (1, 7, 64):
        assert_same(run(runner, prompt, 4, chunk=chunk), whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_d_re_prefilling_generated_tokens_gives_what_decoding_gave(tiny_llama, dtype):
    runner = make_runner(tiny_llama, dtype)
    prompt = random_ids(random.Random(4), 13)
    steps = 9
    logits, ids, logprobs = run(runner, prompt, steps)
    for k in range(1, steps):  # a restart after k generated tokens: prefill prompt + ids[:k]
        resumed = run(runner, prompt + ids[:k], steps - k)
        assert_same(resumed, (logits, ids[k:], logprobs[k:]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_at_once_with_chunks_a_cached_prefix_and_company(tiny_llama, dtype):
    """The four changes together, on 16-token pages."""
    runner = make_runner(tiny_llama, dtype, page_size=16)
    rnd = random.Random(5)
    prompt = random_ids(rnd, 50)
    logits, ids, logprobs = run(runner, prompt, 6)
    donor = prompt[:16] + random_ids(rnd, 5)
    donor_pages = runner.kv.allocate(2)
    runner.step([SeqInput(donor, donor_pages)])
    resumed_at = 2
    tokens = prompt + ids[:resumed_at]
    own = runner.kv.allocate(runner.kv.pages_for(len(tokens) + 6) - 1)
    got = run(runner, tokens, 6 - resumed_at, pages=donor_pages[:1] + own, cached=16,
              chunk=7, others=7, rnd=rnd)
    assert_same(got, (logits[16:], ids[resumed_at:], logprobs[resumed_at:]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_sampling_with_filters_and_penalties_is_invariant_too(tiny_llama, dtype):
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                            frequency_penalty=0.3, presence_penalty=0.2, seed=11, top_logprobs=3)
    runner = make_runner(tiny_llama, dtype)
    rnd = random.Random(8)
    prompt = random_ids(rnd, 25)
    logits, ids, logprobs = run(runner, prompt, 6, params=params)
    assert_same(run(runner, prompt, 6, chunk=7, others=63, rnd=rnd, params=params), (logits, ids, logprobs))
    resumed = run(runner, prompt + ids[:3], 3, params=params)  # penalties now see ids[:3] as prompt
    assert resumed[0].equal(logits)


def test_bf16_with_fp32_upcast_gemms_is_invariant_too(tiny_llama, monkeypatch):
    """CPUs without bf16 units multiply bf16 as fp32 sgemm (layers.Linear's `upcast`)."""
    monkeypatch.setattr(runner_module, "cpu_has_bf16", lambda: False)
    runner = make_runner(tiny_llama, torch.bfloat16)
    assert runner.model.upcast
    rnd = random.Random(7)
    prompt = random_ids(rnd, 30)
    logits, ids, logprobs = run(runner, prompt, 4)
    assert_same(run(runner, prompt, 4, chunk=7, others=7, rnd=rnd), (logits, ids, logprobs))
    assert_same(run(runner, prompt + ids[:2], 2), (logits, ids[2:], logprobs[2:]))


def test_deterministic_greedy_matches_transformers(tiny, hf_greedy, assert_same_greedy):
    runner = ModelRunner(tiny, dtype=torch.float32, deterministic=True)
    hf = to_transformers(tiny)
    prompts = [random_ids(random.Random(i), n) for i, n in enumerate((5, 17, 40))]
    for prompt, out in zip(prompts, generate(runner, prompts, 6, prefill_chunk=7)):
        assert_same_greedy(out, hf_greedy(hf, prompt, 6), 6, tiny.eos_token_ids)


def test_deterministic_mode_is_refused_off_cpu(tiny_llama):
    with pytest.raises(ValueError, match="measured on CPU only"):
        ModelRunner(tiny_llama, device="meta", deterministic=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_properties(smollm2, dtype):
    """(a)-(d) on the real model: 30 layers, AMX-sized GEMMs, its 49152 x 576 LM head."""
    runner = make_runner(smollm2, dtype, page_size=16, kv_budget_bytes=256 << 20)
    rnd = random.Random(6)
    prompt = smollm2.tokenizer("The quick brown fox jumps over the lazy dog, and then it").input_ids
    prompt += random_ids(rnd, 48 - len(prompt))
    logits, ids, logprobs = run(runner, prompt, 5)
    assert_same(run(runner, prompt, 5, others=40, rnd=rnd), (logits, ids, logprobs))  # (a)
    donor_pages = runner.kv.allocate(3)  # (b) the first 32 tokens from the cache
    runner.step([SeqInput(prompt[:32] + random_ids(rnd, 7), donor_pages)])
    own = runner.kv.allocate(runner.kv.pages_for(len(prompt) + 5) - 2)
    got = run(runner, prompt, 5, pages=donor_pages[:2] + own, cached=32, chunk=7, others=7, rnd=rnd)
    assert_same(got, (logits[32:], ids, logprobs))  # (b) + (c) + (a)
    runner.kv.free(donor_pages)
    runner.kv.free(own)
    assert_same(run(runner, prompt, 5, chunk=1), (logits, ids, logprobs))  # (c)
    assert_same(run(runner, prompt + ids[:3], 2), (logits, ids[3:], logprobs[3:]))  # (d)

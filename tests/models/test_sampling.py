import math

import pytest
import torch

from models.runner import ModelRunner, generate
from models.sampling import GREEDY, SamplingParams, draw_seed, random_seed, sample

VOCAB = 50


def logits_rows(rows=1, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draws(logits, params, position=10, n=1, **kw):
    return sample(logits.expand(n, -1), [params] * n, [position] * n, [()] * n, [()] * n, **kw)


def test_greedy_takes_the_argmax():
    logits = logits_rows(3)
    out = sample(logits, [GREEDY] * 3, [0, 1, 2], [()] * 3, [()] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_a_seeded_draw_depends_only_on_seed_and_position():
    logits = logits_rows() / 3
    p = SamplingParams(temperature=1.0, seed=1234)
    first = [sample(logits, [p], [pos], [()], [()]).token_ids[0] for pos in range(40)]
    again = [sample(logits, [p], [pos], [()], [()]).token_ids[0] for pos in range(40)]
    other = [sample(logits, [SamplingParams(seed=99)], [pos], [()], [()]).token_ids[0] for pos in range(40)]
    assert first == again and first != other
    assert len(set(first)) > 5  # positions really vary the draw


def test_draw_seed_mixes_both_inputs():
    seeds = {draw_seed(s, p) for s in range(20) for p in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)
    assert 0 <= random_seed() < 2**63


def test_batch_rows_are_independent_of_their_neighbours():
    logits = logits_rows(3)
    p = SamplingParams(seed=7)
    alone = sample(logits[1:2], [p], [5], [()], [()]).token_ids[0]
    mixed = sample(logits, [GREEDY, p, SamplingParams(seed=8)], [3, 5, 9], [()] * 3, [()] * 3)
    assert mixed.token_ids[1] == alone


def frequencies(logits, params, n=4000):
    out = sample(logits.expand(n, -1), [params] * n, list(range(n)), [()] * n, [()] * n)
    return torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).float() / n


def test_sampling_follows_the_softmax():
    logits = logits_rows() / 3
    freq = frequencies(logits, SamplingParams(seed=3))
    assert (freq - torch.softmax(logits[0], -1)).abs().max() < 0.03


def test_top_k_keeps_only_the_k_best():
    logits = logits_rows()
    freq = frequencies(logits, SamplingParams(top_k=3, seed=1), n=500)
    assert set(freq.nonzero()[:, 0].tolist()) <= set(logits[0].topk(3).indices.tolist())


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :4] = torch.tensor([2.0, 1.5, 1.0, 0.5])
    probs = torch.softmax(logits[0], -1)
    freq = frequencies(logits, SamplingParams(top_p=float(probs[:2].sum()) - 1e-3, seed=1), n=500)
    assert set(freq.nonzero()[:, 0].tolist()) == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :3] = torch.tensor([3.0, 2.5, 0.0])
    freq = frequencies(logits, SamplingParams(min_p=0.2, seed=1), n=500)
    assert set(freq.nonzero()[:, 0].tolist()) == {0, 1}


def test_low_temperature_is_nearly_greedy_and_high_is_flat():
    logits = logits_rows()
    assert frequencies(logits, SamplingParams(temperature=0.01, seed=1), n=300).argmax() == logits.argmax()
    assert frequencies(logits, SamplingParams(temperature=100.0, seed=1)).max() < 0.06


def test_penalties():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0], logits[0, 1], logits[0, 2] = 2.0, 1.9, -1.0
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    # token 0 in the prompt: 2.0 / 2 = 1.0 < 1.9
    assert sample(logits, [rep], [0], [[0]], [()]).token_ids == [1]
    freq = SamplingParams(temperature=0, frequency_penalty=0.06)
    assert sample(logits, [freq], [0], [()], [[0, 0]]).token_ids == [1]  # 2.0 - 0.12
    assert sample(logits, [freq], [0], [()], [[0]]).token_ids == [0]  # 2.0 - 0.06
    pres = SamplingParams(temperature=0, presence_penalty=0.5)
    assert sample(logits, [pres], [0], [[1]], [[0]]).token_ids == [1]  # prompt tokens not counted
    # a negative logit is pushed further down by the repetition penalty
    neg = torch.full((1, VOCAB), -5.0)
    neg[0, 2], neg[0, 3] = -1.0, -1.5
    assert sample(neg, [rep], [0], [[2]], [()]).token_ids == [3]


def test_logprobs_are_the_models_distribution():
    logits = logits_rows(2)
    out = sample(logits, [GREEDY, SamplingParams(seed=1, top_logprobs=VOCAB)], [0, 0], [()] * 2, [()] * 2)
    assert out.top_logprobs[0] == []
    assert math.isclose(sum(math.exp(lp) for _, lp in out.top_logprobs[1]), 1.0, rel_tol=1e-4)
    assert math.isclose(out.logprobs[0], torch.log_softmax(logits[0], -1).max().item(), rel_tol=1e-5)
    chosen = dict(out.top_logprobs[1])[out.token_ids[1]]
    assert math.isclose(out.logprobs[1], chosen, rel_tol=1e-5)
    values = [lp for _, lp in out.top_logprobs[1]]
    assert values == sorted(values, reverse=True)


def test_invalid_parameters_are_refused():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(min_p=2), dict(repetition_penalty=0)):
        with pytest.raises(ValueError, match="invalid sampling"):
            SamplingParams(**bad)


def test_resuming_from_generated_tokens_draws_the_same(tiny_llama):
    runner = ModelRunner(tiny_llama, dtype=torch.float32, page_size=4)
    prompt = tiny_llama.tokenizer("Tell me a story about").input_ids
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=42, frequency_penalty=0.2)
    whole, other = generate(runner, [prompt, prompt], 10, params)
    assert other == whole  # same seed, same draws, whatever the batch
    head = whole[:4]  # the scheduler "crashed" here and re-submits prompt + head
    tail = generate(runner, [prompt + head], 6, params, output_so_far=[head])[0]
    assert head + tail == whole
    reseeded = generate(runner, [prompt], 10, SamplingParams(temperature=0.9, seed=43))[0]
    assert reseeded != whole


def test_logit_bias_and_an_allowed_mask_change_the_draw_not_the_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    only_5 = torch.zeros(3, dtype=torch.int32)
    only_5[0] = 1 << 5
    only_65 = torch.zeros(3, dtype=torch.int32)
    only_65[2] = 1 << 1
    params = [GREEDY, SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)), SamplingParams(seed=3), GREEDY]
    out = sample(logits, params, [0] * 4, [()] * 4, [()] * 4, allowed=[only_5, None, only_65, None])
    assert out.token_ids == [5, 7, 65, int(logits[3].argmax())]
    model = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(torch.tensor(out.logprobs), model[torch.arange(4), torch.tensor(out.token_ids)], atol=1e-5)
    for _ in range(20):  # sampled rows stay inside the mask
        seeded = [SamplingParams(seed=s) for s in range(4)]
        assert sample(logits, seeded, [1] * 4, [()] * 4, [()] * 4, allowed=[only_5] * 4).token_ids == [5] * 4


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_logits_with_the_runners_reduction_draw_what_their_fp32_copy_draws(half):
    """The runner hands the head's bf16 / fp16 logits and its argmax/logsumexp pass (`reduced`) to `sample`:
    greedy rows read only those and a gathered logit, the others widen; every token, logprob and top
    logprob is what the fp32 copy of the same logits gives."""
    from models import cpu_kernels

    if not cpu_kernels.load():
        pytest.skip("the CPU kernels do not build here: the runner widens the logits first")
    logits = (3 * torch.randn(5, 1000, generator=torch.Generator().manual_seed(7))).to(half)
    positions, prompts, outputs = [4] * 5, [[1, 2]] * 5, [[3]] * 5
    batches = {
        "greedy": [GREEDY] * 5,
        "sampled": [GREEDY, SamplingParams(temperature=0.7, seed=3), GREEDY, GREEDY, GREEDY],
        "top_logprobs": [GREEDY] * 4 + [SamplingParams(temperature=0.0, top_logprobs=3)],
        "penalty": [GREEDY] * 4 + [SamplingParams(temperature=0.0, repetition_penalty=1.3)],
    }
    for name, params in batches.items():
        got = sample(logits, params, positions, prompts, outputs, reduced=cpu_kernels.argmax_logsumexp(logits))
        want = sample(logits.float(), params, positions, prompts, outputs)
        assert (got.token_ids, got.logprobs, got.top_logprobs) == (want.token_ids, want.logprobs, want.top_logprobs), name

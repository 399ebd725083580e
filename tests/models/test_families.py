"""The dense families declared in models/families.py, each loaded from a directory transformers saved.

Per family a tiny random model (weights of std 0.15, so greedy tokens are far from ties) whose
peculiar layers matter at these lengths: sliding windows shorter than the sequences beside global
layers, soft-caps low enough to bend the scores, NoPE layers, partial rotary. tercet's teacher-forced
logprobs are within 2e-3 of transformers' (eager attention, fp32) and its greedy tokens the same,
through the C++ kernel (the default), the split-KV torch path (no kernels) and outside the
deterministic mode, with and without the kernels (where windowed layers fall back to the split-KV path).
"""

import logging
import random

import pytest
import torch

from models import cpu_kernels
from models.attention import paged_decode_attention
from models.errors import ModelLoadError
from models.families import FAMILIES, sliding_window
from models.loading import load_model, load_tokenizer, tiny_config
from models.runner import ModelRunner, SeqInput, generate
from models.split_attention import split_group, split_kv_attention

from tests.models.test_determinism import _properties_hold, assert_same, random_ids, run

STD = 0.15
WINDOW = 8  # shorter than every test sequence (5 + 16 tokens and more)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, num_hidden_layers=3,
             hidden_activation="gelu_pytorch_tanh")
MODELS = {
    # sliding / global alternating, attention and final soft-caps low enough to bind
    "gemma2": dict(GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    # two local layers (their own theta) then a global one with linear rope scaling, q/k norms
    "gemma3_text": dict(GEMMA, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}}),
    # fused qkv / gate_up, rotary over half of each head, every layer windowed (as Mistral's)
    "phi3": dict(sliding_window=12, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5}),
    "granite": dict(embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=2.0),
    "olmo2": dict(),
    # layer 1 NoPE (every 2nd), and windowed: SmolLM3 windows only its NoPE layers
    "smollm3": dict(num_hidden_layers=3, no_rope_layer_interval=2, use_sliding_window=True, pad_token_id=0,
                    sliding_window=WINDOW),
    # Llama's layers with a window on every one: through tercet's fused CPU ops (`_fused_forward`)
    "mistral": dict(sliding_window=WINDOW),
}


def save_tiny(model_type, directory, seed=0, **overrides):
    """A random model of `model_type` as transformers saves it, with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **{**MODELS[model_type], **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, STD)
    model.save_pretrained(directory)
    load_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=sorted(MODELS))
def family_dir(request, tmp_path_factory):
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))


def hf_from(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def teacher_forced(runner, tokens):
    pages = runner.kv.allocate(runner.kv.pages_for(len(tokens)))
    try:
        return runner.logits([SeqInput(tokens, pages, sample=False)], [0])[0].log_softmax(-1)
    finally:
        runner.kv.free(pages)


# (what the runner is built with, the attention backend it then takes)
RUNNERS = {
    "kernel": (dict(), "kernel"),
    "split": (dict(kernels=False), "split"),
    "off": (dict(deterministic=False), "kernel-decode"),
    "torch": (dict(deterministic=False, kernels=False), "torch"),
}


@pytest.mark.parametrize("how", sorted(RUNNERS))
def test_a_saved_model_gives_transformers_logprobs_and_greedy_tokens(family_dir, hf_greedy, how):
    options, backend = RUNNERS[how]
    if backend.startswith("kernel") and not cpu_kernels.load():
        pytest.skip("tercet's C++ kernels do not build here")
    loaded = load_model(family_dir)
    hf = hf_from(family_dir)
    runner = ModelRunner(loaded, dtype=torch.float32, kv_budget_bytes=8 << 20, **options)
    assert runner.attention == backend
    assert runner.model.llama_layers == (loaded.config.model_type == "mistral")  # which takes the fused ops
    rnd = random.Random(0)
    worst = 0.0
    for n in (5, 23):
        prompt = random_ids(rnd, n)
        want = hf_greedy(hf, prompt, 16)
        assert len(want) == 16  # (the random model has no reason to stop)
        assert generate(runner, [prompt], 16) == [want]
        assert generate(runner, [prompt], 16, prefill_chunk=3) == [want]
        tokens = prompt + want
        with torch.inference_mode():
            theirs = hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
        worst = max(worst, (teacher_forced(runner, tokens) - theirs).abs().max().item())
    assert worst < 2e-3
    assert runner.kv.num_free == runner.kv.num_pages


def test_the_tiny_configs_exercise_what_each_family_changes():
    """The windows bind (shorter than the sequences, beside global layers where the family has them),
    and the NoPE / local-rope layers are there."""
    configs = {t: tiny_config(t, **MODELS[t]) for t in MODELS}
    windows = {t: [sliding_window(c, i) for i in range(c.num_hidden_layers)] for t, c in configs.items()}
    assert windows["gemma2"] == [WINDOW, None, WINDOW]
    assert windows["gemma3_text"] == [WINDOW, WINDOW, None]
    assert windows["phi3"] == [12, 12]
    assert windows["smollm3"] == [None, WINDOW, None]
    assert windows["mistral"] == [WINDOW, WINDOW]
    assert windows["granite"] == windows["olmo2"] == [None, None]
    assert [FAMILIES["smollm3"].rope(configs["smollm3"], i) for i in range(3)] == ["default", None, "default"]
    gemma3 = configs["gemma3_text"]
    assert [FAMILIES["gemma3_text"].rope(gemma3, i) for i in range(3)] == gemma3.layer_types


def test_a_gemma3_request_is_the_same_alone_in_a_batch_chunked_or_resumed(tmp_path):
    """The deterministic mode's properties (tests/models/test_determinism.py) for a family with sliding
    windows, local rotary and q/k norms, in the server's dtype: alone vs beside others, chunked,
    re-prefilled after a resume, through the C++ kernel and through the split-KV torch path; after a
    prefix from the cache."""
    loaded = load_model(save_tiny("gemma3_text", tmp_path, seed=1))
    runner = ModelRunner(loaded, kv_budget_bytes=8 << 20)
    assert runner.deterministic and runner.attention in ("kernel", "split")
    assert all(_properties_hold(runner, random.Random(11)))
    rnd = random.Random(12)
    prompt = random_ids(rnd, 41)
    alone = run(runner, prompt, 5)
    assert_same(run(runner, prompt, 5, others=63, rnd=rnd, chunk=9), alone)
    split = ModelRunner(loaded, kv_budget_bytes=8 << 20, kernels=False)
    assert split.attention == "split"
    assert all(_properties_hold(split, random.Random(11)))
    # a prefix taken from the cache (another request's pages), on 16-token pages, chunked, in company
    paged = ModelRunner(loaded, kv_budget_bytes=8 << 20, page_size=16)
    prompt = random_ids(rnd, 50)
    logits, ids, logprobs = run(paged, prompt, 6)
    donor = prompt[:32] + random_ids(rnd, 5)
    donor_pages = paged.kv.allocate(3)
    paged.step([SeqInput(donor, donor_pages)])
    own = paged.kv.allocate(paged.kv.pages_for(len(prompt) + 6) - 2)
    got = run(paged, prompt, 6, pages=donor_pages[:2] + own, cached=32, chunk=7, others=7, rnd=rnd)
    assert_same(got, (logits[32:], ids, logprobs))


def test_a_windowed_layer_outside_the_kernel_logs_its_fallback_once(tmp_path, caplog):
    loaded = load_model(save_tiny("gemma2", tmp_path))
    runner = ModelRunner(loaded, dtype=torch.float32, kv_budget_bytes=8 << 20, deterministic=False)
    with caplog.at_level(logging.INFO, logger="models.layers"):
        generate(runner, [[5, 6, 7]], 3)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "split-KV" in caplog.records[0].message and "[0, 1, 2]" in caplog.records[0].message


def reference_attention(q, keys, values, scale, window, softcap):
    """One row's attention over its keys, plainly: q [H, D], keys/values [L, KVH, D]."""
    group = q.shape[0] // keys.shape[1]
    k, v = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k.double()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if window:
        scores[:, : max(0, len(keys) - window)] = float("-inf")
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("window,softcap", [(None, 3.0), (300, None), (100, 2.0), (5, None)])
def test_the_kernel_and_the_split_path_window_and_cap_as_the_reference(window, softcap):
    """Long rows (several 256-key splits in the kernel, 64-key ones in the torch path): the first
    splits behind a window skipped, the one it starts in cut."""
    torch.manual_seed(0)
    heads, kv_heads, dim, page_size = 4, 2, 64, 16
    lens = [1, 70, 300, 600]
    pages = [list(range(sum(-(-n // page_size) for n in lens[:i]), sum(-(-n // page_size) for n in lens[: i + 1])))
             for i in range(len(lens))]
    slots = sum(len(p) for p in pages) * page_size
    k_cache, v_cache = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
    q = torch.randn(len(lens), heads, dim)
    scale = dim**-0.5
    want = []
    for row, (n, table) in enumerate(zip(lens, pages)):
        rows = [table[t // page_size] * page_size + t % page_size for t in range(n)]
        want.append(reference_attention(q[row], k_cache[rows], v_cache[rows], scale, window, softcap))
    want = torch.stack(want)
    for row, (n, table) in enumerate(zip(lens, pages)):  # the split path: one group per decode row
        group = split_group(0, [table], [n - 1], 1, page_size, 64, "cpu")
        got = split_kv_attention(q[row : row + 1], k_cache, v_cache, group, scale, window, softcap)
        torch.testing.assert_close(got[0], want[row], atol=2e-5, rtol=1e-4)
    if not cpu_kernels.load():
        return
    widest = max(len(p) for p in pages)
    table = torch.tensor([p + [0] * (widest - len(p)) for p in pages], dtype=torch.int32)
    got = cpu_kernels.paged_attention(q, k_cache, v_cache, table, torch.arange(len(lens), dtype=torch.int32),
                                      torch.tensor(lens, dtype=torch.int32), page_size, scale, window, softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_the_kernel_without_window_or_cap_is_the_op_it_was():
    if not cpu_kernels.load():
        pytest.skip("tercet's C++ kernels do not build here")
    torch.manual_seed(1)
    k_cache, v_cache, q = torch.randn(700, 2, 64), torch.randn(700, 2, 64), torch.randn(3, 4, 64)
    table = torch.arange(700, dtype=torch.int32).view(1, -1).expand(3, -1).contiguous()
    lens = torch.tensor([1, 300, 700], dtype=torch.int32)
    plain = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, 1, 0.125)
    assert torch.equal(torch.ops.tercet.paged_attention(q, k_cache, v_cache, table, torch.arange(3, dtype=torch.int32),
                                                        lens, 1, 0.125, 0, 0.0), plain)
    # a window at least the row's length changes nothing either
    assert torch.equal(cpu_kernels.paged_attention(q, k_cache, v_cache, table, torch.arange(3, dtype=torch.int32),
                                                   lens, 1, 0.125, 700, None), plain)
    torch.testing.assert_close(plain, paged_decode_attention(q, k_cache, v_cache, table, lens, 1, 0.125))


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [3.0, 5.0, 8.0, 16.0],
            "original_max_position_embeddings": 64}


def test_phi3_longrope_serves_its_short_factors_up_to_the_original_length(tmp_path, hf_greedy):
    """Past `original_max_position_embeddings` transformers recomputes the whole sequence with the long
    factors, which a paged cache cannot follow: tercet serves up to there, where both use the short ones
    (and the attention factor of max / original)."""
    directory = save_tiny("phi3", tmp_path, rope_parameters=LONGROPE, original_max_position_embeddings=64)
    loaded = load_model(directory)
    hf = hf_from(directory)
    runner = ModelRunner(loaded, dtype=torch.float32, kv_budget_bytes=8 << 20)
    assert runner.context_len == 64 and runner.model.ropes["default"][1] > 1.0
    prompt = random_ids(random.Random(1), 30)
    want = hf_greedy(hf, prompt, 16)
    assert generate(runner, [prompt], 16) == [want]
    with torch.inference_mode():
        theirs = hf(torch.tensor([prompt + want])).logits[0].float().log_softmax(-1)
    assert (teacher_forced(runner, prompt + want) - theirs).abs().max().item() < 2e-3


def test_a_config_the_decoder_does_not_implement_is_refused_naming_the_field():
    from models.families import check

    dynamic = tiny_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ModelLoadError, match=r"rope_parameters.rope_type 'dynamic'"):
        check(dynamic, "tiny")
    with pytest.raises(ModelLoadError, match="hidden_act 'relu'"):
        check(tiny_config("olmo2", hidden_act="relu"), "tiny")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        check(tiny_config("gpt2"), "tiny")

"""The deterministic mode: a sequence's logits do not depend on how it was run.

For a target sequence, the fp32 logits after every one of its tokens (hence
greedy ids and logprobs) are bitwise equal when it runs (a) alone or beside
1, 7 or 63 random sequences (decode and prefill rows mixed in each step),
(b) after a prefix taken from the cache, (c) with chunked prefill of 1, 7,
64 or all tokens, (d) decoded token by token or re-prefilled over prompt +
generated tokens after any number of tokens. Seeded random cases.

Each property runs on every projection path the runner may take, pinned
(no timed choice decides which path a test exercises): tercet's fp32
kernel, the same on GGUF block codes, oneDNN's prepacked weights (bf16 and
fp32, where this CPU shows them invariant from two rows on), fixed row
tiles, and bf16 emulated on fp32 products (CPUs without bf16 units: tercet's
fp32 kernel over the bf16 weights' upcasts, or fixed row tiles of them). The
controls at the end show that the paths outside the mode are *not*
invariant here, so the properties can fail.
"""

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from models import cpu_kernels, probes
from models import runner as runner_module
from models.loading import to_transformers
from models.projections import UpcastPanelLinear
from models.runner import ModelRunner, SeqInput, generate
from models.sampling import GREEDY, SamplingParams

CPU = torch.device("cpu")
# (dtype, projection path) pairs; `pin` makes the runner take that path
PATHS = [
    pytest.param(torch.float32, "kernel", id="fp32-kernel"),
    pytest.param(torch.bfloat16, "kernel", id="bf16-kernel"),
    pytest.param(torch.float32, "codes", id="fp32-codes"),
    pytest.param(torch.float32, "onednn", id="fp32-onednn"),
    pytest.param(torch.bfloat16, "onednn", id="bf16-onednn"),
    pytest.param(torch.bfloat16, "tiles", id="bf16-tiles"),
    pytest.param(torch.bfloat16, "emulated", id="bf16-emulated"),
    pytest.param(torch.bfloat16, "upcast", id="bf16-upcast-kernel"),
    pytest.param(torch.float16, "upcast", id="fp16-upcast-kernel"),
]
# what runner.model.invariant_paths names each path
PATH_NAMES = {"kernel": "tercet's kernel", "codes": "tercet's kernel", "onednn": "oneDNN, one row padded to two",
              "tiles": "fixed row tiles", "emulated": "fixed row tiles", "upcast": "tercet's kernel"}


@pytest.fixture
def pin(monkeypatch):
    """pin(dtype, path, model) -> the model to run, with the runner made to take `path`."""
    def pin(dtype, path, model):
        if path == "upcast":  # bf16 (fp16) without bf16 (fp16) units, through the fp32 kernel (UpcastPanelLinear)
            if not cpu_kernels.packed_linear_available():
                pytest.skip("this build has no fp32 projection kernel (no AVX2 + FMA)")
            monkeypatch.setattr(runner_module, "cpu_has_bf16", lambda: False)
            monkeypatch.setattr(probes, "cpu_has_fp16", lambda: False)
            monkeypatch.setattr(probes, "kernel_pays", lambda dtype, *a, **k: dtype == torch.float32)
        elif path in ("kernel", "codes"):
            if dtype == torch.float32 and not cpu_kernels.packed_linear_available():
                pytest.skip("this build has no fp32 projection kernel (no AVX2 + FMA)")
            if dtype == torch.bfloat16 and not cpu_kernels.bf16_linear_available():
                pytest.skip("this CPU has no bf16 kernel (no AVX512_BF16)")
            monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
        else:
            monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: False)
        if path == "onednn" and not all(probes.onednn_invariant(dtype, CPU, False, tuple(w.shape))
                                        for w in model.state_dict.values() if w.dim() == 2):
            pytest.skip(f"oneDNN's {dtype} products are not invariant on this CPU (the runner takes another path)")
        if path == "tiles":
            if dtype == torch.bfloat16 and not runner_module.cpu_has_bf16():
                pytest.skip("this CPU has no bf16 units: bf16 is emulated here (the bf16-emulated case)")
            monkeypatch.setattr(probes, "onednn_invariant", lambda *a: False)
        if path == "emulated":
            monkeypatch.setattr(runner_module, "cpu_has_bf16", lambda: False)
        return gguf_requantized(model) if path == "codes" else model
    return pin


def gguf_requantized(model):
    """The model's projections quantized as llama.cpp would (Q4_1, the embeddings/LM head Q8_0)."""
    from gguf import GGMLQuantizationType, quants

    def requantize(name, tensor):
        if tensor.dim() != 2:
            return tensor
        kind = GGMLQuantizationType.Q8_0 if "embed" in name else GGMLQuantizationType.Q4_1
        return torch.from_numpy(quants.dequantize(quants.quantize(tensor.numpy(), kind), kind).copy())

    return dataclasses.replace(model, state_dict={n: requantize(n, t) for n, t in model.state_dict.items()})


def make_runner(model, dtype, path=None, page_size=1, kv_budget_bytes=8 << 20):
    runner = ModelRunner(model, dtype=dtype, page_size=page_size, kv_budget_bytes=kv_budget_bytes,
                         deterministic=True)
    if path is not None:
        assert runner.prefill_kernel, "the kernels build on this machine: the mode runs them"
        assert set(runner.model.invariant_paths) == {PATH_NAMES[path]}, runner.model.invariant_paths
        if path == "codes":
            assert all(lin.codes is not None for lin in runner.model.projections())
        assert runner.model.upcast == (path == "emulated" or (path == "upcast" and dtype == torch.bfloat16))
        if path == "upcast":
            assert all(isinstance(lin, UpcastPanelLinear) for lin in runner.model.projections())
    return runner


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


@pytest.mark.parametrize("dtype,path", PATHS)
@pytest.mark.parametrize("others", [1, 7, 63])
def test_a_batch_around_a_sequence_does_not_change_it(tiny_llama, pin, dtype, path, others):
    runner = make_runner(pin(dtype, path, tiny_llama), dtype, path)
    rnd = random.Random(others)
    prompt = random_ids(rnd, 21)
    alone = run(runner, prompt, 5)
    assert_same(run(runner, prompt, 5, others=others, rnd=rnd), alone)
    assert runner.kv.num_free == runner.kv.num_pages


@pytest.mark.parametrize("dtype,path", PATHS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_b_a_cached_prefix_gives_what_computing_it_gives(tiny_llama, pin, dtype, path, page_size):
    runner = make_runner(pin(dtype, path, tiny_llama), dtype, path, page_size)
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


@pytest.mark.parametrize("dtype,path", PATHS)
def test_c_chunked_prefill_gives_what_one_prefill_gives(tiny_llama, pin, dtype, path):
    runner = make_runner(pin(dtype, path, tiny_llama), dtype, path)
    prompt = random_ids(random.Random(3), 70)
    whole = run(runner, prompt, 4)
    for chunk in (1, 7, 64):
        assert_same(run(runner, prompt, 4, chunk=chunk), whole)


@pytest.mark.parametrize("dtype,path", PATHS)
def test_d_re_prefilling_generated_tokens_gives_what_decoding_gave(tiny_llama, pin, dtype, path):
    runner = make_runner(pin(dtype, path, tiny_llama), dtype, path)
    prompt = random_ids(random.Random(4), 13)
    steps = 9
    logits, ids, logprobs = run(runner, prompt, steps)
    for k in range(1, steps):  # a restart after k generated tokens: prefill prompt + ids[:k]
        resumed = run(runner, prompt + ids[:k], steps - k)
        assert_same(resumed, (logits, ids[k:], logprobs[k:]))


@pytest.mark.parametrize("dtype,path", PATHS)
def test_all_at_once_with_chunks_a_cached_prefix_and_company(tiny_llama, pin, dtype, path):
    """The four changes together, on 16-token pages."""
    runner = make_runner(pin(dtype, path, tiny_llama), dtype, path, page_size=16)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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


def test_deterministic_greedy_matches_transformers(tiny, hf_greedy, assert_same_greedy):
    runner = ModelRunner(tiny, dtype=torch.float32, deterministic=True)
    hf = to_transformers(tiny)
    prompts = [random_ids(random.Random(i), n) for i, n in enumerate((5, 17, 40))]
    for prompt, out in zip(prompts, generate(runner, prompts, 6, prefill_chunk=7)):
        assert_same_greedy(out, hf_greedy(hf, prompt, 6), 6, tiny.eos_token_ids)


def test_deterministic_mode_is_the_default_on_cpu_and_refused_elsewhere(tiny_llama):
    assert ModelRunner(tiny_llama, kv_budget_bytes=8 << 20).deterministic
    with pytest.raises(ValueError, match="measured on CPU only"):
        ModelRunner(tiny_llama, device="meta", deterministic=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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


# -- the controls: outside the mode, or in another kernel, the same checks fail on this CPU ------------


def test_control_fp32_f_linear_rounds_a_row_by_the_number_of_rows():
    """torch's fp32 F.linear (MKL's sgemm) multiplies 1 row, a few rows and many rows by different
    kernels: some row differs (why the mode never runs it unpadded or untiled)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 1536, generator=generator)
    x = torch.randn(64, 1536, generator=generator)
    many = F.linear(x, weight)
    few = torch.cat([F.linear(x[i : i + 1], weight) for i in range(16)] + [F.linear(x[16:20], weight)])
    assert not torch.equal(few, many[:20])


def test_control_sdpa_gives_a_row_other_bits_padded_than_unpadded():
    """SDPA over keys padded and masked vs the same keys unpadded (and a causal prefill's last row vs
    a one-query decode): the torch path's attention is not invariant, tercet's kernel is."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 40, 64, generator=generator)
    k = torch.randn(1, 9, 40, 64, generator=generator)
    v = torch.randn(1, 9, 40, 64, generator=generator)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    last = F.scaled_dot_product_attention(q[:, :, -1:], k, v)
    padded = torch.cat([k, torch.zeros(1, 9, 24, 64)], dim=2), torch.cat([v, torch.zeros(1, 9, 24, 64)], dim=2)
    mask = (torch.arange(64) < 40)[None, None, None, :]
    masked = F.scaled_dot_product_attention(q[:, :, -1:], *padded, attn_mask=mask)
    assert not (torch.equal(causal[:, :, -1:], last) and torch.equal(masked, last))


def _properties_hold(runner, rnd):
    """(a), (c) and (d) for one prompt: whether each gave the same bits."""
    prompt = random_ids(rnd, 40)
    alone = run(runner, prompt, 6)
    held = []
    for got, (logits, ids, logprobs) in (
        (run(runner, prompt, 6, others=7, rnd=rnd), alone),
        (run(runner, prompt, 6, chunk=7), alone),
        (run(runner, prompt + alone[1][:3], 3), (alone[0], alone[1][3:], alone[2][3:])),
    ):
        held.append(got[0].shape == logits.shape and torch.equal(got[0], logits))
    return held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_control_outside_the_mode_the_properties_fail(tiny_llama, dtype, monkeypatch):
    """The runner outside the mode (prefill rows through SDPA, decode rows through the kernel, one row
    through oneDNN's one-row kernel): some of (a), (c), (d) gives other bits. The same checks in the
    mode hold (the tests above, and here). (bf16 on a CPU without bf16 units through tercet's fp32
    kernel held them outside the mode too, on seeds 0-7: its products are invariant and the bf16
    roundings hid attention's differences; the control takes `F.linear` on the upcasts there.)"""
    if dtype == torch.bfloat16 and not runner_module.cpu_has_bf16():
        monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: False)
    fast = ModelRunner(tiny_llama, dtype=dtype, kv_budget_bytes=8 << 20, deterministic=False)
    assert not all(_properties_hold(fast, random.Random(9)))
    assert all(_properties_hold(make_runner(tiny_llama, dtype), random.Random(9)))


def test_control_the_torch_path_without_the_mode_breaks_the_properties(tiny_llama, monkeypatch):
    """The torch path (no kernels): with the mode, split-KV attention and invariant projections hold
    the properties; without it (SDPA, bucketed decode) they fail, so its tests can fail too."""
    monkeypatch.setattr(cpu_kernels, "load", lambda: False)
    fallback = make_runner(tiny_llama, torch.float32)
    assert fallback.split is not None and fallback.attention == "split" and not fallback.prefill_kernel
    assert all(_properties_hold(fallback, random.Random(10)))
    plain = ModelRunner(tiny_llama, dtype=torch.float32, kv_budget_bytes=8 << 20, deterministic=False)
    assert not plain.cpu_kernel and plain.attention == "torch"
    assert not all(_properties_hold(plain, random.Random(10)))


def test_every_family_holds_the_properties(tiny):
    """llama with llama3 rope, qwen2 (q/k/v biases), qwen3 (q/k norms: the unfused layer path),
    mistral: (a), (c) and (d) by default, in the server's dtype on this CPU."""
    runner = ModelRunner(tiny, kv_budget_bytes=8 << 20)
    assert runner.deterministic and runner.prefill_kernel
    assert all(_properties_hold(runner, random.Random(11)))

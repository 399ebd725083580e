"""The C++ decoder (csrc/decoder.cpp): a Llama-layout model's layers in one call, with the bits of the
Python loop over the same kernels (`CausalLM._fused_forward`), for every projection class it holds."""

import dataclasses
import shutil

import pytest
import torch

from models import cpu_kernels, probes
from models.layers import CausalLM
from models.loading import tiny_config, tiny_model
from models.projections import BlockCodeLinear, Bf16BlockCodeLinear, Bf16PanelLinear, DenseLinear, PanelLinear
from models.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.load(), "a machine with a C++ compiler must build the kernels (see the log)"
    if not cpu_kernels.packed_linear_available():
        pytest.skip("no AVX2 + FMA kernel on this machine")


def as_gguf(loaded):
    """The model's projections as a GGUF keeps them (Q4_1, Q8_0 the embeddings), dequantized."""
    from gguf import GGMLQuantizationType, quants

    def requantize(name, tensor):
        if tensor.dim() != 2:
            return tensor
        kind = GGMLQuantizationType.Q8_0 if "embed" in name or "lm_head" in name else GGMLQuantizationType.Q4_1
        return torch.from_numpy(quants.dequantize(quants.quantize(tensor.float().numpy(), kind), kind).copy())
    return dataclasses.replace(loaded, state_dict={n: requantize(n, t) for n, t in loaded.state_dict.items()})


def steps(runner):
    """Three prompts, then a step of their decode rows beside a fourth prompt and a chunk of a fifth
    (decode and prefill rows in one batch, K/V read back from the cache): every step's logits."""
    prompts = [list(range(5 + 3 * i, 25 + 7 * i)) for i in range(3)]
    pages = [list(range(start, start + 64)) for start in (0, 100, 200, 300, 400)]
    first = [SeqInput(p, pages[i]) for i, p in enumerate(prompts)]
    out = runner.logits(first, [0, 1, 2])
    second = [SeqInput([7 + i], pages[i], num_cached=len(p)) for i, p in enumerate(prompts)]
    second += [SeqInput(list(range(40, 49)), pages[3]), SeqInput(list(range(50, 80)), pages[4], sample=False)]
    out += runner.logits(second, [0, 1, 2, 3, 4])
    one = [SeqInput([9], pages[0], num_cached=len(prompts[0]) + 1)]  # one row: the codes' direct path
    return out + runner.logits(one, [0])


def assert_decoder_bits(loaded, dtype, cls, monkeypatch):
    runner = ModelRunner(loaded, dtype=dtype)
    model = runner.model
    assert runner.deterministic and model.decoder is not None
    assert {type(lin) for lin in model.projections()[:-1]} == {cls}
    python = ModelRunner(loaded, dtype=dtype)
    python.model.decoder = None  # the Python loop over the same kernels
    calls = []
    forward = cpu_kernels.decoder_forward
    monkeypatch.setattr(cpu_kernels, "decoder_forward", lambda *a: calls.append(1) or forward(*a))
    ours, theirs = steps(runner), steps(python)
    assert len(calls) == 3  # every step through the decoder
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_the_decoder_gives_the_python_loops_bits_over_fp32_panels(model_type, monkeypatch):
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    loaded = tiny_model(tiny_config(model_type), seed=1)
    assert_decoder_bits(loaded, torch.float32, PanelLinear, monkeypatch)


def test_the_decoder_gives_the_python_loops_bits_over_fp32_block_codes(tiny_llama, monkeypatch):
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    assert_decoder_bits(as_gguf(tiny_llama), torch.float32, BlockCodeLinear, monkeypatch)


def test_the_decoder_keeps_a_sliding_window(monkeypatch):
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    loaded = tiny_model(tiny_config("mistral", sliding_window=6), seed=2)
    runner = ModelRunner(loaded, dtype=torch.float32)
    assert runner.model.layers[0].window == 6 and runner.model.decoder is not None
    assert_decoder_bits(loaded, torch.float32, PanelLinear, monkeypatch)


@pytest.fixture
def bf16():
    if not cpu_kernels.bf16_linear_available():
        pytest.skip("this CPU has no avx512_bf16 (vdpbf16ps): the bf16 kernels are not built")


def test_the_decoder_gives_the_python_loops_bits_over_bf16_panels(tiny_llama, bf16, monkeypatch):
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    assert_decoder_bits(tiny_llama, torch.bfloat16, Bf16PanelLinear, monkeypatch)


@pytest.mark.parametrize("code_rows", [None, 2])  # 2: the panels beside the codes serve more rows
def test_the_decoder_gives_the_python_loops_bits_over_bf16_block_codes(tiny_llama, bf16, code_rows, monkeypatch):
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    monkeypatch.setattr(probes, "bf16_code_rows", lambda linears: code_rows)
    loaded = as_gguf(tiny_llama)
    assert_decoder_bits(loaded, torch.bfloat16, Bf16BlockCodeLinear, monkeypatch)
    model = ModelRunner(loaded, dtype=torch.bfloat16).model
    assert all(lin.code_rows == code_rows for lin in model.projections())


def test_a_projection_the_decoder_does_not_hold_leaves_the_python_loop(tiny_llama, monkeypatch):
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    runner = ModelRunner(tiny_llama, dtype=torch.float32)
    model = runner.model
    layer = model.layers[1]
    layer.mlp.down = DenseLinear(layer.down.dense())  # e.g. a storage the decoder has no kind for
    assert model._make_decoder() is None
    off = CausalLM(tiny_llama.config, tiny_llama.state_dict, torch.float32, fused=False)
    assert off.decoder is None  # the eager layers: nothing to call in C++


def test_the_decoder_refuses_what_it_cannot_hold():
    decoder = cpu_kernels.decoder(4, 2, 16, 1e-5, 0.25)
    weight = torch.ones(16)
    with pytest.raises(RuntimeError, match="a projection without its layer"):
        decoder.add_projection(0, 32, -1, [torch.zeros(2, 64, 16)], None)
    decoder.add_layer(weight, weight, 0)
    with pytest.raises(RuntimeError, match="projection kind 1 with 1 tensors"):
        decoder.add_projection(1, 32, -1, [torch.zeros(2, 64, 16)], None)
    with pytest.raises(RuntimeError, match="projection kind 7"):
        decoder.add_projection(7, 32, -1, [torch.zeros(2, 64, 16)], None)
    with pytest.raises(RuntimeError, match="a layer's four projections come after it"):
        decoder.add_layer(weight, weight, 0)
    with pytest.raises(RuntimeError, match="bad head counts"):
        cpu_kernels.decoder(4, 3, 16, 1e-5, 0.25)


def team_steps(runner):
    """Four prompts, then steps of 4, 16 and 17 rows (a team serves up to 16: share.h): every step's logits."""
    prompts = [list(range(3 + 5 * i, 14 + 6 * i)) for i in range(4)]
    pages = [list(range(start, start + 64)) for start in (0, 100, 200, 300, 400)]
    out = runner.logits([SeqInput(p, pages[i]) for i, p in enumerate(prompts)], [0, 1, 2, 3])
    done = [len(p) for p in prompts]
    for chunk in (0, 12, 13):  # + 4 decode rows: 4, 16 and 17 rows
        batch = [SeqInput([7 + i], pages[i], num_cached=done[i]) for i in range(4)]
        if chunk:
            batch.append(SeqInput(list(range(40, 40 + chunk)), pages[4], num_cached=12 if chunk == 13 else 0))
        out += runner.logits(batch, list(range(len(batch))))
        done = [n + 1 for n in done]
    return out


@pytest.mark.parametrize("dtype,int8,threads", [(torch.float32, False, 2), (torch.float32, True, 2),
                                                (torch.bfloat16, False, 2), (torch.bfloat16, True, 2),
                                                (torch.float32, True, 4)])
def test_a_step_as_one_team_has_the_bits_of_a_step_without(tiny_llama, dtype, int8, threads, monkeypatch):
    """A step of up to 16 rows runs as one team: each thread takes its run of a product's chunks and then the
    others' last ones, the helpers reading the next products' weights ahead; none of it changes a bit (nor the
    read-ahead's size). With more threads than cores some runs are taken by the others while their owners wait."""
    if dtype == torch.bfloat16 and not cpu_kernels.bf16_linear_available():
        pytest.skip("this CPU has no avx512_bf16 (vdpbf16ps): the bf16 kernels are not built")
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # (a team, even on a one-core machine)
    try:
        loaded = as_gguf(tiny_llama)
        calls, forward = [], cpu_kernels.decoder_forward
        monkeypatch.setattr(cpu_kernels, "decoder_forward", lambda *a: calls.append(len(a[1])) or forward(*a))
        results = []
        for team in [(0, 0), (16, 0), (16, 64), (16, 1 << 20)]:
            runner = ModelRunner(loaded, dtype=dtype, int8_activations=int8)
            runner.model.decoder.set_team(*team)
            results.append(team_steps(runner))
    finally:
        torch.set_num_threads(before)
    assert calls[:4] == [11 + 12 + 13 + 14, 4, 16, 17]  # every step through the decoder, at these rows
    assert len(results[0]) == 4 + 4 + 5 + 5  # a sequence's logits a step
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_a_failure_inside_a_team_step_is_raised_and_the_next_step_runs(tiny_llama, monkeypatch):
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = ModelRunner(as_gguf(tiny_llama), dtype=torch.float32)
        model, cfg = runner.model, tiny_llama.config
        hidden, head_dim = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
        caches = torch.zeros(cfg.num_hidden_layers, 64, cfg.num_key_value_heads, head_dim)
        x = torch.randn(1, hidden)
        cos, sin = model.rotary["default"].at(torch.tensor([0]))
        ints = dict(dtype=torch.int32)
        model.decoder.set_team(16, 1 << 20)  # (by default only the int8 mode's decoder has a team)
        with pytest.raises(RuntimeError, match="page 1000 out of range"):  # raised within the team's step
            cpu_kernels.decoder_forward(model.decoder, x.clone(), x.clone(), cos[:, 0], sin[:, 0], caches,
                                        caches.clone(), torch.tensor([0]), torch.tensor([[1000]], **ints),
                                        torch.tensor([0], **ints), torch.tensor([1], **ints), 16)
        ours = team_steps(runner)  # the team ended with it: the next steps run, with the same bits
        assert all(torch.equal(a, b) for a, b in zip(ours, team_steps(ModelRunner(as_gguf(tiny_llama), dtype=torch.float32)),
                                                       strict=True))
    finally:
        torch.set_num_threads(threads)


def test_only_the_int8_modes_decoder_has_a_team_by_default_and_set_team_sets_it(tiny_llama, monkeypatch):
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    loaded = as_gguf(tiny_llama)
    exact, int8 = (ModelRunner(loaded, dtype=torch.float32, int8_activations=on).model.decoder for on in (False, True))
    assert exact.team_rows() == 0 and int8.team_rows() == 16
    exact.set_team(4, 0)
    int8.set_team(0, 0)
    assert exact.team_rows() == 4 and int8.team_rows() == 0
    with pytest.raises(RuntimeError, match="rows and read_ahead must be >= 0"):
        exact.set_team(-1, 0)

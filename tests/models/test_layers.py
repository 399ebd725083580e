"""Projections and norms (models.layers): prepacked weights give F.linear's products (bf16: its bits) or are
not used; the norm gives transformers' bits."""

import pytest
import torch
import torch.nn.functional as F

from models.layers import CausalLM
from models.probes import dense_pays, packing_pays
from models.projections import DENSE_ROWS, Linear
from models.runner import ModelRunner, SeqInput, cpu_has_bf16

CPU = torch.device("cpu")


@pytest.mark.skipif(not (cpu_has_bf16() and torch.backends.mkldnn.is_available()), reason="no bf16 units")
@pytest.mark.parametrize("rows", [1, 5, 31, 33, 64, 129, 200])
def test_a_packed_projection_gives_f_linear_bits(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16()
    x = torch.randn(rows, 80, generator=generator).bfloat16()
    for b in (None, bias):
        packed = Linear(weight, b, packed=True)
        assert packed.weight is None  # the plain copy is not kept
        assert torch.equal(packed(x), F.linear(x, weight, b))
        assert torch.equal(packed(x, tile=32), Linear(weight, b)(x, tile=32))
        assert torch.equal(packed.dense(), weight)


@pytest.mark.skipif(not (cpu_has_bf16() and torch.backends.mkldnn.is_available()), reason="no bf16 units")
def test_a_packed_projection_keeping_its_dense_weight_uses_it_for_prefill_sized_products(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 80, generator=generator).bfloat16(), torch.randn(96, generator=generator).bfloat16()
    both = Linear(weight, bias, packed=True, keep_dense=True)
    assert both.weight is weight and both.dense() is weight
    plain_rows, real = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, *rest: plain_rows.append(len(x)) or real(x, *rest))
    for rows in (1, DENSE_ROWS - 1, DENSE_ROWS, 2 * DENSE_ROWS + 3):
        x = torch.randn(rows, 80, generator=generator).bfloat16()
        out = both(x)
        assert (plain_rows[-1:] == [rows]) == (rows >= DENSE_ROWS), rows  # the plain weight from DENSE_ROWS on
        assert torch.allclose(out.float(), real(x, weight, bias).float(), rtol=1e-2, atol=1e-2)
    plain_rows.clear()
    x = torch.randn(2 * DENSE_ROWS, 80, generator=generator).bfloat16()
    assert torch.equal(both(x, tile=32), Linear(weight, bias, packed=True)(x, tile=32))  # deterministic: packed tiles
    assert plain_rows == []


def test_dense_weights_are_kept_only_beside_packed_ones():
    assert not dense_pays(torch.float16, CPU, (96, 80))
    assert not dense_pays(torch.bfloat16, torch.device("meta"), (96, 80))


@pytest.mark.skipif(not (cpu_has_bf16() and torch.backends.mkldnn.is_available()), reason="no bf16 units")
def test_plain_copies_stay_within_their_memory_budget(tiny_llama, monkeypatch):
    from models import layers, probes

    monkeypatch.setattr(probes, "dense_pays", lambda *shape: True)
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: False)  # oneDNN's prepacked weights, pinned
    o = tiny_llama.config.hidden_size * tiny_llama.config.hidden_size * 2  # bytes of one bf16 o_proj
    monkeypatch.setattr(layers, "DENSE_BUDGET_BYTES", o)  # room for exactly one plain copy
    model = ModelRunner(tiny_llama, dtype=torch.bfloat16).model
    kept = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
            if lin.weight is not None]
    assert kept == [model.layers[0].o] and model.dense_budget == 0  # the first that fits, then none
    monkeypatch.setattr(layers, "DENSE_BUDGET_BYTES", 1 << 40)
    model = ModelRunner(tiny_llama, dtype=torch.bfloat16).model
    assert all(lin.weight is not None for layer in model.layers for lin in (layer.qkv, layer.o, layer.down))
    assert model.lm_head.weight is None  # the head's products are rows that sample: packed only


def test_packing_is_only_for_bf16_and_fp32_on_cpu():
    assert not packing_pays(torch.float16, CPU)
    assert not packing_pays(torch.bfloat16, torch.device("meta"))
    assert not packing_pays(torch.float32, torch.device("meta"))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("rows", [1, 5, 31, 33, 64, 129, 200, DENSE_ROWS + 1])
def test_a_packed_fp32_projection_gives_f_linear_products(rows):
    """oneDNN's fp32 products against MKL's: the same up to summation order, bias included."""
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 80, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(rows, 80, generator=generator)
    for b in (None, bias):
        packed = Linear(weight, b, packed=True)
        assert packed.weight is None and torch.equal(packed.dense(), weight)
        torch.testing.assert_close(packed(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed(x, tile=32), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_fp32_products_may_differ_by_summation_order_bf16_ones_not_at_all():
    from models.probes import _same_product

    base = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 30
    top = base.abs().max()
    assert _same_product(base, base + 0.5e-5 * top)
    assert not _same_product(base, base + 2e-5 * top)  # a wrong kernel, not a rounding
    assert _same_product(base.bfloat16(), base.bfloat16())
    nudged = base.bfloat16()
    nudged[0, 0] = nudged[0, 0] * 2  # one value off: bf16 products must agree bit for bit
    assert not _same_product(base.bfloat16(), nudged)


@pytest.mark.skipif(not (cpu_has_bf16() and torch.backends.mkldnn.is_available()), reason="no bf16 units")
def test_packing_pays_on_a_cpu_with_bf16_units():
    assert packing_pays(torch.bfloat16, CPU)


def test_the_runner_packs_where_it_pays(tiny_llama):
    bf16 = ModelRunner(tiny_llama, dtype=torch.bfloat16).model
    assert bf16.packed == (packing_pays(torch.bfloat16, CPU) and not bf16.kernel)  # tercet's kernel first
    fp32 = ModelRunner(tiny_llama, dtype=torch.float32).model
    assert fp32.packed == (packing_pays(torch.float32, CPU) and not fp32.kernel)  # tercet's kernel first
    assert not ModelRunner(tiny_llama, dtype=torch.float16).model.packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33, 64, 700])
def test_rms_norm_gives_the_bits_of_transformers_formula(dtype, rows):
    from models.layers import _rms_norm

    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=generator) * 4).to(dtype)
    weight = torch.randn(576, generator=generator).to(dtype)
    x32 = x.float()
    expected = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)  # LlamaRMSNorm
    assert torch.equal(_rms_norm(x, weight, 1e-5), expected)


def test_a_kernel_projection_gives_f_linear_products_and_its_dense_weight():
    from models import cpu_kernels

    if not cpu_kernels.packed_linear_available():
        pytest.skip("no AVX2 + FMA kernel on this machine")
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(40, 80, generator=generator), torch.randn(40, generator=generator)  # a partial panel
    x = torch.randn(33, 80, generator=generator)
    for b in (None, bias):
        lin = Linear(weight, b, kernel=True)
        assert lin.weight is None and lin.packed is None and torch.equal(lin.dense(), weight)
        torch.testing.assert_close(lin(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin(x, tile=16), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin.product(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_the_runner_uses_the_kernel_where_it_pays(tiny_llama):
    from models.probes import cpu_has_fp16, kernel_pays
    from models.projections import UpcastPanelLinear

    for dtype in (torch.float32, torch.bfloat16):  # fp32 panels; bf16 panels where the CPU has AVX512_BF16
        # the deterministic mode (the default) takes it wherever it builds, never by a timing (a busy host's
        # timing once said "slower" for bf16 while the mode served it, as it should); the mode off times it
        model = ModelRunner(tiny_llama, dtype=dtype).model
        assert model.kernel == kernel_pays(dtype, CPU, timed=False) and not (model.kernel and model.packed)
        off = ModelRunner(tiny_llama, dtype=dtype, deterministic=False).model
        # (called as the runner calls it: the cached answer it got, not a second timing a busy host may flip)
        assert off.kernel == kernel_pays(dtype, CPU, timed=True) and not (off.kernel and off.packed)
    assert not ModelRunner(tiny_llama, dtype=torch.float16).model.kernel
    # bf16 / fp16 without their units: the fp32 kernel over the weights' upcasts (UpcastPanelLinear)
    for dtype, has_units in ((torch.bfloat16, cpu_has_bf16()), (torch.float16, cpu_has_fp16())):
        model = ModelRunner(tiny_llama, dtype=dtype).model
        assert model.upcast_panels == (not has_units and kernel_pays(torch.float32, CPU, timed=False))
        if model.upcast_panels:
            assert all(isinstance(lin, UpcastPanelLinear) for lin in model.projections())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_upcast_projection_gives_the_upcasts_products_at_every_row_count(dtype):
    """bf16 / fp16 on a CPU without their units (UpcastPanelLinear): fp32 products of the exact upcasts,
    rounded to the dtype once. Each row has the same bits alone and in any batch, within one rounding of
    F.linear on the upcasts; tiles and the upcast flag change nothing; dense() is the weight."""
    from models import cpu_kernels
    from models.projections import UpcastPanelLinear

    if not cpu_kernels.packed_linear_available():
        pytest.skip("no AVX2 + FMA kernel on this machine")
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 80, generator=generator).to(dtype)  # a partial panel
    bias = torch.randn(40, generator=generator).to(dtype)
    x = torch.randn(70, 80, generator=generator).to(dtype)
    for b in (None, bias):
        lin = UpcastPanelLinear(weight, b, dtype)
        assert lin.invariant_by_itself and torch.equal(lin.dense(), weight)
        whole = lin(x, upcast=True, tile=32)
        assert whole.dtype == dtype
        reference = F.linear(x.float(), weight.float(), None if b is None else b.float())
        torch.testing.assert_close(whole.float(), reference.to(dtype).float(), rtol=2 ** -7, atol=1e-2)
        for rows in (1, 2, 7, 33):
            assert torch.equal(torch.cat([lin(x[i : i + rows]) for i in range(0, 70 - rows + 1, rows)]),
                               whole[: (70 // rows) * rows])
        assert torch.equal(lin.product(x, upcast=True).to(dtype), lin(x) if b is None else lin.product(x))


def test_a_bf16_kernel_projection_gives_f_linear_products_within_rounding_and_its_dense_weight():
    from models import cpu_kernels

    if not cpu_kernels.bf16_linear_available():
        pytest.skip("no AVX512_BF16 kernel on this machine")
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(40, 81, generator=generator).bfloat16()  # a partial panel, an odd K
    bias = torch.randn(40, generator=generator).bfloat16()
    x = torch.randn(33, 81, generator=generator).bfloat16()
    for b in (None, bias):
        lin = Linear(weight, b, kernel=True)
        assert lin.invariant_by_itself and lin.packed is None and torch.equal(lin.dense(), weight)
        exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
        torch.testing.assert_close(lin(x).float(), exact, rtol=2**-7, atol=2**-7 * exact.abs().max().item())
        assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(33)]), lin(x))  # row by row: the same bits


def test_a_gguf_weight_is_kept_as_block_codes_with_the_same_products_and_dense_weight():
    from models import cpu_kernels
    from tests.models.test_cpu_kernels import gguf_weight

    if not cpu_kernels.packed_linear_available():
        pytest.skip("no AVX2 + FMA kernel on this machine")
    generator = torch.Generator().manual_seed(4)
    weight, bias = gguf_weight(40, 96, "q4_1"), torch.randn(40, generator=generator)
    x = torch.randn(33, 96, generator=generator)
    for b in (None, bias):
        coded, panels = Linear(weight, b, kernel=True, codes=True), Linear(weight, b, kernel=True)
        assert coded.codes is not None and coded.panels is None and panels.codes is None
        assert torch.equal(coded.dense(), weight)
        for rows in (1, 4, 33):
            assert torch.equal(coded(x[:rows]), panels(x[:rows]))
            assert torch.equal(coded(x[:rows], tile=16), panels(x[:rows]))
            assert torch.equal(coded.product(x[:rows]), panels.product(x[:rows]))
    plain = Linear(torch.randn(40, 96, generator=generator), kernel=True, codes=True)
    assert plain.codes is None and plain.panels is not None  # weights as trained keep the fp32 panels


def test_a_gguf_model_runs_on_block_codes_with_the_logits_of_its_fp32_weights(tiny_llama, monkeypatch):
    """The tiny model's projections quantized as llama.cpp would (Q4_1, the LM head Q8_0): the runner
    keeps them as codes by default and its logits are bitwise those of the fp32 panels (the kernel
    pinned: whether it pays on this machine is not the question)."""
    import dataclasses

    from gguf import GGMLQuantizationType, quants

    from models import cpu_kernels, probes

    if not cpu_kernels.packed_linear_available():
        pytest.skip("no AVX2 + FMA kernel on this machine")

    def requantize(name, tensor):
        if tensor.dim() != 2:
            return tensor
        kind = GGMLQuantizationType.Q8_0 if "embed" in name else GGMLQuantizationType.Q4_1
        return torch.from_numpy(quants.dequantize(quants.quantize(tensor.numpy(), kind), kind).copy())

    loaded = dataclasses.replace(tiny_llama, state_dict={n: requantize(n, t) for n, t in tiny_llama.state_dict.items()})
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    runner = ModelRunner(loaded, dtype=torch.float32)
    assert runner.model.kernel
    assert all(lin.codes is not None for lin in runner.model.projections())
    reference = ModelRunner(loaded, dtype=torch.float32)
    reference.model = CausalLM(loaded.config, loaded.state_dict, torch.float32, CPU, kernel=True, codes=False,
                               invariant=reference.deterministic, fused=reference.cpu_kernel)
    assert reference.model.layers[0].qkv.codes is None
    prompts = [list(range(5 + 3 * i, 25 + 7 * i)) for i in range(3)]
    starts = [0, 100, 200]
    seqs = [SeqInput(p, list(range(start, start + len(p)))) for p, start in zip(prompts, starts)]
    ours, theirs = runner.logits(seqs, [0, 1, 2]), reference.logits(seqs, [0, 1, 2])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))

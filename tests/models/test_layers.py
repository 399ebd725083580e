"""Projections and norms (models.layers): prepacked weights give F.linear's bits or are not used; the norm gives transformers' bits."""

import pytest
import torch
import torch.nn.functional as F

from models.layers import Linear, packing_pays
from models.runner import ModelRunner, cpu_has_bf16

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


def test_packing_is_only_for_bf16_on_cpu():
    assert not packing_pays(torch.float32, CPU)
    assert not packing_pays(torch.bfloat16, torch.device("meta"))


@pytest.mark.skipif(not (cpu_has_bf16() and torch.backends.mkldnn.is_available()), reason="no bf16 units")
def test_packing_pays_on_a_cpu_with_bf16_units():
    assert packing_pays(torch.bfloat16, CPU)


def test_the_runner_packs_where_it_pays_and_not_for_fp32(tiny_llama):
    assert ModelRunner(tiny_llama, dtype=torch.bfloat16).model.packed == packing_pays(torch.bfloat16, CPU)
    assert not ModelRunner(tiny_llama, dtype=torch.float32).model.packed


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

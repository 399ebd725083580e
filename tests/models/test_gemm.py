"""tercet's projection kernels (csrc/gemm.cpp, csrc/gemm_bf16.cpp): products, batch invariance, refusals.

Each invariance test also computes one product in another summation order and asserts that *it*
differs, so that a bitwise comparison here can fail.
"""

import hashlib
import shutil

import pytest
import torch
import torch.nn.functional as F

from models import cpu_kernels

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")
SLICES = [(0, 1), (1, 2), (5, 7), (7, 15), (8, 32), (13, 77), (96, 131), (100, 101), (150, 200), (0, 200)]


@pytest.fixture(scope="module")
def fp32():
    assert cpu_kernels.load(), "a machine with a C++ compiler must build the kernels (see the log)"
    if not cpu_kernels.packed_linear_available():
        pytest.skip("built without AVX-512 or AVX2 + FMA")


@pytest.fixture(scope="module")
def bf16():
    assert cpu_kernels.load(), "a machine with a C++ compiler must build the kernels (see the log)"
    if not cpu_kernels.bf16_linear_available():
        pytest.skip("this CPU has no avx512_bf16 (vdpbf16ps): the bf16 kernel is not built")


def halves_summed(x, weight):
    """x W^T with k in two halves, each summed, then added: another order than one running sum."""
    h = x.shape[1] // 2
    return x[:, :h].double() @ weight[:, :h].double().T + x[:, h:].double() @ weight[:, h:].double().T


@needs_compiler
@pytest.mark.parametrize("out_features", [3, 16, 40, 48, 200])  # less than a panel, one, partial, a block of 3, many
def test_fp32_kernel_gives_each_row_its_bits_alone_in_any_batch(fp32, out_features):
    g = torch.Generator().manual_seed(out_features)
    weight, bias = torch.randn(out_features, 576, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(200, 576, generator=g)
    packed = cpu_kernels.pack_linear_weight(weight)
    for b in (None, bias):
        whole = cpu_kernels.packed_linear(x, packed, out_features, b)
        torch.testing.assert_close(whole, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)
        for start, stop in SLICES:
            assert torch.equal(cpu_kernels.packed_linear(x[start:stop], packed, out_features, b), whole[start:stop])
        alone = torch.cat([cpu_kernels.packed_linear(x[r : r + 1], packed, out_features, b) for r in range(0, 200, 9)])
        assert torch.equal(alone, whole[::9])
    control = halves_summed(x, weight).float()  # the same values, another order: not the same bits
    assert not torch.equal(control, cpu_kernels.packed_linear(x, packed, out_features))


@needs_compiler
def test_fp32_kernel_gives_the_same_bits_on_every_build(fp32):
    """One FMA per k, k in order, per output: AVX2 (8 lanes) and AVX-512 (16) builds agree bit for bit."""
    g = torch.Generator().manual_seed(28)
    weight, bias = torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    x = torch.randn(13, 96, generator=g)
    y = cpu_kernels.packed_linear(x, cpu_kernels.pack_linear_weight(weight), 40, bias)
    # recorded from the AVX2-only kernel before the AVX-512 build existed; the AVX2 and AVX-512
    # builds of this one give it too (Zen 5, December 2026)
    assert hashlib.sha256(y.numpy().tobytes()).hexdigest()[:16] == "8036ec86f2d12dab"


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 200])
def test_block_codes_give_each_row_its_bits_alone_in_any_batch(fp32, rows):
    from tests.models.test_cpu_kernels import gguf_weight

    weight = gguf_weight(80, 576, "mixed", seed=rows)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(200, 576, generator=g), torch.randn(80, generator=g)
    codes, packed = cpu_kernels.pack_block_codes(weight), cpu_kernels.pack_linear_weight(weight)
    whole = cpu_kernels.packed_linear(x, packed, 80, bias)
    for start in (0, 200 - rows):
        part = x[start : start + rows]
        assert torch.equal(cpu_kernels.block_linear(part, *codes, 80, bias), whole[start : start + rows])


def bf16_case(out_features, k, seed, rows=200):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, k, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    return weight, bias, torch.randn(rows, k, generator=g).bfloat16()


@needs_compiler
@pytest.mark.parametrize("out_features,k", [(3, 80), (40, 81), (48, 576), (200, 1536), (49, 7)])
def test_bf16_kernel_gives_f_linear_products_within_bf16_rounding(bf16, out_features, k):
    """Partial panels, an odd K (padded with a zero), a bias in bf16 and in fp32."""
    weight, bias, x = bf16_case(out_features, k, seed=k)
    packed = cpu_kernels.pack_bf16_weight(weight)
    pairs = (k + 1) // 2
    if cpu_kernels.bf16_tile_numerics():  # whole blocks of 16 pairs
        pairs = -(-pairs // 16) * 16
    assert packed.dtype == torch.bfloat16 and packed.shape == (-(-out_features // 16), pairs, 32)
    for b in (None, bias, bias.float()):
        y = cpu_kernels.bf16_linear(x, packed, out_features, b)
        assert y.dtype == torch.bfloat16 and y.shape == (200, out_features)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        # fp32 sums of exact bf16 products, one rounding to bf16: within an ulp of bf16 (2^-8 relative)
        torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-5 * exact.abs().max().item())
        # and almost always the correctly rounded value
        assert (y != exact.float().bfloat16()).float().mean() < 0.01


@needs_compiler
@pytest.mark.parametrize("out_features,k", [(40, 576), (200, 1536), (49, 7), (40, 800)])  # 800: uneven chunks of K
def test_bf16_kernel_gives_each_row_its_bits_alone_in_any_batch(bf16, out_features, k):
    weight, bias, x = bf16_case(out_features, k, seed=out_features)
    packed = cpu_kernels.pack_bf16_weight(weight)
    whole = cpu_kernels.bf16_linear(x, packed, out_features, bias)
    for start, stop in SLICES:
        assert torch.equal(cpu_kernels.bf16_linear(x[start:stop], packed, out_features, bias), whole[start:stop])
    alone = torch.cat([cpu_kernels.bf16_linear(x[r : r + 1], packed, out_features, bias) for r in range(200)])
    assert torch.equal(alone, whole)
    odd = torch.empty(200 * k + 1, dtype=torch.bfloat16)[1:].view(200, k)  # starts between two 32-bit words
    odd.copy_(x)
    assert torch.equal(cpu_kernels.bf16_linear(odd, packed, out_features, bias), whole)
    if k == 1536:  # the control: another summation order differs somewhere (rounding to bf16 hides most)
        control = (halves_summed(x, weight).float() + bias.float()).bfloat16()
        assert not torch.equal(control, cpu_kernels.bf16_linear(x, packed, out_features, bias))


@needs_compiler
@pytest.mark.parametrize("rows", [1, 3, 4, 16, 40])  # the vdpbf16ps path, and where AMX's tiles may serve
def test_bf16_kernel_sums_in_the_numerics_of_its_build(bf16, rows):
    """Products 1, 2^-24, 2^-8, 2^-24 at k = 0..3. vdpbf16ps's chain (odd element first, pair after pair)
    loses each 2^-24 against the 1 (a tie to even): 1 + 2^-8, a tie that rounds to bf16 1.0. Tile numerics
    (AMX builds: an even and an odd chain per 32 k, then their sum) add the two 2^-24 first: 1 + 2^-8 + 2^-23,
    which rounds up to 1 + 2^-7. Either way every row count gives the build's bits."""
    x = torch.zeros(rows, 40, dtype=torch.bfloat16)
    x[:, :4] = torch.tensor([1.0, 2.0**-12, 2.0**-4, 2.0**-12])
    packed = cpu_kernels.pack_bf16_weight(x[:1].clone())
    want = 1 + 2.0**-7 if cpu_kernels.bf16_tile_numerics() else 1.0
    assert cpu_kernels.bf16_linear(x, packed, 1).float().flatten().tolist() == [want] * rows
    if cpu_kernels.bf16_tile_numerics():  # whole blocks of 32 k: 40 columns are 2 blocks of 16 pairs
        assert packed.shape == (1, 32, 32)


@needs_compiler
def test_bf16_kernel_refuses_what_does_not_fit(bf16):
    packed = cpu_kernels.pack_bf16_weight(torch.zeros(40, 8, dtype=torch.bfloat16))
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 CPU \\[N, K\\]"):
        cpu_kernels.pack_bf16_weight(torch.zeros(4, 4))
    with pytest.raises(RuntimeError, match="bfloat16 CPU \\[N, K\\]"):
        cpu_kernels.pack_bf16_weight(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        cpu_kernels.bf16_linear(x.float(), packed, 40)
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        cpu_kernels.bf16_linear(x[0], packed, 40)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.bf16_linear(torch.zeros(2, 40, dtype=torch.bfloat16), packed, 40)
    with pytest.raises(RuntimeError, match="n does not match"):
        cpu_kernels.bf16_linear(x, packed, 50)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_kernels.bf16_linear(x, packed, 40, torch.zeros(39, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_kernels.bf16_linear(x, packed, 40, torch.zeros(40, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="packed must come from pack_bf16_weight"):
        cpu_kernels.bf16_linear(x, packed.float(), 40)
    with pytest.raises(RuntimeError, match="packed must come from pack_bf16_weight"):
        cpu_kernels.bf16_linear(x, packed[:, :, :16], 40)
    assert cpu_kernels.bf16_linear(x[:0], packed, 40).shape == (0, 40)

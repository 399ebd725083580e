"""GGUF block codes kept as GGUF keeps them (csrc/gemm.cpp `pack_block_codes`): Q4_1's and Q4_0's
codes two a byte, Q8_0's one a byte, d and m in fp16 where they are exactly fp16 (else fp32).

Every product has the bits of the wide layout (one int8 a code, fp32 d and m: the kernel before
nibbles) and of tercet's fp32 kernel over the dequantized weights, at one row, two, the direct
paths' register blocks (up to 8 rows on AVX-512) and the buffer path; a row's bits do not depend on
the other rows. On AVX2 builds, 0..15 codes with fp16 d, m go in octets (`octet_codes`: eight
codes an int32, the same bytes) with the same bits again.
"""

import shutil

import pytest
import torch

from models import cpu_kernels
from models.projections import BlockCodeLinear, Linear, unpaired_octets

from gguf_weights import quantized  # (this directory)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 64, 400]  # one row, two, the direct paths (AVX2: in groups of rows up to 8), the buffer path (one block, several)
# kind -> (codes dtype, codes a byte, scales dtype)
LAYOUT = {"q4_1": (torch.uint8, 2, torch.float16), "q4_0": (torch.int8, 2, torch.float16),
          "q8_0": (torch.int8, 1, torch.float16), "mixed": (torch.int8, 1, torch.float16)}


@pytest.fixture(scope="module")
def fp32():
    assert cpu_kernels.load(), "a machine with a C++ compiler must build the kernels (see the log)"
    if not cpu_kernels.packed_linear_available():
        pytest.skip("built without AVX-512 or AVX2 + FMA")


def octets_of(codes) -> list | None:
    """The same codes as octets where this build reads them and they fit (0..15, fp16 d and m), else None."""
    if codes[0].dtype != torch.uint8 or codes[1].dtype != torch.float16 or not cpu_kernels.octet_codes_preferred():
        return None
    return cpu_kernels.octet_codes(*codes)


def nbytes(codes) -> int:
    return sum(t.numel() * t.element_size() for t in codes)


def halves_summed(x, weight):
    """x W^T with k in two halves, each summed, then added: another order than one running sum."""
    h = x.shape[1] // 2
    return (x[:, :h].double() @ weight[:, :h].double().T + x[:, h:].double() @ weight[:, h:].double().T).float()


@pytest.mark.parametrize("kind", list(LAYOUT))
def test_codes_are_kept_in_gguf_bytes_and_rebuild_the_weight(fp32, kind):
    weight = quantized(48, 96, kind)
    compact, wide = cpu_kernels.pack_block_codes(weight), cpu_kernels.pack_block_codes(weight, compact=False)
    dtype, per_byte, scale_dtype = LAYOUT[kind]
    assert compact[0].dtype == dtype and compact[0].shape == (3, 96 // per_byte, 16)
    assert compact[1].dtype == compact[2].dtype == scale_dtype and compact[1].shape == (3, 3, 16)
    assert wide[0].dtype == torch.int8 and wide[0].shape == (3, 96, 16)
    assert wide[1].dtype == wide[2].dtype == torch.float32
    assert nbytes(wide) / weight.numel() == 1.25  # one byte a code, 8 bytes of d and m a block of 32
    assert nbytes(compact) / weight.numel() == {1: 1.125, 2: 0.625}[per_byte]  # Q4: GGUF's Q4_1 bytes (Q8_0 keeps m)
    for codes in (compact, wide):
        assert torch.equal(BlockCodeLinear(codes, 48).dense(), weight)  # bit for bit, -0 included
        assert BlockCodeLinear(codes, 48).shape == (48, 96)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features,k", [(3, 64), (40, 96), (80, 96), (96, 576), (200, 576)])
@pytest.mark.parametrize("kind", list(LAYOUT))
def test_compact_codes_give_the_bits_of_the_wide_codes_and_of_the_fp32_kernel(fp32, kind, out_features, k, rows):
    weight = quantized(out_features, k, kind, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(out_features, generator=g)
    compact, wide = cpu_kernels.pack_block_codes(weight), cpu_kernels.pack_block_codes(weight, compact=False)
    assert compact[0].dtype == LAYOUT[kind][0]
    panels, octets = cpu_kernels.pack_linear_weight(weight), octets_of(compact)
    for b in (None, bias):
        ours = cpu_kernels.block_linear(x, *compact, out_features, b)
        assert torch.equal(ours, cpu_kernels.block_linear(x, *wide, out_features, b))
        assert torch.equal(ours, cpu_kernels.packed_linear(x, panels, out_features, b))
        if octets is not None:
            assert torch.equal(ours, cpu_kernels.block_linear(x, *octets, out_features, b))
    assert not torch.equal(halves_summed(x, weight), cpu_kernels.block_linear(x, *compact, out_features))


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0"])
def test_compact_codes_give_a_row_the_same_bits_alone_or_in_any_batch(fp32, kind):
    weight = quantized(200, 576, kind)
    x = torch.randn(500, 576, generator=torch.Generator().manual_seed(2))
    codes = cpu_kernels.pack_block_codes(weight)
    whole = cpu_kernels.block_linear(x, *codes, 200)
    if octets_of(codes) is not None:
        assert torch.equal(cpu_kernels.block_linear(x, *octets_of(codes), 200), whole)
        codes = octets_of(codes)  # a row alone or in any batch, from the octets too
    for start, stop in [(0, 1), (5, 6), (8, 10), (7, 15), (7, 20), (96, 131), (383, 390), (100, 500), (499, 500)]:
        assert torch.equal(cpu_kernels.block_linear(x[start:stop], *codes, 200), whole[start:stop])
    alone = torch.cat([cpu_kernels.block_linear(x[r : r + 1], *codes, 200) for r in range(0, 500, 37)])
    assert torch.equal(alone, whole[::37])
    pairs = torch.cat([cpu_kernels.block_linear(x[r : r + 2], *codes, 200) for r in range(0, 500, 50)])
    assert torch.equal(pairs, torch.cat([whole[r : r + 2] for r in range(0, 500, 50)]))


@pytest.mark.parametrize("kind", ["q4_1", "q4_0"])
def test_codes_keep_fp32_scales_where_a_block_is_not_fp16(fp32, kind):
    """A constant block of 0.1 is exactly code 0 with m = 0.1, which no fp16 holds: the nibbles stay,
    d and m are fp32 (every layout: the same bits)."""
    weight = quantized(40, 96, kind)
    weight[17, 32:64] = 0.1
    codes, wide = cpu_kernels.pack_block_codes(weight), cpu_kernels.pack_block_codes(weight, compact=False)
    assert codes[0].dtype == LAYOUT[kind][0] and codes[0].shape[1] == 48
    assert codes[1].dtype == codes[2].dtype == torch.float32
    assert torch.equal(BlockCodeLinear(codes, 40).dense(), weight)
    g = torch.Generator().manual_seed(5)
    x, bias = torch.randn(400, 96, generator=g), torch.randn(40, generator=g)
    panels = cpu_kernels.pack_linear_weight(weight)
    for rows in ROWS:
        ours = cpu_kernels.block_linear(x[:rows], *codes, 40, bias)
        assert torch.equal(ours, cpu_kernels.block_linear(x[:rows], *wide, 40, bias))
        assert torch.equal(ours, cpu_kernels.packed_linear(x[:rows], panels, 40, bias))


def test_q4_0_blocks_are_found_as_codes(fp32):
    """Q4_0 (w = d * q, q -8..7, d < 0 where the block's largest magnitude is positive), before this
    kept as fp32 panels, is kept as signed nibbles, even where Q4_1's form also fits some blocks."""
    weight = quantized(64, 576, "q4_0")
    codes, _, offsets = cpu_kernels.pack_block_codes(weight)
    wide = cpu_kernels.pack_block_codes(weight, compact=False)[0]
    assert codes.dtype == torch.int8 and codes.shape == (4, 288, 16)
    assert bool((offsets == 0).all()) and bool(torch.signbit(offsets).all())  # m = -0: adds nothing
    assert wide.min() < 0 and wide.max() > 7  # wide: each block's first form that fits, Q4_1's first
    lin = Linear(weight, kernel=True, codes=True)
    assert lin.codes is not None and lin.codes[0].dtype == torch.int8 and torch.equal(lin.dense(), weight)


def test_linear_keeps_a_q4_1_weight_in_nibbles_with_the_products_of_the_panels(fp32):
    weight, bias = quantized(40, 96, "q4_1"), torch.randn(40, generator=torch.Generator().manual_seed(1))
    x = torch.randn(33, 96, generator=torch.Generator().manual_seed(2))
    coded, panels = Linear(weight, bias, kernel=True, codes=True), Linear(weight, bias, kernel=True)
    octets = cpu_kernels.octet_codes_preferred()  # (AVX2: octets, the same bytes; else nibbles)
    assert isinstance(coded, BlockCodeLinear) and coded.codes[0].dtype == (torch.int32 if octets else torch.uint8)
    assert nbytes(coded.codes) == nbytes(cpu_kernels.pack_block_codes(weight))  # the nibbles' bytes
    assert coded.shape == (40, 96) and torch.equal(coded.dense(), weight)
    for rows in (1, 2, 4, 33):
        assert torch.equal(coded(x[:rows]), panels(x[:rows]))
        assert torch.equal(coded(x[:rows], tile=16), panels(x[:rows]))


def test_octets_hold_the_nibbles_codes_in_pairs_of_panels_and_are_refused_where_they_do_not_fit(fp32):
    """`octet_codes`: k = 32g + 4t + j in bits 4t of row 4g + j, the same bytes as the nibbles; the
    panels in pairs (per block, the pair's rows panel after panel; a last odd panel alone), the d and
    m the same way."""
    g = torch.Generator().manual_seed(9)
    q = torch.randint(0, 16, (3, 64, 16), generator=g)  # 3 panels: a pair and one alone; 2 blocks
    nibbles = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).to(torch.uint8)
    scales, offsets = torch.randn(3, 2, 16, generator=g).half(), torch.randn(3, 2, 16, generator=g).half()
    octets, d, m = cpu_kernels.octet_codes(nibbles, scales, offsets)
    assert octets.dtype == torch.int32 and octets.shape == (3, 8, 16) and d.shape == m.shape == (3, 2, 16)
    want = sum(q.view(3, 2, 8, 4, 16)[:, :, t].long() << (4 * t) for t in range(8))  # [P, g, j, 16]
    flat = octets.reshape(-1, 4, 16).long() & 0xFFFFFFFF  # the (panel, block)s in memory order
    order = [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]  # the pair by block, then the last panel
    assert all(torch.equal(flat[i], want[p, b]) for i, (p, b) in enumerate(order))
    assert all(torch.equal(d.reshape(-1, 16)[i], scales[p, b]) and torch.equal(m.reshape(-1, 16)[i], offsets[p, b])
               for i, (p, b) in enumerate(order))
    planar = unpaired_octets(octets, d, m)
    assert torch.equal(planar[1], scales) and torch.equal(planar[2], offsets)
    assert torch.equal(planar[0].view(3, 2, 4, 16).long() & 0xFFFFFFFF, want)
    with pytest.raises(RuntimeError, match="0..15 nibbles"):
        cpu_kernels.octet_codes(nibbles.view(torch.int8), scales, offsets)  # signed codes stay nibbles
    with pytest.raises(RuntimeError, match="0..15 nibbles"):
        cpu_kernels.octet_codes(nibbles[:, :8].contiguous(), scales, offsets)  # not whole blocks of 32
    with pytest.raises(RuntimeError, match="fp16 scales"):
        cpu_kernels.octet_codes(nibbles, scales.float(), offsets.float())
    with pytest.raises(RuntimeError, match="fp16 scales"):
        cpu_kernels.octet_codes(nibbles, scales[:2].contiguous(), offsets[:2].contiguous())  # not this weight's
    codes, scales, offsets = cpu_kernels.pack_block_codes(quantized(40, 64, "q4_1"))
    octets, d, m = cpu_kernels.octet_codes(codes, scales, offsets)
    x = torch.zeros(2, 64)
    if cpu_kernels.octet_codes_preferred():
        with pytest.raises(RuntimeError, match="fp16 scales"):
            cpu_kernels.block_linear(x, octets, d.float(), m.float(), 40)
    else:
        with pytest.raises(RuntimeError, match="AVX2 build"):
            cpu_kernels.block_linear(x, octets, d, m, 40)


def test_dense_takes_int32_codes_one_a_code_as_codes_not_octets():
    """`BlockCodeLinear.dense` tells octets ([P, K/8, 16] int32) from codes one an int ([P, K, 16], as
    `bf16_block_codes_dense` gives them back in int32): the octets' pairs of panels were undone on such
    codes too, and a bf16 projection of two panels or more read back another weight (AMX CPUs' CI)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (3, 64, 16), generator=g)  # 3 panels, 2 blocks
    scales, offsets = torch.randn(3, 2, 16, generator=g).half(), torch.randn(3, 2, 16, generator=g).half()
    nibbles = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).to(torch.uint8)
    want = BlockCodeLinear([nibbles, scales, offsets], 40).dense()
    assert torch.equal(BlockCodeLinear([q.int(), scales, offsets], 40).dense(), want)
    assert torch.equal(BlockCodeLinear([q, scales, offsets], 40).dense(), want)
    assert torch.equal(BlockCodeLinear(list(cpu_kernels.octet_codes(nibbles, scales, offsets)), 40).dense(), want)


def test_block_linear_refuses_layouts_that_do_not_fit(fp32):
    codes, scales, offsets = cpu_kernels.pack_block_codes(quantized(40, 64, "q4_1"))
    x = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="scales and offsets"):
        cpu_kernels.block_linear(x, codes, scales, offsets.float(), 40)
    with pytest.raises(RuntimeError, match="codes must come"):
        cpu_kernels.block_linear(x, codes[:, :16].contiguous(), scales, offsets, 40)
    with pytest.raises(RuntimeError, match="codes must come"):
        cpu_kernels.block_linear(x, codes.int(), scales, offsets, 40)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.block_linear(torch.zeros(2, 32), codes, scales, offsets, 40)


@pytest.mark.parametrize("signed", [False, True])
def test_fp16_scales_at_their_extremes_rebuild_the_bits_of_fp32_scales(fp32, signed):
    """With fp16 d, float(q) * d is exact, so the kernel rebuilds a weight with one rounding (a fused
    multiply-add) where the wide layout takes two: the same bits, here for d and m at fp16's ends
    (subnormal, largest, zero of either sign, negative)."""
    g = torch.Generator().manual_seed(3)
    extremes = torch.tensor([0.0, -0.0, 2**-24, -(2**-24), 2**-14, 65504.0, -65504.0, 1e-3, -0.02, 0.5],
                            dtype=torch.float16)
    d = torch.cat([extremes[torch.randint(len(extremes), (2, 2, 16), generator=g)].flatten(),
                   torch.randn(64, generator=g).half()])[torch.randperm(128, generator=g)].view(2, 4, 16)
    m = torch.cat([extremes[torch.randint(len(extremes), (64,), generator=g)],
                   torch.randn(64, generator=g).half()])[torch.randperm(128, generator=g)].view(2, 4, 16)
    q = torch.randint(-8, 8, (2, 128, 16), generator=g) if signed else torch.randint(0, 16, (2, 128, 16), generator=g)
    nibbles = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).to(torch.uint8)
    compact = [nibbles.view(torch.int8) if signed else nibbles, d, m]
    wide = [q.to(torch.int8), d.float(), m.float()]
    assert torch.equal(BlockCodeLinear(compact, 32).dense(), BlockCodeLinear(wide, 32).dense())
    octets = octets_of(compact)
    if octets is not None:  # d * 16^-t, from fp16's subnormals up, rebuilds the same weights
        assert torch.equal(BlockCodeLinear(octets, 32).dense(), BlockCodeLinear(wide, 32).dense())
    x = torch.randn(400, 128, generator=g) * 1e-3
    for rows in ROWS:
        for n in (32, 20):
            want = cpu_kernels.block_linear(x[:rows], *wide, n)
            assert torch.equal(cpu_kernels.block_linear(x[:rows], *compact, n), want)
            if octets is not None:
                assert torch.equal(cpu_kernels.block_linear(x[:rows], *octets, n), want)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_a_model_quantized_to_4_bits_runs_on_nibbles_with_the_logits_of_its_fp32_weights(fp32, tiny_llama, kind,
                                                                                         monkeypatch):
    """The tiny model's projections quantized as llama.cpp would (Q4_0 or Q4_1, the LM head Q8_0): the
    runner keeps them as nibbles (the head as int8) and its logits are bitwise those of the fp32
    panels (the kernel pinned: whether it pays on this machine is not the question)."""
    import dataclasses

    from models import probes
    from models.layers import CausalLM
    from models.runner import ModelRunner, SeqInput

    def requantize(name, tensor):
        if tensor.dim() != 2:
            return tensor
        return quantized_like(tensor, "q8_0" if "embed" in name or "lm_head" in name else kind)

    loaded = dataclasses.replace(tiny_llama, state_dict={n: requantize(n, t) for n, t in tiny_llama.state_dict.items()})
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    runner = ModelRunner(loaded, dtype=torch.float32)
    dtypes = [lin.codes[0].dtype for lin in runner.model.projections()]
    layer = torch.int32 if kind == "q4_1" and cpu_kernels.octet_codes_preferred() else LAYOUT[kind][0]
    assert dtypes == [layer] * (len(dtypes) - 1) + [torch.int8]  # the layers' nibbles (or octets), the head's bytes
    assert [nbytes(lin.codes[:1]) * 2 == len(lin.codes[0]) * 16 * lin.shape[1]  # 4 bits a code
            for lin in runner.model.projections()] == [True] * (len(dtypes) - 1) + [False]
    reference = ModelRunner(loaded, dtype=torch.float32)
    reference.model = CausalLM(loaded.config, loaded.state_dict, torch.float32, torch.device("cpu"), kernel=True,
                               codes=False, invariant=reference.deterministic, fused=reference.cpu_kernel)
    assert all(lin.codes is None for lin in reference.model.projections())
    prompts = [list(range(5 + 3 * i, 25 + 7 * i)) for i in range(3)]
    seqs = [SeqInput(p, list(range(start, start + len(p)))) for p, start in zip(prompts, [0, 100, 200])]
    ours, theirs = runner.logits(seqs, [0, 1, 2]), reference.logits(seqs, [0, 1, 2])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def quantized_like(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """`tensor` quantized by gguf-py and dequantized (as tercet loads a GGUF)."""
    from gguf import GGMLQuantizationType, quants

    kinds = {"q4_1": GGMLQuantizationType.Q4_1, "q4_0": GGMLQuantizationType.Q4_0, "q8_0": GGMLQuantizationType.Q8_0}
    return torch.from_numpy(quants.dequantize(quants.quantize(tensor.float().numpy(), kinds[kind]), kinds[kind]).copy())

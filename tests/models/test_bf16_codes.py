"""GGUF block codes in a bf16 model (csrc/gemm_bf16.cpp `bf16_block_linear`): the weights stay codes,
and every product has the bits of the bf16 panels (`bf16_linear`) over the same weights rounded to
bf16, at every number of rows (the direct path's 1 to 8, the buffer path past it, one pass and
several; in tile numerics 4-bit codes take the weights-as-A tiles up to 64 rows), for each block
type, with and without a bias: whichever of the two serves a row count, a row gets the bits of one
kernel.
"""

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import cpu_kernels, probes
from models.layers import CausalLM
from models.projections import BlockCodeLinear, Bf16BlockCodeLinear, Bf16PanelLinear, Linear
from models.runner import ModelRunner, SeqInput

from gguf_weights import quantized  # (this directory)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")

ROWS = [*range(1, 71), 97, 130, 385, 800]  # 385, 800: the buffer path over more than one pass of 384 rows
# kind -> (codes dtype, codes a byte)
LAYOUT = {"q4_1": (torch.uint8, 2), "q4_0": (torch.int8, 2), "q8_0": (torch.int8, 1), "mixed": (torch.int8, 1)}


@pytest.fixture(scope="module")
def bf16():
    assert cpu_kernels.load(), "a machine with a C++ compiler must build the kernels (see the log)"
    if not cpu_kernels.bf16_linear_available():
        pytest.skip("this CPU has no avx512_bf16 (vdpbf16ps): the bf16 kernels are not built")


def assert_bits_of_the_panels(weight: torch.Tensor, rows=ROWS, seed: int = 0) -> None:
    """Every row count of x against the codes of `weight` (fp32) gives the bf16 panels' bits over
    weight.bfloat16(), without a bias, with a bf16 one and with an fp32 one."""
    n, k = weight.shape
    codes = cpu_kernels.pack_bf16_block_codes(weight)
    assert codes, "the weight is not block codes"
    panels = cpu_kernels.pack_bf16_weight(weight.bfloat16())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(rows), k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    for b in (None, bias.bfloat16(), bias):
        for m in rows:
            ours = cpu_kernels.bf16_block_linear(x[:m], *codes, n, b)
            assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
            assert torch.equal(ours, cpu_kernels.bf16_linear(x[:m], panels, n, b)), f"{m} rows, bias {b is not None}"


@pytest.mark.parametrize("kind", list(LAYOUT))
def test_codes_give_the_bits_of_the_bf16_panels_at_every_row_count(bf16, kind):
    weight = quantized(200, 576, kind)  # 12 full panels and a half one: a partial register block too
    assert cpu_kernels.pack_bf16_block_codes(weight)[0].dtype == LAYOUT[kind][0]
    assert_bits_of_the_panels(weight)


@pytest.mark.parametrize("out_features,k", [(3, 64), (40, 96), (80, 1536), (17, 32)])
@pytest.mark.parametrize("kind", list(LAYOUT))
def test_codes_give_the_bits_of_the_bf16_panels_at_other_shapes(bf16, kind, out_features, k):
    assert_bits_of_the_panels(quantized(out_features, k, kind, seed=out_features), rows=[1, 2, 3, 5, 8, 9, 33, 400])


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0"])
def test_codes_with_fp32_scales_give_the_bits_of_the_bf16_panels(bf16, kind):
    """A constant block of 0.1 is code 0 with m = 0.1, which no fp16 holds: d and m stay fp32, and
    the kernel rounds to bf16 without the fp16 shortcut (vec.h's rounding): the same bits, also for
    fp32 denormal weights (a row of 2^-130: a bf16 denormal, which vdpbf16ps reads as zero; a row
    just under 2^-126, which rounds up to bf16's smallest normal and counts)."""
    weight = quantized(40, 96, kind)
    weight[17, 32:64] = 0.1
    weight[3] = 2.0**-130
    weight[5] = 2.0**-126 - 2.0**-140
    codes = cpu_kernels.pack_bf16_block_codes(weight)
    assert codes and codes[1].dtype == torch.float32
    assert_bits_of_the_panels(weight, rows=[1, 2, 3, 4, 7, 8, 9, 16, 64, 400])


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("n,k", [(1, 32), (5, 64), (17, 32), (33, 96)])
def test_random_codes_give_the_bits_of_the_bf16_panels(bf16, signed, n, k):
    """Codes built at random (4-bit, unsigned and signed; d and m fp16, random and at fp16's ends:
    subnormal, largest, zero of either sign, negative), tiny and odd output widths: the bits of the
    bf16 panels of the weights they hold, float(q) * d + m rounded to bf16."""
    g = torch.Generator().manual_seed(n * k + signed)
    panels = -(-n // 16)
    extremes = torch.tensor([0.0, -0.0, 2**-24, -(2**-24), 2**-14, 65504.0, -65504.0, 1e-3, -0.02, 0.5])

    def scales(spread):
        picked = extremes[torch.randint(len(extremes), (panels, k // 32, 16), generator=g)]
        drawn = torch.randn(panels, k // 32, 16, generator=g) * spread
        return torch.where(torch.rand(panels, k // 32, 16, generator=g) < 0.3, picked, drawn).half()

    d, m = scales(0.01), scales(0.1)
    q = torch.randint(-8, 8, (panels, k, 16), generator=g) if signed else torch.randint(0, 16, (panels, k, 16), generator=g)
    nibbles = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).to(torch.uint8)
    codes = [nibbles.view(torch.int8) if signed else nibbles, d, m]
    weight = BlockCodeLinear(codes, n).dense()  # float(q) * d + m, fp32, each op rounded
    paired = [cpu_kernels.bf16_pair_order(codes[0], k), d, m]
    packed = cpu_kernels.pack_bf16_weight(weight.bfloat16())
    x = torch.randn(400, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    for rows in [1, 2, 3, 5, 8, 9, 20, 400]:
        for b in (None, bias):
            assert torch.equal(cpu_kernels.bf16_block_linear(x[:rows], *paired, n, b),
                               cpu_kernels.bf16_linear(x[:rows], packed, n, b))
    assert torch.equal(Bf16BlockCodeLinear(paired, n).dense(), weight.bfloat16())


def test_a_row_gets_its_bits_alone_or_in_any_batch(bf16):
    weight = quantized(200, 576, "q4_1")
    x = torch.randn(800, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    codes = cpu_kernels.pack_bf16_block_codes(weight)
    whole = cpu_kernels.bf16_block_linear(x, *codes, 200)
    for start, stop in [(0, 1), (5, 6), (8, 10), (7, 15), (7, 20), (96, 131), (383, 390), (100, 500), (799, 800)]:
        assert torch.equal(cpu_kernels.bf16_block_linear(x[start:stop], *codes, 200), whole[start:stop])
    odd = torch.empty(800 * 576 + 1, dtype=torch.bfloat16)[1:].view(800, 576)  # starts between two 32-bit words
    odd.copy_(x)
    assert torch.equal(cpu_kernels.bf16_block_linear(odd, *codes, 200), whole)


@pytest.mark.parametrize("kind", list(LAYOUT))
def test_the_codes_keep_gguf_bytes_in_the_kernels_pair_order(bf16, kind):
    weight = quantized(48, 96, kind)
    ours, theirs = cpu_kernels.pack_bf16_block_codes(weight), cpu_kernels.pack_block_codes(weight)
    assert [t.shape for t in ours] == [t.shape for t in theirs] and [t.dtype for t in ours] == [t.dtype for t in theirs]
    assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[2], theirs[2])
    assert torch.equal(BlockCodeLinear([cpu_kernels.bf16_block_codes_dense(ours[0], 96), *ours[1:]], 48).dense(), weight)
    assert torch.equal(Bf16BlockCodeLinear(ours, 48).dense(), weight.bfloat16())
    assert not torch.equal(ours[0], theirs[0])  # (the order differs)
    assert cpu_kernels.pack_bf16_block_codes(torch.randn(16, 64)) == []  # fp32 weights as trained: no codes


def test_linear_keeps_a_bf16_projections_codes(bf16):
    weight, bias = quantized(40, 96, "q4_1"), torch.randn(40, generator=torch.Generator().manual_seed(1)).bfloat16()
    x = torch.randn(33, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    coded = Linear(weight, bias, kernel=True, codes=True, dtype=torch.bfloat16)
    panels = Linear(weight, bias, kernel=True, dtype=torch.bfloat16)
    assert isinstance(coded, Bf16BlockCodeLinear) and coded.codes[0].dtype == torch.uint8
    assert isinstance(panels, Bf16PanelLinear) and panels.codes is None
    assert coded.shape == (40, 96) and coded.invariant_by_itself
    assert torch.equal(coded.dense(), weight.bfloat16()) and torch.equal(panels.dense(), weight.bfloat16())
    for rows in (1, 2, 4, 33):
        assert torch.equal(coded(x[:rows]), panels(x[:rows]))
    # a weight already in bf16 (a bf16 checkpoint) or not exactly codes: the panels
    assert isinstance(Linear(weight.bfloat16(), kernel=True, codes=True), Bf16PanelLinear)
    assert isinstance(Linear(torch.randn(40, 96), kernel=True, codes=True, dtype=torch.bfloat16), Bf16PanelLinear)


def test_bf16_block_linear_refuses_what_does_not_fit(bf16):
    codes, scales, offsets = cpu_kernels.pack_bf16_block_codes(quantized(40, 64, "q4_1"))
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="scales and offsets"):
        cpu_kernels.bf16_block_linear(x, codes, scales, offsets.float(), 40)
    with pytest.raises(RuntimeError, match="codes must come"):
        cpu_kernels.bf16_block_linear(x, codes.int(), scales, offsets, 40)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.bf16_block_linear(torch.zeros(2, 32, dtype=torch.bfloat16), codes, scales, offsets, 40)
    with pytest.raises(RuntimeError, match="x must be a bfloat16"):
        cpu_kernels.bf16_block_linear(x.float(), codes, scales, offsets, 40)
    with pytest.raises(RuntimeError, match="n does not match"):
        cpu_kernels.bf16_block_linear(x, codes, scales, offsets, 50)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.bf16_block_linear(x, codes, scales, offsets, 40, torch.zeros(39))


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0"])
def test_gate_up_with_silu_in_one_op_gives_silu_muls_bits(bf16, kind):
    """bf16_(block_)linear_silu == silu_mul(bf16_(block_)linear) bit for bit at every row count (the tiles'
    units of gate's and up's panels from 4 rows on, K in chunks from 128, a second block of rows past 512;
    the plain product then silu_mul below 4; 4-bit codes in tile numerics: the weights as the tiles' A
    side up to 64 rows, one to four groups of 16), with and without a bias, from codes and from panels;
    fp32 scales too (a block no fp16 holds)."""
    weight = quantized(192, 320, kind, seed=3)  # gate 96 (6 panels) and up 96; K = 320: 10 blocks, uneven chunks
    weight[100, 32:64] = 0.1  # a block no fp16 d and m hold: this weight's scales stay fp32
    assert cpu_kernels.pack_bf16_block_codes(weight)[1].dtype == torch.float32
    g = torch.Generator().manual_seed(1)
    x = torch.randn(600, 320, generator=g).bfloat16() * 2
    bias = torch.randn(192, generator=g)
    for w in (weight, quantized(192, 320, kind, seed=4)):
        codes = cpu_kernels.pack_bf16_block_codes(w)
        panels = cpu_kernels.pack_bf16_weight(w.bfloat16())
        for b in (None, bias.bfloat16(), bias):
            for m in (1, 2, 3, 4, 5, 15, 16, 17, 32, 33, 48, 49, 64, 65, 127, 128, 129, 513, 600):
                want = cpu_kernels.silu_mul(cpu_kernels.bf16_linear(x[:m], panels, 192, b))
                ours = cpu_kernels.bf16_block_linear_silu(x[:m], *codes, 192, b)
                assert ours.shape == (m, 96) and torch.equal(ours, want), f"codes, {m} rows, bias {b is not None}"
                ours = cpu_kernels.bf16_linear_silu(x[:m], panels, 192, b)
                assert torch.equal(ours, want), f"panels, {m} rows, bias {b is not None}"
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.bf16_linear_silu(x[:4], cpu_kernels.pack_bf16_weight(weight[:176].bfloat16()), 176)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.bf16_block_linear_silu(x[:0], *cpu_kernels.pack_bf16_block_codes(weight), 192, bias[:191])


_REFUSED = """
import torch
from models import cpu_kernels
from gguf_weights import quantized
assert cpu_kernels.load() and not cpu_kernels.bf16_amx_serves()
for kind in ("q4_1", "q4_0", "q8_0"):
    weight = quantized(96, 320, kind, seed=5)
    codes, panels = cpu_kernels.pack_bf16_block_codes(weight), cpu_kernels.pack_bf16_weight(weight.bfloat16())
    x = torch.randn(130, 320, generator=torch.Generator().manual_seed(6)).bfloat16()
    for m in (1, 2, 3, 16, 17, 64, 65, 130):
        assert torch.equal(cpu_kernels.bf16_block_linear(x[:m], *codes, 96), cpu_kernels.bf16_linear(x[:m], panels, 96)), (kind, m)
        assert torch.equal(cpu_kernels.bf16_block_linear_silu(x[:m], *codes, 96),
                           cpu_kernels.silu_mul(cpu_kernels.bf16_linear(x[:m], panels, 96))), (kind, m)
print("same bits")
"""


def test_codes_without_amx_give_the_same_bits(bf16):
    """Where Linux lends no AMX (TERCET_AMX=0 stands in for an old kernel or a sandbox), the codes go through
    the vdpbf16ps paths (4-bit codes in tile numerics: each block's columns decoded and transposed to the
    panels' pair rows): the bits of the panels at every row count, the silu op's too."""
    if not cpu_kernels.bf16_tile_numerics():
        pytest.skip("no AMX-BF16 on this CPU: the vdpbf16ps numerics serve everywhere already")
    here = Path(__file__).parent
    env = {**os.environ, "TERCET_AMX": "0", "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1])])}
    done = subprocess.run([sys.executable, "-c", _REFUSED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "same bits" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("code_rows", [None, 2])
@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8_0"])
def test_a_bf16_model_on_codes_has_the_logits_of_its_bf16_panels(bf16, tiny_llama, kind, code_rows, monkeypatch):
    """The tiny model's projections quantized as llama.cpp would (the LM head Q8_0), served in bf16: the
    runner keeps them as codes and its logits are bitwise those of the bf16 panels, with the codes
    serving every product or up to 2 rows (the kernel and the probe pinned: what pays on this machine
    is not the question here)."""
    from gguf import GGMLQuantizationType, quants

    def requantize(name, tensor):
        if tensor.dim() != 2:
            return tensor
        form = GGMLQuantizationType.Q8_0 if "embed" in name or "lm_head" in name else GGMLQuantizationType[kind.upper()]
        return torch.from_numpy(quants.dequantize(quants.quantize(tensor.float().numpy(), form), form).copy())

    loaded = dataclasses.replace(tiny_llama, state_dict={n: requantize(n, t) for n, t in tiny_llama.state_dict.items()})
    monkeypatch.setattr(probes, "kernel_pays", lambda *a, **k: True)
    monkeypatch.setattr(probes, "bf16_code_rows", lambda linears: code_rows)
    runner = ModelRunner(loaded, dtype=torch.bfloat16)
    assert runner.deterministic and runner.model.kernel
    projections = runner.model.projections()
    assert all(isinstance(lin, Bf16BlockCodeLinear) for lin in projections)
    assert all(lin.code_rows == code_rows and (lin.panels is None) == (code_rows is None) for lin in projections)
    assert [lin.codes[0].dtype for lin in projections] == [LAYOUT[kind][0]] * (len(projections) - 1) + [torch.int8]
    reference = ModelRunner(loaded, dtype=torch.bfloat16)
    reference.model = CausalLM(loaded.config, loaded.state_dict, torch.bfloat16, torch.device("cpu"), kernel=True,
                               codes=False, invariant=reference.deterministic, fused=reference.cpu_kernel)
    assert all(isinstance(lin, Bf16PanelLinear) for lin in reference.model.projections())
    assert torch.equal(runner.model.embed, reference.model.embed)
    prompts = [list(range(5 + 3 * i, 25 + 7 * i)) for i in range(3)]
    seqs = [SeqInput(p, list(range(start, start + len(p)))) for p, start in zip(prompts, [0, 100, 200])]
    ours, theirs = runner.logits(seqs, [0, 1, 2]), reference.logits(seqs, [0, 1, 2])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    one = [SeqInput([7], [300])]  # and a one-row batch (the direct path at every projection)
    assert torch.equal(runner.logits(one, [0])[0], reference.logits(one, [0])[0])


def test_the_panels_beside_the_codes_serve_products_past_code_rows_with_the_same_bits(bf16, monkeypatch):
    weight, bias = quantized(40, 96, "q4_1"), torch.randn(40, generator=torch.Generator().manual_seed(1)).bfloat16()
    x = torch.randn(12, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    both = Linear(weight, bias, keep_dense=True, kernel=True, codes=True, dtype=torch.bfloat16)
    alone = Linear(weight, bias, kernel=True, dtype=torch.bfloat16)
    assert isinstance(both, Bf16BlockCodeLinear) and both.panels is not None and both.code_rows is None
    from_codes = []
    block_linear = cpu_kernels.bf16_block_linear
    monkeypatch.setattr(cpu_kernels, "bf16_block_linear", lambda x, *a: from_codes.append(len(x)) or block_linear(x, *a))
    both.serve_codes_up_to(3)
    for rows in range(1, 13):
        assert torch.equal(both(x[:rows]), alone(x[:rows]))
    assert from_codes == [1, 2, 3]
    both.serve_codes_up_to(None)  # codes for every product: the panels go
    assert both.panels is None and torch.equal(both(x), alone(x)) and from_codes[-1] == 12
    with pytest.raises(ValueError, match="no panels"):
        both.serve_codes_up_to(3)


def test_the_probe_picks_the_rows_before_the_codes_are_slower(bf16, monkeypatch):
    lins = [Linear(quantized(40, 96, "q8_0"), keep_dense=True, kernel=True, codes=True, dtype=torch.bfloat16)]
    # codes faster at 1 row, even at 2, within the margin at 4, slower at 8
    times = iter([[1.0, 2.0], [1.0, 1.0], [1.05, 1.0], [3.0, 2.0]])
    monkeypatch.setattr(probes, "_best_seconds", lambda *calls, rounds: next(times))
    assert probes.bf16_code_rows(lins) == 4
    monkeypatch.setattr(probes, "_best_seconds", lambda *calls, rounds: [1.0, 2.0])
    assert probes.bf16_code_rows(lins) is None
    monkeypatch.undo()
    rows = probes.bf16_code_rows(lins)  # timed for real: one of the row counts, or None
    assert rows is None or rows in (0, *probes.CODE_ROWS)

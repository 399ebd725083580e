"""The opt-in int8 mode (csrc/gemm_i8.cpp, `Int8BlockCodeLinear`): GGUF block codes times activations rounded to
int8 per block of 32 k, as llama.cpp multiplies its Q4_1 / Q8_0 weights.

Its outputs are not the exact path's (that is the mode's price, checked to be small here), but they are what its
arithmetic says, bit for bit: the activations' codes against torch's rounding, each product against an integer
reference, the vector path against the scalar one; and a row's bits do not depend on the batch, the threads or the
layer loop (C++ or Python), so the deterministic mode's promises hold within the int8 mode.
"""

import shutil

import pytest
import torch

from benchmarks.bench_model import quantized as quantized_model_of
from models import cpu_kernels
from models.projections import Int8BlockCodeLinear, int8_block_codes

from gguf_weights import quantized  # (this directory)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")

ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 130]  # the row tiles (4, then 3/2/1) and row blocks (64)


@pytest.fixture(scope="module")
def kernels():
    assert cpu_kernels.load(), "a machine with a C++ compiler must build the kernels (see the log)"


def packed(weight):
    codes = int8_block_codes(weight)
    assert codes, "the weight is exactly codes the int8 kernel takes"
    return codes


def torch_codes(x):
    """The activations' codes as the kernel's comment defines them, in torch's fp32 ops."""
    blocks = x.view(len(x), -1, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127)  # (round: half to even, as vcvtps2dq)
    dx = amax / 127.0
    return q.to(torch.int8).view_as(x), dx, dx * q.sum(-1)


def integer_reference(x, weight):
    """y from the codes' definition in float64: per block the exact integer sum, times fp32 d * dx, plus m * sx."""
    q, d, m = cpu_kernels.pack_block_codes(weight, compact=False)  # int8 [P, K, 16], fp32 [P, K/32, 16]
    n, k = weight.shape
    q = q.transpose(1, 2).reshape(-1, k)[:n].long()
    d = d.transpose(1, 2).reshape(-1, k // 32)[:n]
    m = m.transpose(1, 2).reshape(-1, k // 32)[:n]
    qx, dx, sx = torch_codes(x)
    isum = torch.einsum("rbi,nbi->rnb", qx.long().view(len(x), -1, 32), q.view(n, -1, 32))  # exact
    scale = (d[None] * dx[:, None]).double()  # the kernel's fp32 product, then the fma
    return (isum.double() * scale + m[None].double() * sx[:, None].double()).sum(-1)


def test_the_activations_codes_are_torchs_rounding_and_a_block_with_inf_or_nan_is_nan(kernels):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 128, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    x[2, 32:64] = 0  # a block of zeros: codes 0, dx = sx = 0
    x[5, 64:96] = torch.linspace(-1e-38, 1e-38, 32)  # under 2^-100 (127 / amax would overflow): zeros too
    x[3, 70], x[4, 5] = float("nan"), float("inf")
    q, dx, sx = cpu_kernels.quantize_rows_i8(x)
    tiny_as_zeros = torch.nan_to_num(x)
    tiny_as_zeros[5, 64:96] = 0
    want_q, want_dx, want_sx = torch_codes(tiny_as_zeros)
    bad = torch.zeros_like(dx, dtype=torch.bool)
    bad[3, 2] = bad[4, 0] = True
    assert torch.equal(q.view(9, 4, 32)[~bad], want_q.view(9, 4, 32)[~bad])
    assert torch.equal(dx[~bad], want_dx[~bad]) and torch.equal(sx[~bad], want_sx[~bad])
    assert (q.view(9, 4, 32)[bad] == 0).all() and dx[bad].isnan().all() and sx[bad].isnan().all()
    assert dx[2, 1] == 0 and sx[2, 1] == 0
    assert dx[5, 2] == 0 and sx[5, 2] == 0 and (q[5, 64:96] == 0).all()
    assert q.abs().max() == 127
    weight = quantized(16, 128, "q4_1")  # the products of those rows: the scalar path's bits
    y = cpu_kernels.i8_block_linear(x, *packed(weight), 16)
    torch.testing.assert_close(y, cpu_kernels.i8_block_linear_reference(x, *packed(weight), 16), rtol=0, atol=0,
                               equal_nan=True)
    assert y[3].isnan().all() and y[4].isnan().all() and not y[[0, 1, 2, 5, 6, 7, 8]].isnan().any()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "mixed"])
def test_products_are_the_integer_arithmetic_and_near_the_exact_product(kernels, kind):
    weight = quantized(196, 192, kind)  # 196 outputs: a last panel of 8 half used
    g = torch.Generator().manual_seed(2)
    x = torch.randn(130, 192, generator=g)
    codes = packed(weight)
    assert codes[0].dtype == (torch.uint8 if kind == "q4_1" else torch.int8)
    y = cpu_kernels.i8_block_linear(x, *codes, 196)
    assert torch.equal(y, cpu_kernels.i8_block_linear_reference(x, *codes, 196))
    for rows in ROWS:  # the tiles of few rows (several panels a tile) end on the partial panel too
        assert torch.equal(cpu_kernels.i8_block_linear(x[:rows], *codes, 196), y[:rows])
    want = integer_reference(x, weight)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    exact = x.double() @ weight.double().T  # the activations' rounding: ~0.4 % of a block's largest value
    assert (y.double() - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n", [100, 52])
def test_a_row_has_the_scalar_paths_bits_alone_in_any_batch_and_on_any_threads(kernels, kind, n):
    # down's K: 48 blocks; 12.5 panels of 8 (many rows on VNNI: three tiles of two pairs, then the half panel), or
    # 6.5 (one tile of two pairs, one of a pair, the half panel)
    weight = quantized(n, 1536, kind)
    codes = packed(weight)
    g = torch.Generator().manual_seed(3)
    x, bias = torch.randn(130, 1536, generator=g), torch.randn(n, generator=g)
    whole = cpu_kernels.i8_block_linear(x, *codes, n, bias)
    assert torch.equal(whole, cpu_kernels.i8_block_linear_reference(x, *codes, n, bias))
    for rows in ROWS:
        assert torch.equal(cpu_kernels.i8_block_linear(x[-rows:], *codes, n, bias), whole[-rows:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.i8_block_linear(x, *codes, n, bias), whole)
    finally:
        torch.set_num_threads(threads)


def test_fp32_scales_where_a_block_is_not_fp16_and_the_weight_rebuilt_exactly(kernels):
    """A constant block of 0.1 is code 0 with m = 0.1, which no fp16 holds: d and m stay fp32, same arithmetic."""
    weight = quantized(40, 96, "q4_1")
    weight[17, 32:64] = 0.1
    codes = packed(weight)
    assert codes[0].dtype == torch.uint8 and codes[1].dtype == codes[2].dtype == torch.float32
    assert torch.equal(Int8BlockCodeLinear(codes, 40).dense(), weight)
    assert torch.equal(Int8BlockCodeLinear(packed(quantized(40, 96, "q8_0")), 40).dense(), quantized(40, 96, "q8_0"))
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(4))
    y = cpu_kernels.i8_block_linear(x, *codes, 40)
    assert torch.equal(y, cpu_kernels.i8_block_linear_reference(x, *codes, 40))
    want = integer_reference(x, weight)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_nan_stays_in_its_row_and_bf16_rows_give_bf16_with_the_bias_added_in_fp32(kernels):
    weight = quantized(64, 128, "q4_1")
    codes = packed(weight)
    g = torch.Generator().manual_seed(5)
    x, bias = torch.randn(6, 128, generator=g), torch.randn(64, generator=g)
    clean = cpu_kernels.i8_block_linear(x, *codes, 64, bias)
    x[2, 100] = float("nan")
    y = cpu_kernels.i8_block_linear(x, *codes, 64, bias)
    assert y[2].isnan().all() and torch.equal(y[[0, 1, 3, 4, 5]], clean[[0, 1, 3, 4, 5]])
    h = x[[0, 1]].bfloat16()
    got = cpu_kernels.i8_block_linear(h, *codes, 64, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, cpu_kernels.i8_block_linear(h.float(), *codes, 64, bias).bfloat16())


def test_bf16_rows_are_the_fp32_products_rounded_whether_the_sums_fit_the_scratch_or_not(kernels):
    """bf16 products sum into a scratch reused call after call (up to 2^20 sums), larger ones into their own."""
    weight = quantized(4096, 64, "q4_1")
    codes = packed(weight)
    g = torch.Generator().manual_seed(6)
    x, bias = torch.randn(300, 64, generator=g).bfloat16(), torch.randn(4096, generator=g).bfloat16()
    big = cpu_kernels.i8_block_linear(x, *codes, 4096, bias)  # 300 x 4096 sums: past the scratch
    assert torch.equal(big, cpu_kernels.i8_block_linear(x.float(), *codes, 4096, bias.float()).bfloat16())
    for rows in (1, 2, 200):  # within it, after a larger call and after each other
        assert torch.equal(cpu_kernels.i8_block_linear(x[:rows], *codes, 4096, bias), big[:rows])


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_bf16_rows_rounded_in_the_tiles_or_after_them_are_the_fp32_products_rounded(kernels, kind):
    """On VNNI whole pairs of panels are rounded to bf16 (plus the bias) straight from the tiles, the rest after:
    at 100 outputs (12.5 panels) and 52 (6.5), every tile shape's rows, both give the fp32 sums rounded."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(130, 96, generator=g).bfloat16()
    for n in (100, 52):
        codes = packed(quantized(n, 96, kind))
        bias = torch.randn(n, generator=g)
        for rows in ROWS:
            got = cpu_kernels.i8_block_linear(x[:rows], *codes, n, bias)
            assert torch.equal(got, cpu_kernels.i8_block_linear(x[:rows].float(), *codes, n, bias).bfloat16()), (n, rows)
            assert torch.equal(got, cpu_kernels.i8_block_linear_reference(x[:rows], *codes, n, bias)), (n, rows)


def test_codes_it_does_not_take_and_shapes_that_do_not_fit_are_refused(kernels):
    assert int8_block_codes(quantized(32, 64, "q4_0")) == []  # signed nibbles: the exact path keeps them
    assert int8_block_codes(torch.randn(32, 64)) == []  # not codes at all
    q8 = cpu_kernels.pack_block_codes(quantized(32, 64, "q8_0"))
    q8[0].view(-1)[5] = -128  # a pair of -128 * -127 would saturate vpmaddubsw's sign trick
    assert cpu_kernels.pack_i8_codes(*q8) == []
    codes = packed(quantized(32, 64, "q4_1"))
    x = torch.randn(2, 64)
    for bad in (lambda: cpu_kernels.i8_block_linear(x, *codes, 33),
                lambda: cpu_kernels.i8_block_linear(torch.randn(2, 96), *codes, 32),
                lambda: cpu_kernels.i8_block_linear(x.double(), *codes, 32),
                lambda: cpu_kernels.i8_block_linear(x, codes[0][:, :1], *codes[1:], 32),
                lambda: cpu_kernels.i8_block_linear(x, *codes, 32, torch.randn(31))):
        with pytest.raises(RuntimeError):
            bad()
    assert cpu_kernels.i8_block_linear(x[:0], *codes, 32).shape == (0, 32)


# ---- the mode in the runner

@pytest.fixture(scope="module")
def q4_llama(tiny_llama):
    return quantized_model_of(tiny_llama)  # the layers Q4_1, the embedding (the tied head) Q8_0


def seqs(runner, prompts):
    from models.runner import SeqInput

    out = []
    for p in prompts:
        out.append(SeqInput(p, runner.kv.allocate(runner.kv.pages_for(len(p)))))
    return out


PROMPTS = [list(range(5 + 3 * i, 25 + 7 * i)) for i in range(3)]


def test_the_runner_serves_every_projection_with_int8_activations_near_the_exact_logits(kernels, q4_llama):
    from models.runner import ModelRunner

    runner = ModelRunner(q4_llama, dtype=torch.float32, int8_activations=True)
    model = runner.model
    assert all(isinstance(lin, Int8BlockCodeLinear) for lin in model.projections())
    assert model.int8_projections == len(model.projections()) and model.decoder is not None
    assert runner.invariance()["projections"] == {"tercet's int8 kernel": len(model.projections())}
    exact = ModelRunner(q4_llama, dtype=torch.float32)
    ours = runner.logits(seqs(runner, PROMPTS), [0, 1, 2])
    theirs = exact.logits(seqs(exact, PROMPTS), [0, 1, 2])
    for a, b in zip(ours, theirs):
        assert not torch.equal(a, b)  # another arithmetic...
        assert (a - b).abs().max() < 0.05 * b.abs().max()  # ...near the exact one
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_a_sequences_logits_do_not_depend_on_the_batch_the_chunks_or_the_layer_loop(kernels, q4_llama):
    from models.runner import ModelRunner, SeqInput

    runner = ModelRunner(q4_llama, dtype=torch.float32, int8_activations=True)
    together = runner.logits(seqs(runner, PROMPTS), [0, 1, 2])
    alone = [runner.logits(seqs(runner, [p]), [0])[0] for p in PROMPTS]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    # the last prompt in two chunks: the second chunk's logits are the whole prompt's last rows
    p = PROMPTS[2]
    pages = runner.kv.allocate(runner.kv.pages_for(len(p)))
    runner.logits([SeqInput(p[:11], pages)], [0])
    tail = runner.logits([SeqInput(p[11:], pages, num_cached=11)], [0])[0]
    assert torch.equal(tail, alone[2][11:])
    python_loop = ModelRunner(q4_llama, dtype=torch.float32, int8_activations=True)
    python_loop.model.decoder = None  # `_fused_forward`: the same ops from Python
    assert all(torch.equal(a, b) for a, b in zip(python_loop.logits(seqs(python_loop, PROMPTS), [0, 1, 2]), together))


def test_bf16_runs_in_the_int8_mode_too(kernels, q4_llama):
    from models.runner import ModelRunner

    runner = ModelRunner(q4_llama, dtype=torch.bfloat16, int8_activations=True)
    assert all(isinstance(lin, Int8BlockCodeLinear) for lin in runner.model.projections())
    together = runner.logits(seqs(runner, PROMPTS), [0, 1, 2])
    assert all(torch.isfinite(t).all() for t in together)
    assert torch.equal(runner.logits(seqs(runner, PROMPTS[1:2]), [0])[0], together[1])


def test_weights_without_such_codes_keep_the_exact_path_and_a_model_with_none_is_refused(kernels, tiny_llama):
    from models.runner import ModelRunner

    mixed = quantized_model_of(tiny_llama, layers="Q4_0")  # signed nibbles
    runner = ModelRunner(mixed, dtype=torch.float32, int8_activations=True)
    kinds = [type(lin).__name__ for lin in runner.model.projections()]
    assert kinds[-1] == "Int8BlockCodeLinear" and "Int8BlockCodeLinear" not in kinds[:-1]
    with pytest.raises(ValueError, match="Q4_1 or Q8_0 block codes"):
        ModelRunner(tiny_llama, dtype=torch.float32, int8_activations=True)
    with pytest.raises(ValueError, match="CPU kernels"):
        ModelRunner(quantized_model_of(tiny_llama), dtype=torch.float32, int8_activations=True, kernels=False)

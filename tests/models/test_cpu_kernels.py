"""tercet's C++ decode attention against the torch reference, and the runner's use of it."""

import shutil

import pytest
import torch

from models import cpu_kernels
from models.attention import paged_decode_attention
from models.loading import tiny_model
from models.runner import ModelRunner, SeqInput

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")


@pytest.fixture(scope="module")
def kernels():
    assert cpu_kernels.load(), "a machine with a C++ compiler must build the kernels (see the log)"


def _paged(batch, heads, kv_heads, dim, lens, page_size, dtype, seed=0):
    """Random q and caches, each row's pages scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // page_size) for n in lens]
    pool = sum(pages) + 3
    order = torch.randperm(pool, generator=g)
    table = torch.zeros(batch, max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[used : used + n].int()
        used += n
    k = torch.randn(pool * page_size, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(pool * page_size, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


CASES = [  # (heads, kv_heads, head_dim, page_size): the vector path (64, 128, 256) and the portable one (48)
    (9, 3, 64, 1), (9, 3, 64, 16), (4, 4, 128, 4), (8, 2, 48, 1), (2, 1, 256, 8),
]


@needs_compiler
@pytest.mark.parametrize("heads,kv_heads,dim,page_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_reference(kernels, heads, kv_heads, dim, page_size, dtype):
    lens = [1, 7, 16, 17, 130, 64, 301]
    q, k, v, table, cl = _paged(len(lens), heads, kv_heads, dim, lens, page_size, dtype)
    out = cpu_kernels.paged_decode_attention(q, k, v, table, cl, page_size, dim**-0.5)
    ref = paged_decode_attention(q.float(), k.float(), v.float(), table, cl, page_size, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@needs_compiler
def test_a_row_gets_the_same_bits_alone_or_in_any_batch(kernels):
    # 20 rows: blocks enough that an item is a row with all its kv heads (a pass over each slot whole);
    # alone, a row goes by (kv head, split)
    lens = [33, 150, 2, 77, 150, 300, 16, 17, 1, 256, 257, 90] + [120] * 8
    q, k, v, table, cl = _paged(len(lens), 9, 3, 64, lens, 4, torch.bfloat16)
    whole = cpu_kernels.paged_decode_attention(q, k, v, table, cl, 4, 0.125)
    for i in range(len(lens)):
        alone = cpu_kernels.paged_decode_attention(q[i : i + 1], k, v, table[i : i + 1], cl[i : i + 1], 4, 0.125)
        assert torch.equal(alone[0], whole[i])
    flipped = cpu_kernels.paged_decode_attention(q.flip(0), k, v, table.flip(0), cl.flip(0), 4, 0.125)
    assert torch.equal(flipped.flip(0), whole)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_rows_get_the_bits_of_decode_rows(kernels, dtype, page_size):
    """One sequence of 700 tokens (three splits of 256 keys): its rows attended as one prefill
    chunk, as chunks of 7 and 64 beside other sequences, and one at a time as decode rows give
    each row the same bits; and they match SDPA's causal attention within rounding."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(page_size)
    n, heads, kv_heads, dim = 700, 9, 3, 64
    pages = -(-n // page_size)
    table = torch.randperm(pages + 5, generator=g)[:pages].int()[None]
    k = torch.randn((pages + 5) * page_size, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn((pages + 5) * page_size, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    rows = torch.zeros(n, dtype=torch.int32)
    lens = torch.arange(1, n + 1, dtype=torch.int32)
    whole = cpu_kernels.paged_attention(q, k, v, table, rows, lens, page_size, 0.125)
    for chunk in (7, 64):  # beside a 3-row sequence of another table row, as a mixed step lays them out
        other = torch.randperm(pages + 5, generator=g)[:pages].int()[None]
        tables = torch.cat([other, table])
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            qs = torch.cat([torch.randn(3, heads, dim, generator=g).to(dtype), q[start:end]])
            seq = torch.tensor([0] * 3 + [1] * (end - start), dtype=torch.int32)
            lengths = torch.cat([torch.tensor([5, 300, 690], dtype=torch.int32), lens[start:end]])
            got = cpu_kernels.paged_attention(qs, k, v, tables, seq, lengths, page_size, 0.125)[3:]
            assert torch.equal(got, whole[start:end]), (chunk, start)
    for i in (0, 1, 255, 256, 257, 511, 699):  # decode rows, alone (the per-split path at batch 1)
        alone = cpu_kernels.paged_decode_attention(q[i : i + 1], k, v, table, lens[i : i + 1], page_size, 0.125)
        assert torch.equal(alone[0], whole[i])
    slots = (table[0].long()[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k[slots].float().transpose(0, 1),
                                         v[slots].float().transpose(0, 1), is_causal=True, scale=0.125,
                                         enable_gqa=True).transpose(0, 1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(whole.float(), ref, atol=tol, rtol=tol)


@needs_compiler
def test_refuses_what_it_cannot_read(kernels):
    q, k, v, table, cl = _paged(2, 9, 3, 64, [5, 9], 1, torch.bfloat16)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_kernels.paged_decode_attention(q, k, v, table.long(), cl, 1, 0.125)
    with pytest.raises(RuntimeError, match="context length out of range"):
        cpu_kernels.paged_decode_attention(q, k, v, table, torch.tensor([5, 10], dtype=torch.int32), 1, 0.125)
    bad = table.clone()
    bad[1, 3] = len(k)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.paged_decode_attention(q, k, v, bad, cl, 1, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_kernels.paged_decode_attention(q.float(), k, v, table, cl, 1, 0.125)
    with pytest.raises(RuntimeError, match="multiple of the kv heads"):
        cpu_kernels.paged_decode_attention(q[:, :8], k, v, table, cl, 1, 0.125)
    rows = torch.tensor([0, 2], dtype=torch.int32)  # a row naming a sequence the table has not
    with pytest.raises(RuntimeError, match="sequence 2 out of range"):
        cpu_kernels.paged_attention(q, k, v, table, rows, cl, 1, 0.125)
    with pytest.raises(RuntimeError, match="a sequence and a length per query row"):
        cpu_kernels.paged_attention(q, k, v, table, rows[:1], cl, 1, 0.125)


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("TERCET_CPU_KERNELS", "0")
    assert cpu_kernels.load.__wrapped__() is False


def test_a_failed_build_leaves_the_torch_path(monkeypatch, tmp_path, caplog):
    """No compiler (here: a source that does not compile) is a logged fallback, not a crash."""
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "SOURCES", [broken])
    monkeypatch.setenv("TERCET_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_kernels.load.__wrapped__() is False
    assert "CPU kernels unavailable" in caplog.text
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


def test_missing_sources_leave_the_torch_path(monkeypatch, tmp_path, caplog):
    """A package installed without its csrc/ (package data lost) serves, on the torch path."""
    monkeypatch.setattr(cpu_kernels, "SOURCES", [tmp_path / "gone.cpp"])
    monkeypatch.setenv("TERCET_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_kernels.load.__wrapped__() is False
    assert "CPU kernels unavailable" in caplog.text and "gone.cpp" in caplog.text


@needs_compiler
def test_the_runner_decodes_through_the_kernel_as_through_torch(kernels):
    """The same greedy tokens and close logprobs with the kernel (decode rows; in the deterministic
    mode every row) and with the torch path."""
    model = tiny_model(seed=3)
    fast = ModelRunner(model, dtype=torch.float32, page_size=4, deterministic=False)
    every_row = ModelRunner(model, dtype=torch.float32, page_size=4)  # the default on CPU
    slow = ModelRunner(model, dtype=torch.float32, page_size=4, deterministic=False, kernels=False)
    assert (fast.attention, every_row.attention, slow.attention) == ("kernel-decode", "kernel", "torch")
    prompts = [[1, 5, 9, 2, 7], list(range(3, 40)), [11] * 12]
    results = []
    for runner in (fast, every_row, slow):
        tables = [runner.kv.allocate(runner.kv.pages_for(len(p) + 8)) for p in prompts]
        out = runner.step([SeqInput(p, t) for p, t in zip(prompts, tables)])
        tokens, logprobs = [out.token_ids], [out.logprobs]
        for step in range(7):
            seqs = [SeqInput([tok], t, len(p) + step) for tok, t, p in zip(tokens[-1], tables, prompts)]
            out = runner.step(seqs)
            tokens.append(out.token_ids)
            logprobs.append(out.logprobs)
        results.append((tokens, logprobs))
    for tokens, logprobs in results[:2]:
        assert tokens == results[2][0]
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(results[2][1]), atol=1e-4, rtol=1e-4)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [576, 44])  # the vector path (a multiple of 16 and of 8) and the portable one
def test_fused_ops_give_the_eager_ops_bits(kernels, dtype, width):
    """add + norm, silu * up and rope + store as layers.py's eager ops compute them: the adds,
    rotations and stores bit for bit, the norm and silu within a few roundings of the dtype (their
    sums and exp are computed in another order)."""
    import torch.nn.functional as F

    from models.layers import _rms_norm, _rotate

    g = torch.Generator().manual_seed(width)
    rows = 37
    x, delta = torch.randn(rows, width, generator=g).to(dtype), torch.randn(rows, width, generator=g).to(dtype)
    weight = (torch.rand(width, generator=g) + 0.5).to(dtype)
    fused_x = x.clone()
    h = cpu_kernels.add_rms_norm_(fused_x, delta, weight, 1e-5)
    assert torch.equal(fused_x, x + delta)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(h, _rms_norm(x + delta, weight, 1e-5), atol=4 * ulp, rtol=4 * ulp)

    gate_up = (3 * torch.randn(rows, 2 * width, generator=g)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up, atol=2 * ulp, rtol=2 * ulp)

    heads, kv_heads, dim = 6, 2, 64 if width % 16 == 0 else 10  # 64: the vector rope
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    angles = torch.rand(rows, dim // 2, generator=g) * 50
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    k_cache, v_cache = torch.zeros(100, kv_heads, dim, dtype=dtype), torch.zeros(100, kv_heads, dim, dtype=dtype)
    slots = torch.randperm(100, generator=g)[:rows]
    q, k = cpu_kernels.rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    want = _rotate(qkv[:, : heads + kv_heads], cos[:, None], sin[:, None])
    assert torch.equal(q, want[:, :heads]) and torch.equal(k, want[:, heads:])
    assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], qkv[:, heads + kv_heads :])
    untouched = torch.ones(100, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_and_the_sampler_give_a_row_the_same_bits_alone_or_in_any_batch(kernels, dtype):
    """add + norm, silu * up, rope + store and argmax + logsumexp work row by row: a row alone, and
    in batches large enough to go to both threads, gets the same bits."""
    g = torch.Generator().manual_seed(0)
    rows, width, heads, kv_heads, dim = 300, 576, 9, 3, 64
    x, delta = torch.randn(rows, width, generator=g).to(dtype), torch.randn(rows, width, generator=g).to(dtype)
    weight = (torch.rand(width, generator=g) + 0.5).to(dtype)
    gate_up = (3 * torch.randn(rows, 2 * width, generator=g)).to(dtype)
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    angles = torch.rand(rows, dim // 2, generator=g) * 50
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    logits = 4 * torch.randn(rows, 4099, generator=g)

    def ops(r):
        cache = torch.zeros(rows, kv_heads, dim, dtype=dtype)
        fused_x = x[r].clone()
        h = cpu_kernels.add_rms_norm_(fused_x, delta[r].contiguous(), weight, 1e-5)
        q, k = cpu_kernels.rope_store(qkv[r].contiguous(), cos[r].contiguous(), sin[r].contiguous(), cache,
                                      cache.clone(), torch.arange(rows)[r].contiguous(), heads, kv_heads)
        return [fused_x, h, cpu_kernels.silu_mul(gate_up[r].contiguous()), q, k,
                *cpu_kernels.argmax_logsumexp(logits[r].contiguous())]

    whole = ops(slice(0, rows))
    for r in (0, 1, 150, 299):
        for got, want in zip(ops(slice(r, r + 1)), whole):
            assert torch.equal(got[0], want[r])


@needs_compiler
def test_fused_ops_refuse_bad_shapes(kernels):
    x = torch.zeros(4, 32)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_kernels.add_rms_norm_(x, x, torch.ones(31), 1e-5)
    with pytest.raises(RuntimeError, match="2 \\* N"):
        cpu_kernels.silu_mul(torch.zeros(4, 33))
    cache = torch.zeros(10, 1, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.rope_store(torch.zeros(2, 4, 8), torch.zeros(2, 8), torch.zeros(2, 8), cache, cache.clone(),
                               torch.tensor([3, 10]), 2, 1)


@needs_compiler
@pytest.mark.parametrize("vocab", [49152, 37, 5])  # vector lanes, a tail, a row shorter than a vector
def test_argmax_logsumexp_is_torchs(kernels, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = 4 * torch.randn(6, vocab, generator=g)
    logits[1, vocab // 2] = logits[1, vocab - 1] = 99.0  # a tie: the first index wins, as max's
    logits[2] = float("-inf")
    logits[2, vocab - 1] = 0.5  # one finite logit
    index, lse = cpu_kernels.argmax_logsumexp(logits)
    assert torch.equal(index, logits.max(dim=-1).indices)
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), atol=1e-5, rtol=1e-6)
    alone = cpu_kernels.argmax_logsumexp(logits[3:4])
    assert torch.equal(alone[1], lse[3:4])  # a row's result does not depend on the others
    logits[4, vocab - 1] = logits[5, 0] = float("nan")  # the last lane or the tail; the first lane
    lse = cpu_kernels.argmax_logsumexp(logits)[1]
    assert torch.isnan(lse).tolist() == [False] * 4 + [True, True]  # as torch's (the runner's NaN check reads it)
    assert torch.isnan(torch.logsumexp(logits, dim=-1)[4:]).all()
    for half in (torch.bfloat16, torch.float16):  # read as the floats they are: the bits of their fp32 copy
        narrow = logits.to(half)
        got, want = cpu_kernels.argmax_logsumexp(narrow), cpu_kernels.argmax_logsumexp(narrow.float())
        assert torch.equal(got[0], want[0]) and got[1].dtype == torch.float32
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, equal_nan=True)


needs_gemm = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")


@needs_gemm
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 97, 200])
@pytest.mark.parametrize("out_features", [96, 40, 3])  # whole panels of 16, a partial last one, less than one
def test_packed_linear_gives_f_linear_products(kernels, rows, out_features):
    if not cpu_kernels.packed_linear_available():
        pytest.skip("built without AVX2 + FMA")
    g = torch.Generator().manual_seed(rows * out_features)
    weight, bias = torch.randn(out_features, 80, generator=g), torch.randn(out_features, generator=g)
    x = torch.randn(rows, 80, generator=g)
    panels = cpu_kernels.pack_linear_weight(weight)
    for b in (None, bias):
        torch.testing.assert_close(cpu_kernels.packed_linear(x, panels, out_features, b), F_linear(x, weight, b),
                                   rtol=1e-5, atol=1e-5)


@needs_gemm
def test_packed_linear_gives_a_row_the_same_bits_alone_or_in_any_batch(kernels):
    """One running sum per output, k in order: the bits do not depend on the rows beside it."""
    if not cpu_kernels.packed_linear_available():
        pytest.skip("built without AVX2 + FMA")
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(200, 576, generator=g), torch.randn(200, generator=g)
    x = torch.randn(131, 576, generator=g)
    panels = cpu_kernels.pack_linear_weight(weight)
    whole = cpu_kernels.packed_linear(x, panels, 200, bias)
    for start, stop in [(0, 1), (5, 6), (7, 20), (96, 131), (100, 101)]:
        assert torch.equal(cpu_kernels.packed_linear(x[start:stop], panels, 200, bias), whole[start:stop])


@needs_gemm
def test_packed_linear_refuses_what_does_not_fit(kernels):
    if not cpu_kernels.packed_linear_available():
        pytest.skip("built without AVX2 + FMA")
    panels = cpu_kernels.pack_linear_weight(torch.zeros(40, 8))
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.packed_linear(torch.zeros(2, 9), panels, 40)
    with pytest.raises(RuntimeError, match="n does not match"):
        cpu_kernels.packed_linear(torch.zeros(2, 8), panels, 50)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.packed_linear(torch.zeros(2, 8), panels, 40, torch.zeros(39))
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.pack_linear_weight(torch.zeros(4, 4, dtype=torch.bfloat16))


def F_linear(x, weight, bias):
    return torch.nn.functional.linear(x, weight, bias)


def gguf_weight(out_features: int, k: int, kind: str, seed: int = 0) -> torch.Tensor:
    """A weight as tercet loads a GGUF's: quantized by gguf-py (llama.cpp's Q4_1 / Q8_0) and dequantized."""
    from gguf import GGMLQuantizationType, quants

    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, k, generator=g) * 0.05).numpy()
    kinds = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
    if kind == "mixed":  # rows of both kinds in one weight (a fused q/k/v of differently quantized parts)
        halves = [gguf_weight(out_features // 2, k, "q4_1", seed), gguf_weight(out_features - out_features // 2, k,
                                                                                 "q8_0", seed + 1)]
        return torch.cat(halves)
    return torch.from_numpy(quants.dequantize(quants.quantize(weight, kinds[kind]), kinds[kind]).copy())


@needs_gemm
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 64, 97, 400])
@pytest.mark.parametrize("out_features", [96, 40, 3, 80])  # 6 panels, a partial one, less than one, 5 (4 + 1)
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "mixed"])
def test_block_codes_give_the_bits_of_the_fp32_kernel(kernels, rows, out_features, kind):
    """Weights kept as GGUF's block codes, rebuilt in the kernel: the very products of the fp32 panels."""
    if not cpu_kernels.packed_linear_available():
        pytest.skip("built without AVX2 + FMA")
    weight = gguf_weight(out_features, 96, kind, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 96, generator=g), torch.randn(out_features, generator=g)
    codes, panels = cpu_kernels.pack_block_codes(weight), cpu_kernels.pack_linear_weight(weight)
    assert len(codes) == 3 and codes[0].dtype == (torch.uint8 if kind == "q4_1" else torch.int8)  # nibbles for Q4_1
    for b in (None, bias):
        assert torch.equal(cpu_kernels.block_linear(x, *codes, out_features, b),
                           cpu_kernels.packed_linear(x, panels, out_features, b))


@needs_gemm
def test_block_codes_give_a_row_the_same_bits_alone_or_in_any_batch(kernels):
    if not cpu_kernels.packed_linear_available():
        pytest.skip("built without AVX2 + FMA")
    weight = gguf_weight(200, 576, "q4_1")
    x = torch.randn(500, 576, generator=torch.Generator().manual_seed(2))
    codes = cpu_kernels.pack_block_codes(weight)
    whole = cpu_kernels.block_linear(x, *codes, 200)
    for start, stop in [(0, 1), (5, 6), (8, 10), (7, 20), (96, 131), (383, 390), (499, 500)]:
        assert torch.equal(cpu_kernels.block_linear(x[start:stop], *codes, 200), whole[start:stop])


@needs_gemm
def test_pack_block_codes_keeps_gguf_codes_and_refuses_other_weights(kernels):
    if not cpu_kernels.packed_linear_available():
        pytest.skip("built without AVX2 + FMA")
    codes, scales, offsets = cpu_kernels.pack_block_codes(gguf_weight(40, 64, "q4_1"), compact=False)
    assert codes.shape == (3, 64, 16) and scales.shape == offsets.shape == (3, 2, 16)
    assert codes.min() >= 0 and codes.max() == 15  # Q4_1: 0..15 from the block's minimum
    codes, _, offsets = cpu_kernels.pack_block_codes(gguf_weight(40, 64, "q8_0"), compact=False)
    assert codes.min() < 0 and torch.all(offsets[:, :, :8] == 0)  # Q8_0: signed, no offset
    assert cpu_kernels.pack_block_codes(torch.zeros(16, 64))  # constant blocks: d = 0
    plain = torch.randn(16, 64)
    assert cpu_kernels.pack_block_codes(plain) == []  # fp32 weights as trained: no codes
    almost = gguf_weight(16, 64, "q4_1")
    almost[3, 40] = torch.nextafter(almost[3, 40], torch.tensor(1.0))  # one weight one ulp off
    assert cpu_kernels.pack_block_codes(almost) == []
    nan = gguf_weight(16, 64, "q4_1")
    nan[0, 0] = float("nan")
    assert cpu_kernels.pack_block_codes(nan) == []
    assert cpu_kernels.pack_block_codes(gguf_weight(16, 64, "q8_0")[:, :40].contiguous()) == []  # k % 32 != 0


@needs_gemm
def test_block_linear_refuses_what_does_not_fit(kernels):
    if not cpu_kernels.packed_linear_available():
        pytest.skip("built without AVX2 + FMA")
    codes = cpu_kernels.pack_block_codes(gguf_weight(40, 64, "q4_1"))
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.block_linear(torch.zeros(2, 32), *codes, 40)
    with pytest.raises(RuntimeError, match="n does not match"):
        cpu_kernels.block_linear(torch.zeros(2, 64), *codes, 50)
    with pytest.raises(RuntimeError, match="scales and offsets"):
        cpu_kernels.block_linear(torch.zeros(2, 64), codes[0], codes[1][:, :1].contiguous(), codes[2], 40)

"""tercet's own CPU kernels (C++ in `csrc/`), compiled on first use.

- `paged_attention` reads each row's keys and values in place through its
  sequence's page table, decode rows and prefill rows by the same code, so a row's
  result does not depend on the batch, the chunking or the prefix cache; where the
  torch path copies every layer's context out of the cache per step
  (`attention.bucketed_decode_attention`) it takes 2.7-3.4x less attention time per
  step at 32-64 decode rows (benchmarks/bench_attention.py);
- `rope_store`, `add_rms_norm_`, `silu_mul`: a decoder layer's elementwise steps,
  one pass each, with the eager ops' roundings (`layers.CausalLM._fused_forward`);
- `decoder` / `decoder_forward`: a Llama-layout model's layers in one call from C++, the ops above
  and the projections below in `_fused_forward`'s order (its bits), without ~10 Python calls a layer;
- `argmax_logsumexp`: the sampler's greedy pick and logprob normaliser, one pass;
- `pack_linear_weight` / `packed_linear`: fp32 projections (AVX-512 or AVX2 + FMA, the same bits)
  over weights packed at load (`projections.Linear(kernel=True)`, where `probes.kernel_pays`), batch-invariant;
- `pack_block_codes` / `block_linear`: the same products for weights that are exactly GGUF
  block codes (Q4_1, Q4_0, Q8_0 dequantized at load), kept as GGUF keeps them (4-bit codes two a
  byte, Q8_0's one a byte, fp16 d and m): Q4_1 reads 0.625 bytes a weight, a sixth of the panels';
- `pack_bf16_weight` / `bf16_linear`: bf16 projections with AVX512_BF16's vdpbf16ps (CPUs that have
  it, `bf16_linear_available`), fp32 sums, batch-invariant;
- `pack_bf16_block_codes` / `bf16_block_linear`: the same products for a bf16 model whose fp32
  weights are exactly GGUF block codes, each weight rounded to bf16 as the kernel goes:
  `bf16_linear`'s bits over the weights in bf16, at every number of rows, from the codes' bytes.

The vector code is written once over `csrc/vec.h` (AVX-512 or AVX2 + FMA + F16C); other
CPUs get the portable scalar paths.

They are built once per machine with the host's C++ compiler
(`torch.utils.cpp_extension`, -O3 -march=native, 6-35 s by the machine) into tercet's cache
(`~/.cache/tercet/kernels`, see `loading.cache_root`), named by a digest of
the sources, flags, torch version and CPU flags, and loaded from there by
later processes: only a build this user's alone (`private_cache`; else it is
built again, in a private directory where the cache is not), and a build that
does not load (truncated, corrupt) is built again. Where they cannot be built
(no compiler) `load()` logs why once and returns False; the runner then keeps the torch path.
`TERCET_CPU_KERNELS=0` turns them off; `TERCET_CPU_MARCH=x86-64-v3` builds them for an older target
than this CPU (-march=native otherwise), which the tests use to run the AVX2 paths on an AVX-512 host.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .loading import cache_root
from .private_cache import CacheNotPrivate, private_dir, why_untrusted

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))  # every file of csrc/ (the package data): one library, one digest
HEADERS = sorted(CSRC.glob("*.h"))
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]  # no fused a*b+c: the eager ops round each
MARCH_ENV = "TERCET_CPU_MARCH"  # another target than this CPU (tests: x86-64-v3, the AVX2 paths on an AVX-512 host)


def cflags() -> list[str]:
    """CFLAGS with `-march=$TERCET_CPU_MARCH` where that is set: a name of GCC's (`x86-64-v3`: AVX2 + FMA +
    F16C, the paths of such CPUs built and tested on a newer one), a ValueError naming the variable else."""
    march = os.environ.get(MARCH_ENV, "native")
    if not march or not all(c.isalnum() or c in "-_." for c in march):
        raise ValueError(f"{MARCH_ENV}={march!r}: not a -march name (such as native or x86-64-v3)")
    return [f"-march={march}" if flag == "-march=native" else flag for flag in CFLAGS]


@functools.cache
def load() -> bool:
    """Load the kernels, built first if this machine has no build yet; whether torch.ops.tercet has them."""
    if os.environ.get("TERCET_CPU_KERNELS", "1") == "0":
        log.info("tercet CPU kernels off (TERCET_CPU_KERNELS=0): the torch attention path serves")
        return False
    cflags()  # a TERCET_CPU_MARCH that is no -march name is the caller's error, not a reason to serve without them
    try:
        directory, private = _kernels_dir()
        target = directory / f"tercet_cpu_{_digest()}.so"  # (sources missing: the except)
        try:
            if not _load_cached(target):
                _build(target)
        finally:
            if private:  # loaded (the mapping stays) or failed: nothing of it is kept
                shutil.rmtree(directory, ignore_errors=True)
    except Exception as e:  # no compiler, a compile error: serve on the torch path, say why
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = next((line for line in lines if "error" in line.lower()), lines[-1])
        log.warning("tercet CPU kernels unavailable, the torch attention path serves: %s", reason.strip())
        return False
    return True


def _kernels_dir() -> tuple[Path, bool]:
    """The cache's kernel directory; where it is not this user's alone (``private_cache``), a
    fresh private one for this process only (True): another user's build is never loaded."""
    try:
        private_dir(cache_root())
        return private_dir(cache_root() / "kernels"), False
    except (CacheNotPrivate, OSError) as e:
        log.warning("not using the kernel cache (%s); building the kernels for this process only", e)
        return Path(tempfile.mkdtemp(prefix="tercet-kernels-")), True


def _load_cached(target: Path) -> bool:
    """Load the build at ``target`` if there is one, it is trusted and it loads; else remove it
    (a build someone else could have written, a truncated or corrupt file) for a rebuild."""
    if not target.exists():
        return False
    why = why_untrusted(target)
    if why is None:
        try:
            torch.ops.load_library(str(target))
        except OSError as e:  # truncated, not a library, or built against another torch
            why = f"{target} does not load ({e})"
        else:
            with contextlib.suppress(OSError):
                os.utime(target)  # in use: not pruned (`_prune`)
            return True
    log.warning("rebuilding the tercet CPU kernels: %s", why)
    target.unlink(missing_ok=True)  # (another process may have done it first)
    return False


def _build(target: Path) -> None:
    """Compile in a private scratch dir (loading the result), then publish the library atomically.

    Not torch's shared build dir: its lock file, left by a process killed mid-build (a
    supervisor's kill -9), makes every later build wait forever.
    """
    from torch.utils import cpp_extension

    _find_ninja()
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        log.info("building tercet CPU kernels (once per machine) into %s", target)
        cpp_extension.load(
            name=target.stem, sources=[str(p) for p in SOURCES], extra_cflags=cflags(),
            extra_ldflags=["-fopenmp"], build_directory=str(scratch), is_python_module=False,
            verbose=False,
        )
        built = scratch / f"{target.stem}.so"
        os.chmod(built, 0o755)  # no group or other write bit, whatever the umask: trusted when read back
        os.replace(built, target)  # readers see all of it or nothing
        _prune(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


UNUSED_S = 30 * 86400  # a build no process loaded for this long is removed at the next build


def _prune(keep: Path) -> None:
    """Remove the builds beside ``keep`` that no process loaded for ``UNUSED_S`` (older sources or
    flags). Not every other one: two torch versions, or two machines sharing the cache, would
    each remove the other's build and compile again at every start."""
    for old in keep.parent.glob("tercet_cpu_*.so"):
        try:
            if old != keep and time.time() - old.stat().st_mtime > UNUSED_S:
                old.unlink()  # a process that loaded it keeps its mapping
        except OSError:
            pass  # (another process removed it first)


def _digest() -> str:
    """Names a build by its sources, flags and the CPU it is compiled for (-march=native)."""
    h = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:
        h.update(path.read_bytes())
    h.update(" ".join(cflags()).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:12]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _find_ninja() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel's binary may not be on it."""
    if shutil.which("ninja"):
        return
    import ninja  # a dependency of tercet

    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def paged_attention(q, k_cache, v_cache, page_table, seq_of_row, lens, page_size: int, scale: float,
                    window: int | None = None, softcap: float | None = None):
    """q [T, H, D], row r against the first lens[r] keys of sequence seq_of_row[r], read through
    its row of page_table [B, P] from one layer's cache [S, KVH, D] -> [T, H, D]; decode rows and
    prefill rows (their own K/V stored first) by the same code, in splits at fixed absolute
    positions (csrc/paged_attention.cpp): a row's bits depend only on its query and its keys.
    `window`: only a row's last `window` keys; `softcap`: scores capped as softcap * tanh(s / softcap)."""
    if not window and not softcap:  # the op as it always was
        return torch.ops.tercet.paged_attention(q, k_cache, v_cache, page_table, seq_of_row, lens, page_size, scale)
    return torch.ops.tercet.paged_attention(q, k_cache, v_cache, page_table, seq_of_row, lens, page_size, scale,
                                            window or 0, softcap or 0.0)


def paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, page_size: int, scale: float):
    """q [B, H, D], one decode row per sequence, against each row's pages -> [B, H, D]."""
    rows = torch.arange(len(q), dtype=torch.int32)
    return paged_attention(q, k_cache, v_cache, page_table, rows, context_lens, page_size, scale)


def add_rms_norm_(x, delta, weight, eps: float):
    """x += delta in place; returns weight * rms_norm(x) (both [T, N], model dtype)."""
    return torch.ops.tercet.add_rms_norm_(x, delta, weight, eps)


def silu_mul(gate_up):
    """[T, 2N] = [gate | up] -> silu(gate) * up [T, N]."""
    return torch.ops.tercet.silu_mul(gate_up)


def rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads: int, kv_heads: int):
    """qkv [T, heads + 2 kv_heads, D]: rotates q and k (cos/sin [T, D]), stores k and v at cache
    rows `slots`; returns the rotated q [T, heads, D] and k [T, kv_heads, D]."""
    return torch.ops.tercet.rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)


def argmax_logsumexp(logits):
    """logits [B, V] (fp32, bf16 or fp16) -> (the first index of each row's maximum [B] int64, fp32 logsumexp [B], NaN for a row
    holding a NaN: the runner's NaN check reads it); one thread per row, so a row's results do not depend on
    the other rows."""
    return torch.ops.tercet.argmax_logsumexp(logits)


def pack_linear_weight(weight):
    """fp32 W [N, K] -> panels of 16 output columns [ceil(N/16), K, 16], for `packed_linear`."""
    return torch.ops.tercet.pack_linear_weight(weight)


def packed_linear(x, packed, out_features: int, bias=None):
    """fp32 x [M, K] W^T (+ bias) -> [M, out_features], each output summed over k in order (batch-invariant)."""
    return torch.ops.tercet.packed_linear(x, packed, out_features, bias)


def packed_linear_available() -> bool:
    """Whether the kernels are loaded and were built with the fp32 projection kernel (AVX-512 or AVX2 + FMA)."""
    return load() and torch.ops.tercet.packed_linear_available()


def pack_block_codes(weight, compact: bool = True):
    """fp32 W [N, K] -> [codes [P, K / per byte, 16], scales [P, K/32, 16], offsets [P, K/32, 16]]
    where every block of 32 weights of a row is exactly float(code) * scale + offset (a weight
    dequantized from GGUF's Q4_1, Q4_0 or Q8_0), else [] (see csrc/gemm.cpp). Codes: two a byte
    where all fit 4 bits (uint8 0..15, int8 -8..7), else int8; scales and offsets fp16 where all are
    exactly fp16, else fp32. `compact=False`: int8 codes, fp32 scales (the layout before nibbles)."""
    return torch.ops.tercet.pack_block_codes(weight, compact)


def octet_codes_preferred() -> bool:
    """Whether this build's `block_linear` reads 0..15 codes faster as octets (`octet_codes`): AVX2."""
    return load() and torch.ops.tercet.octet_codes_preferred()


def octet_codes(codes, scales, offsets) -> list:
    """`pack_block_codes`' 0..15 nibbles [P, K/2, 16] uint8 with fp16 d, m -> [octets [P, K/8, 16]
    int32, scales, offsets]: the same bytes. Per panel and block g of 32 k, row 4g + j's lane l holds
    the codes of k = 32g + 4t + j (t = 0..7) in its bits 4t..4t + 3; the panels go in pairs (2q,
    2q + 1; a last odd one alone), per block the pair's rows panel after panel, and the d and m the
    same way (so a one-row product reads each as one stream: csrc/gemm.cpp). For `block_linear` on a
    build where `octet_codes_preferred`."""
    return torch.ops.tercet.octet_codes(codes, scales, offsets)


def block_linear(x, codes, scales, offsets, out_features: int, bias=None):
    """`packed_linear` over weights kept as block codes (any layout of `pack_block_codes`): the same
    bits, 6.4x fewer bytes read for Q4_1."""
    return torch.ops.tercet.block_linear(x, codes, scales, offsets, out_features, bias)


def pack_i8_codes(codes, scales, offsets) -> list:
    """`pack_block_codes`' compact codes (0..15 nibbles uint8 [P, K/2, 16] or int8 [P, K, 16]) -> the layout of
    `i8_block_linear`: panels of 8 outputs, a block's codes as 8 steps of 4 k ([P8, K/32, 128] uint8 nibbles or
    [P8, K/32, 256] int8; scales and offsets [P8, K/32, 8]); [] for codes it does not take (signed nibbles, octets,
    an int8 code of -128). See csrc/gemm_i8.cpp."""
    return torch.ops.tercet.pack_i8_codes(codes, scales, offsets)


def i8_block_linear(x, codes, scales, offsets, out_features: int, bias=None):
    """x [M, K] (fp32 or bf16) W^T (+ bias) with each row of x rounded to int8 codes per block of 32 k (one fp32
    scale a block, as llama.cpp's Q8_1 activations): exact integer products a block, one fp32 sum per output over
    the blocks in order; a row's bits do not depend on the batch. Not the exact path's bits: the int8 mode only."""
    return torch.ops.tercet.i8_block_linear(x, codes, scales, offsets, out_features, bias)


def i8_block_linear_reference(x, codes, scales, offsets, out_features: int, bias=None):
    """`i8_block_linear` through its scalar path (the vector path's bits; tests)."""
    return torch.ops.tercet.i8_block_linear_reference(x, codes, scales, offsets, out_features, bias)


def quantize_rows_i8(x) -> list:
    """fp32 x [M, K] -> [codes int8 [M, K], dx [M, K/32], sx [M, K/32]]: per block of 32 k, dx = amax / 127,
    codes = nearest(x * 127 / amax), sx = dx * sum(codes); a block with an inf or NaN: codes 0, dx = sx = NaN."""
    return torch.ops.tercet.quantize_rows_i8(x)


def i8_vector_build() -> bool:
    """Whether `i8_block_linear` has its AVX2 path in this build (else the scalar one serves, the same bits)."""
    return load() and torch.ops.tercet.i8_vector_build()


def pack_bf16_weight(weight):
    """bf16 W [N, K] -> panels of 16 output columns, k in pairs [ceil(N/16), ceil(K/2), 32] bf16, for
    `bf16_linear` (packs on any CPU; see csrc/gemm_bf16.cpp)."""
    return torch.ops.tercet.pack_bf16_weight(weight)


def bf16_linear(x, packed, out_features: int, bias=None):
    """bf16 x [M, K] W^T (+ bias, bf16 or fp32 [out_features]) -> bf16 [M, out_features]: each output one
    fp32 sum over the k pairs in order (vdpbf16ps), the bias added in fp32, rounded to bf16 once; a row's
    bits do not depend on the batch. Raises where `bf16_linear_available()` is False."""
    return torch.ops.tercet.bf16_linear(x, packed, out_features, bias)


def pack_bf16_block_codes(weight):
    """`pack_block_codes(weight)` for `bf16_block_linear`, or []: the same scales and offsets, and
    each pair of k (2i, 2i + 1) of a panel's codes in the order vdpbf16ps takes the bf16 weights,
    as 32 lanes: columns 0-7 then 8-15, lane j column j // 2 (+ 8) at k = 2i + j % 2. Nibbles
    [P, K/2, 16]: lane j of the first half in byte j's low nibble, of the second in its high one;
    bytes [P, K, 16]: the two halves one after the other. In tile numerics (`bf16_tile_numerics`)
    the k of each 4 are first taken as (k + 2, k, k + 3, k + 1): the pairs of its two chains; and
    nibbles go in column blocks instead (`_column_blocks`)."""
    found = pack_block_codes(weight)
    return [bf16_pair_order(found[0], weight.shape[1]), *found[1:]] if found else []


def _chain_order(k: int) -> torch.Tensor | None:
    """The k of the tile numerics' pairs (k + 2, k), (k + 3, k + 1) for each 4, or None (vdpbf16ps's numerics)."""
    if not bf16_tile_numerics():
        return None
    return torch.arange(k).view(-1, 4)[:, [2, 0, 3, 1]].flatten()


def _column_blocks(fields: torch.Tensor) -> torch.Tensor:
    """4-bit codes [P, K, 16] (0..15, k then column) in the tile numerics' column blocks (csrc/gemm_bf16.cpp,
    decode_rows): per panel and 32-k block 4 quads of 32 16-bit words, word l of quad c holding columns
    4c .. 4c + 3 at k = 32 g + l in its bits 0-3, 4-7, 8-11, 12-15; as bytes [P, K/2, 16]."""
    panels, k = fields.shape[:2]
    f = fields.int().view(panels, k // 32, 32, 4, 4)  # [P, g, l, c, s]: column 4c + s
    words = (f[..., 0] | (f[..., 1] << 4) | (f[..., 2] << 8) | (f[..., 3] << 12)).permute(0, 1, 3, 2)  # [P, g, c, l]
    return torch.stack([words & 255, words >> 8], dim=-1).to(torch.uint8).reshape(panels, k // 2, 16)


def _column_fields(raw: torch.Tensor, k: int) -> torch.Tensor:
    """`_column_blocks`' inverse: bytes [P, K/2, 16] -> the 4-bit fields [P, K, 16] (0..15)."""
    panels = len(raw)
    b = raw.view(torch.uint8).int().view(panels, k // 32, 4, 32, 2)
    words = b[..., 0] | (b[..., 1] << 8)  # [P, g, c, l]
    fields = torch.stack([(words >> (4 * s)) & 15 for s in range(4)], dim=-1)  # [P, g, c, l, s]
    return fields.permute(0, 1, 3, 2, 4).reshape(panels, k, 16)


def bf16_pair_order(codes, k: int):
    """`pack_block_codes`' codes (any of its layouts) in `pack_bf16_block_codes`' order, the same dtype and shape."""
    order = _chain_order(k)
    if codes.shape[1] == k:  # one a byte: the bytes moved
        if order is not None:
            codes = codes[:, order]
        return codes.reshape(len(codes), k // 2, 2, 2, 8).permute(0, 1, 3, 4, 2).reshape(codes.shape).contiguous()
    raw = codes.view(torch.uint8)  # two a byte: the 4-bit fields moved as they are (a sign stays in its nibble)
    fields = torch.stack([raw & 15, raw >> 4], dim=2).flatten(1, 2)  # [P, K, 16]: k = 2i low, 2i + 1 high
    if order is not None:  # tile numerics: column blocks
        return _column_blocks(fields).view(codes.dtype)
    lanes = fields.reshape(len(raw), k // 2, 2, 2, 8).permute(0, 1, 3, 4, 2).reshape(len(raw), k // 2, 2, 16)
    return (lanes[:, :, 0] | (lanes[:, :, 1] << 4)).view(codes.dtype)


def bf16_block_codes_dense(codes, k: int):
    """The codes of `pack_bf16_block_codes` back in `pack_block_codes`' order, one int a code [P, K, 16]."""
    order = _chain_order(k)
    if codes.shape[1] != k and order is not None:  # 4-bit codes in column blocks
        fields = _column_fields(codes, k)
        return (fields ^ 8) - 8 if codes.dtype == torch.int8 else fields
    if codes.shape[1] == k:
        lanes = codes.view(len(codes), k // 2, 2, 16)
    else:
        lanes = torch.stack(_nibble_halves(codes), dim=2)  # [P, K/2, 2, 16]
    dense = lanes.view(len(codes), k // 2, 2, 8, 2).permute(0, 1, 4, 2, 3).reshape(len(codes), k, 16)
    return dense if order is None else dense[:, torch.argsort(order)]


def _nibble_halves(codes):
    """Bytes of two 4-bit codes -> (low nibbles, high nibbles) as ints (int8 codes: -8..7)."""
    wide = codes.int()
    low, high = wide & 15, (wide >> 4) & 15
    if codes.dtype == torch.int8:  # two's complement nibbles
        low, high = (low ^ 8) - 8, (high ^ 8) - 8
    return low, high



def bf16_block_linear(x, codes, scales, offsets, out_features: int, bias=None):
    """`bf16_linear` over fp32 weights kept as block codes (`pack_bf16_block_codes`): bf16 x
    [M, K] -> bf16 [M, out_features] with the bits of `bf16_linear(x, pack_bf16_weight(w.bfloat16()), ...)`
    for the weights w the codes hold, whatever M. Raises where `bf16_linear_available()` is False."""
    return torch.ops.tercet.bf16_block_linear(x, codes, scales, offsets, out_features, bias)


def bf16_linear_silu(x, packed, out_features: int, bias=None):
    """`silu_mul(bf16_linear(x, packed, out_features, bias))` bit for bit, for a gate_up weight ([gate; up],
    out_features a multiple of 32): where AMX's tiles serve, each tile pass takes gate's and up's panel of
    the same 16 columns, and the [M, out_features] product is never stored. -> bf16 [M, out_features / 2]"""
    return torch.ops.tercet.bf16_linear_silu(x, packed, out_features, bias)


def bf16_block_linear_silu(x, codes, scales, offsets, out_features: int, bias=None):
    """`silu_mul(bf16_block_linear(...))` bit for bit, as `bf16_linear_silu` over block codes."""
    return torch.ops.tercet.bf16_block_linear_silu(x, codes, scales, offsets, out_features, bias)


def decoder(heads: int, kv_heads: int, head_dim: int, eps: float, scale: float):
    """An empty C++ decoder (`csrc/decoder.cpp`): a Llama-layout model's layers in one call, filled by
    its `add_layer` and `add_projection` (`layers.CausalLM._make_decoder`)."""
    return torch.classes.tercet.Decoder(heads, kv_heads, head_dim, eps, scale)


def decoder_forward(decoder, x, h, cos, sin, k_cache, v_cache, slots, page_table, row_seq, row_lens,
                    page_size: int):
    """Every layer of `decoder` over the residual x [T, hidden] (updated in place) from h, the first
    layer's normed input, K/V stored and attended through `paged_attention`'s tables: the hidden
    states after the final norm, the bits of `layers.CausalLM._fused_forward`."""
    return torch.ops.tercet.decoder_forward(decoder, x, h, cos, sin, k_cache, v_cache, slots, page_table, row_seq,
                                            row_lens, page_size)


def bf16_tile_numerics() -> bool:
    """Whether the bf16 kernels sum as AMX's TDPBF16PS does (builds for CPUs with AMX-BF16,
    csrc/gemm_bf16.cpp's "Tile numerics"): panels of whole 32-k blocks, products of many rows through the tiles."""
    return load() and torch.ops.tercet.bf16_tile_numerics()


def bf16_amx_serves() -> bool:
    """Whether AMX's tiles serve the bf16 products of many rows (tile numerics, and Linux lent the tiles)."""
    return load() and torch.ops.tercet.bf16_amx_serves()


def bf16_linear_available() -> bool:
    """Whether the kernels are loaded and were built with the AVX512_BF16 kernel (the CPU has avx512_bf16)."""
    return load() and torch.ops.tercet.bf16_linear_available()

// bf16 projections y = x W^T (+ b) with AVX512_BF16's vdpbf16ps, W prepacked once at load.
//
// Why: oneDNN's bf16 GEMM (the default dtype's projections on CPUs with bf16 units) switches
// algorithm with the number of rows, so a row's bits depend on the batch; this kernel does not.
//
// Layout: W [N, K] bf16 is packed into panels of 16 output columns with k in pairs, interleaved as
// vdpbf16ps reads them: [ceil(N/16), ceil(K/2), 16, 2] (a zero weight pads an odd K, zero columns
// the last panel). A register block is kRows rows of y by kPanels panels (8 x 48 in 24 zmm) while
// k runs over K in pairs: each step loads the panels' 32-weight vectors at one pair and broadcasts
// each row's pair of inputs.
//
// Each output is one fp32 accumulator fed the k pairs (0, 1), (2, 3), ... in order, one vdpbf16ps
// per pair, whatever the number of rows, the blocking or the threads: a row's result does not
// depend on the batch (batch-invariant). The bias is added in fp32 and the sum rounded to bf16
// once (to nearest even). vdpbf16ps treats denormal inputs as zero and flushes denormal results.
//
//   pack_bf16_weight(w [N, K] bf16) -> packed [ceil(N/16), ceil(K/2), 32] bf16
//   bf16_linear(x [M, K] bf16, packed, n, bias? [n] bf16 or fp32) -> y [M, n] bf16
//   bf16_linear_available() -> whether this build has the kernel (the CPU has AVX512_BF16)
//
// Block codes: a bf16 model whose fp32 weights (a GGUF's, dequantized at load) are exactly block
// codes (csrc/gemm.cpp's pack_block_codes: per row and 32 k, float(q) * d + m) keeps them so, and
// bf16_block_linear rebuilds, as it goes, the very bf16 weights that pack_bf16_weight(w.to(bf16))
// holds: each w rebuilt in fp32 as block_linear does (the same bits), rounded to bf16 to nearest
// even as torch's conversion does, laid in the panels' pairs. They go through the same vdpbf16ps,
// one accumulator per output fed the k pairs in order, and the same rounding of the sum: y has the
// bits of bf16_linear over those panels at every number of rows. Up to kDirectRows rows it
// rebuilds the weights in registers (Q4_1: 0.625 bytes a weight read instead of the panels' 2);
// from more rows on it decodes each panel once per kCodeBlockRows rows into a per-thread buffer
// in the panels' layout and runs the panel kernel's blocks over it. (In tile numerics 4-bit codes
// are kept in column blocks instead and up to kFewRows rows go through the tiles with the weights
// as A, each column's block of weights looked up in a table of its 16: "Few rows" below.)
// The rounding: with fp16 d and m every rebuilt w is 0 or a multiple of 2^-24, never an fp32
// denormal, so vcvtne2ps2bf16 (which would flush one) rounds as torch does; with fp32 d and m
// (a weight some block of which is not exactly fp16) the integer rounding of vec.h.
//
//   bf16_block_linear(x [M, K] bf16, codes, scales, offsets, n, bias? [n] bf16 or fp32) -> y [M, n] bf16
//
// Tile numerics (builds for CPUs with AMX-BF16, `bf16_tile_numerics()`): every output is summed as AMX's
// TDPBF16PS sums a 32-k tile instead (an even and an odd chain per block of 32 k, then c + their sum; see
// that section below), so the tiles serve products of kAmxRows rows or more straight over the panels (padded
// to whole blocks), ~2,000 GFLOP/s at 64 rows against vdpbf16ps's ~220, and vdpbf16ps reproduces the same
// bits for fewer rows and from the block codes (stored in the chains' pair order there). Both numerics are
// batch-invariant; a build has one of them (the CPU flags are in its digest). TDPBF16PS cannot take
// vdpbf16ps's order (benchmarks/results/2026-12-05-amx-tiles/), hence the other numerics.
//   bf16_tile_numerics() -> whether this build sums so; bf16_amx_serves() -> and Linux lent it the tiles

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>


#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "block_codes.h"
#include "share.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TERCET_BF16_GEMM 1
#else
#define TERCET_BF16_GEMM 0
#endif
#if TERCET_BF16_GEMM && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TERCET_TILE_NUMERICS 1  // (see "Tile numerics" below)
#include <sys/syscall.h>
#include <unistd.h>
#else
#define TERCET_TILE_NUMERICS 0
#endif

namespace {

constexpr int64_t kPanel = 16;      // output columns per panel
constexpr int kRows = 8;            // rows per register block
constexpr int kPanels = 3;          // panels per register block: 8 x 3 zmm accumulators of the 32
constexpr int64_t kBlockRows = 96;  // rows whose inputs stay in L2 while the panels pass (a multiple of kRows)
// Each panel's weights are prefetched this many k pairs ahead (a line per pair): at 8 rows, where W
// streams from memory, 1.3-1.5x the hardware prefetcher alone (24 and 96 measured between). Into L2: into L1
// its few misses in flight bound the streams (bf16 panels on a Zen 4 EPYC, decode steps alternated in one
// process: 1 row 1.14x, 8 rows 1.15x, 32 rows 1.06x; the block codes' buffer at 32 rows, in L2 already, 1.006x)
constexpr int64_t kPrefetch = 48;
constexpr int64_t kGroup = 32;            // k per block of codes
constexpr int64_t kCodeBlockRows = 384;   // rows per pass of the buffer path: each pass decodes every panel once
constexpr int64_t kDirectRows = kRows;    // products of up to this many rows rebuild the weights in registers
// pairs of the packed weights: whole 32-k blocks (zero pairs after K) in tile numerics
constexpr int64_t kPairAlign = TERCET_TILE_NUMERICS ? 16 : 1;
constexpr int64_t aligned_pairs(int64_t pairs) { return (pairs + kPairAlign - 1) / kPairAlign * kPairAlign; }

at::Tensor pack_bf16_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "w must be a bfloat16 CPU [N, K]");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel, pairs = aligned_pairs((k + 1) / 2);
  const auto src = w.contiguous();
  auto packed = at::zeros({panels, pairs, 2 * kPanel}, w.options());
  const auto* s = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
  auto* d = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < std::min(kPanel, n - p * kPanel); ++j)
        for (int64_t i = 0; i < k; ++i) d[((p * pairs + i / 2) * kPanel + j) * 2 + i % 2] = s[(p * kPanel + j) * k + i];
  });
  return packed;
}

#if TERCET_BF16_GEMM
// The R x P accumulators of a block to R rows of y (stride ldc), cols of them: + bias in fp32, rounded
// to bf16 once (to nearest even).
template <int R, int P>
inline void store_rows(const __m512 (&c)[R][P], c10::BFloat16* y, int64_t ldc, int64_t cols, const float* bias) {
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P && p * kPanel < cols; ++p) {
      __m512 v = c[r][p];
      c10::BFloat16* out = y + r * ldc + p * kPanel;
      if (cols >= (p + 1) * kPanel) {
        if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p * kPanel));
        vec::store(out, v);
      } else {
        alignas(64) float row[kPanel];
        _mm512_store_ps(row, v);
        for (int64_t j = 0; j < cols - p * kPanel; ++j)
          out[j] = c10::BFloat16(bias != nullptr ? row[j] + bias[p * kPanel + j] : row[j]);
      }
    }
}

// silu(gate) * up of one row's 16 columns from their sums (+ bias), with the bits of bf16_linear's rounded
// outputs passed through silu_mul (csrc/fused_ops.cpp's vector path: gate and up rounded to bf16, silu in
// fp32 rounded to bf16, times up, rounded once more)
inline void silu_store(__m512 gate, __m512 up, const float* bias_gate, const float* bias_up, c10::BFloat16* out) {
  if (bias_gate != nullptr) gate = _mm512_add_ps(gate, _mm512_loadu_ps(bias_gate));
  if (bias_up != nullptr) up = _mm512_add_ps(up, _mm512_loadu_ps(bias_up));
  const __m512 a = vec::round_bf16(gate), u = vec::round_bf16(up);
  const __m512 silu = vec::div(a, vec::add(vec::set1(1.f), vec::exp(vec::sub(vec::zero(), a))));
  vec::store(out, vec::mul(vec::round_bf16(silu), u));
}

// R rows of x (each its pairs of inputs as 32-bit words, rows ldx words apart) against P
// consecutive panels (stride pairs * 32): y[r, 0:cols] (stride ldc) = round(x_r . panels + bias).
template <int R, int P>
void block(const uint32_t* x, int64_t ldx, const uint16_t* panel, int64_t pairs, c10::BFloat16* y, int64_t ldc,
           int64_t cols, const float* bias) {
  const uint32_t* xr[R];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) xr[r] = x + r * ldx;
  __m512 c[R][P];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) c[r][p] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh b[P];
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) {
      b[p] = (__m512bh)_mm512_loadu_si512(panel + (p * pairs + i) * 2 * kPanel);
      _mm_prefetch(reinterpret_cast<const char*>(panel + (p * pairs + i + kPrefetch) * 2 * kPanel), _MM_HINT_T1);
    }
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][i]));
#pragma GCC unroll 32
      for (int p = 0; p < P; ++p) c[r][p] = _mm512_dpbf16_ps(c[r][p], a, b[p]);
    }
  }
  store_rows<R, P>(c, y, ldc, cols, bias);
}

using BlockFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, c10::BFloat16*, int64_t, int64_t, const float*);
template <int P, int... R>
constexpr std::array<BlockFn, kRows> blocks_of(std::integer_sequence<int, R...>) {
  return {&block<R + 1, P>...};
}
template <int... P>
constexpr std::array<std::array<BlockFn, kRows>, kPanels> all_blocks(std::integer_sequence<int, P...>) {
  return {blocks_of<P + 1>(std::make_integer_sequence<int, kRows>())...};
}
// kBlocks[panels - 1][rows - 1]
constexpr auto kBlocks = all_blocks(std::make_integer_sequence<int, kPanels>());

// How a weight's codes are kept (pack_block_codes): one int8 a code [P, K, 16], or two a byte
// [P, K/2, 16] (k = 2i low nibble, 2i + 1 high): 0..15 (uint8) or -8..7 (int8)
enum class Codes { kBytes, kNibbles, kSignedNibbles };
constexpr int64_t per_byte(Codes c) { return c == Codes::kBytes ? 1 : 2; }

// One panel's codes at pair i (k = 2i, 2i + 1) as floats, exactly, in the panels' pair order: lo
// = columns 0-7 [(0, 2i), (0, 2i + 1), (1, 2i), ...], hi = columns 8-15. The codes are in that
// order already (cpu_kernels.pack_bf16_block_codes): nibbles, lane j of lo in byte j's low nibble
// and of hi in its high one; bytes, lo's 16 then hi's.
template <Codes C>
inline void pair_codes(const uint8_t* q, int64_t i, __m512& lo, __m512& hi) {
  if constexpr (C == Codes::kBytes) {
    const auto* p = reinterpret_cast<const int8_t*>(q) + i * 2 * kPanel;
    lo = vec::load(p), hi = vec::load(p + kPanel);
  } else {  // each nibble's float from a table (vpermps reads only an index's low 4 bits): no mask, no
            // conversion, and the shuffle port, where the multiply-adds leave room
    const __m512 table = C == Codes::kNibbles
                             ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                             : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * kPanel)));
    lo = _mm512_permutexvar_ps(b, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
  }
}

// w = float(q) * d + m, as block_linear rebuilds it: with fp16 d, q * d is exact, so one fused
// multiply-add (rounded once) gives the bits of the two rounded ops
template <typename S>
inline __m512 rebuild(__m512 q, __m512 d, __m512 m) {
  if constexpr (std::is_same_v<S, c10::Half>) {
    return _mm512_fmadd_ps(q, d, m);
  } else {
    return _mm512_add_ps(_mm512_mul_ps(q, d), m);
  }
}

// fp32 weights (lo: the first 16 of a panel's pair, hi: the last 16) rounded to bf16 to nearest
// even, as torch's conversion: 32 bf16 in the panels' order. fp16 d, m: no w is an fp32 denormal
// (see the top), so vcvtne2ps2bf16's flush never applies.
template <typename S>
inline __m512bh to_bf16(__m512 lo, __m512 hi) {
  if constexpr (std::is_same_v<S, c10::Half>) {
    return _mm512_cvtne2ps_pbh(hi, lo);
  } else {
    const __m512i l = _mm512_srli_epi32(_mm512_castps_si512(vec::round_bf16(lo)), 16);
    const __m512i h = _mm512_srli_epi32(_mm512_castps_si512(vec::round_bf16(hi)), 16);
    return (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(l)), _mm512_cvtepi32_epi16(h), 1);
  }
}

// A group's d or m of one panel (16 columns) as two fp32 vectors in pair order: [d0, d0, d1, d1, ...]
template <typename S>
inline void pair_scales(const S* s, __m512& lo, __m512& hi) {
  const __m512 v = vec::load(s);
  lo = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), v);
  hi = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), v);
}

// One panel's 32 bf16 weights at pair i of group g's d and m (pair order, dm: d lo, d hi, m lo, m hi)
template <Codes C, typename S>
inline __m512bh pair_weights(const uint8_t* q, int64_t i, const float* dm) {
  __m512 lo, hi;
  pair_codes<C>(q, i, lo, hi);
  lo = rebuild<S>(lo, _mm512_load_ps(dm), _mm512_load_ps(dm + 32));
  hi = rebuild<S>(hi, _mm512_load_ps(dm + 16), _mm512_load_ps(dm + 48));
  return to_bf16<S>(lo, hi);
}

template <typename S>
inline void store_pair_scales(const S* d, const S* m, float* dm) {
  __m512 lo, hi;
  pair_scales(d, lo, hi);
  _mm512_store_ps(dm, lo), _mm512_store_ps(dm + 16, hi);
  pair_scales(m, lo, hi);
  _mm512_store_ps(dm + 32, lo), _mm512_store_ps(dm + 48, hi);
}

// `count` consecutive panels' bf16 weights from their codes, in pack_bf16_weight's layout, into buf [count, pairs, 32]
template <Codes C, typename S>
void decode_panels(const uint8_t* codes, const S* scales, const S* offsets, int64_t pairs, int64_t count,
                   uint16_t* buf) {
  const int64_t k = 2 * pairs, groups = k / kGroup;
  for (int64_t p = 0; p < count; ++p) {
    const uint8_t* q = codes + p * (k / per_byte(C)) * kPanel;
    for (int64_t g = 0; g < groups; ++g) {
      alignas(64) float dm[64];
      store_pair_scales(scales + (p * groups + g) * kPanel, offsets + (p * groups + g) * kPanel, dm);
      for (int64_t i = g * kGroup / 2; i < (g + 1) * kGroup / 2; ++i)
        _mm512_storeu_si512(buf + (p * pairs + i) * 2 * kPanel, (__m512i)pair_weights<C, S>(q, i, dm));
    }
  }
}

// R rows (as block's x) against P panels straight from their codes, no buffer: each output one
// vdpbf16ps per k pair in order, as block's. Panels past `count` repeat panel 0 (computed, not stored).
// As each group of the panels is read, the same group of the next P panels (the next call's) is asked for into
// L2, its codes and its d and m: the hardware's prefetchers alone left the P streams waiting on memory (the exact
// bf16 default's decode steps on a Zen 4 EPYC, alternated in one process: 1 row 1.14x, 4 rows 1.12x; processes
// alternated, 8 rows 1.11-1.16x; the codes into L1 instead, 0.99x: L1's few misses in flight bound the streams).
// Past the last panel it may ask for addresses outside the weights: a prefetch never faults.
template <int R, int P, Codes C, typename S>
void direct(const uint32_t* x, int64_t ldx, const uint8_t* codes, const S* scales, const S* offsets, int64_t pairs,
            int64_t count, c10::BFloat16* y, int64_t ldc, int64_t cols, const float* bias) {
  const int64_t k = 2 * pairs, groups = k / kGroup, code_bytes = (k / per_byte(C)) * kPanel;
  const block_codes::Panels<P, S> at(codes, scales, offsets, code_bytes, groups, count);
  constexpr int64_t kGroupBytes = kGroup / 2 * kPanel * 2 / per_byte(C);  // a panel's codes of one group
  __m512 c[R][P];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) c[r][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) {  // (the next P panels: P code_bytes on, P groups of scales on)
      const char* next = reinterpret_cast<const char*>(at.q[p] + P * code_bytes + g * kGroupBytes);
      for (int64_t l = 0; l < kGroupBytes; l += 64) _mm_prefetch(next + l, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(at.d[p] + (P * groups + g) * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(at.m[p] + (P * groups + g) * kPanel), _MM_HINT_T1);
    }
    alignas(64) float dm[P][64];  // this group's d and m of each panel, fp32, in pair order
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) store_pair_scales(at.d[p] + g * kPanel, at.m[p] + g * kPanel, dm[p]);
#pragma GCC unroll 2
    for (int64_t i = g * kGroup / 2; i < (g + 1) * kGroup / 2; ++i) {
      __m512bh b[P];
#pragma GCC unroll 32
      for (int p = 0; p < P; ++p) b[p] = pair_weights<C, S>(at.q[p], i, dm[p]);
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + i]));
#pragma GCC unroll 32
        for (int p = 0; p < P; ++p) c[r][p] = _mm512_dpbf16_ps(c[r][p], a, b[p]);
      }
    }
  }
  store_rows<R, P>(c, y, ldc, cols, bias);
}

// Panels per call of the direct path, by rows: at one and two rows 6 (SmolLM2's widths are multiples
// of 96 columns: 6 panels split them evenly between two threads; 2, 4 and 8 measured slower on an
// AVX512-BF16 Xeon), from three on a block's 3
constexpr int direct_panels(int rows) { return rows <= 2 ? 6 : kPanels; }

template <Codes C, typename S>
using DirectFn = void (*)(const uint32_t*, int64_t, const uint8_t*, const S*, const S*, int64_t, int64_t,
                          c10::BFloat16*, int64_t, int64_t, const float*);
template <Codes C, typename S, int... R>
constexpr std::array<DirectFn<C, S>, kDirectRows> directs_of(std::integer_sequence<int, R...>) {
  return {&direct<R + 1, direct_panels(R + 1), C, S>...};
}
// kDirect<C, S>[rows - 1]
template <Codes C, typename S>
constexpr auto kDirect = directs_of<C, S>(std::make_integer_sequence<int, kDirectRows>());
#endif

#if TERCET_TILE_NUMERICS
// ---- Tile numerics (builds for CPUs with AMX-BF16) ----
//
// Per output, over K in blocks of 32 (16 pairs; the panels are padded with zero pairs to whole blocks):
// two chains from +0, one over the block's even k and one over its odd k, each product added with one
// rounding (vdpbf16ps's and TDPBF16PS's adds: denormal inputs read as zero, denormal sums flushed), then
// c = ftz(c + ftz(even + odd)). That is what one TDPBF16PS of a 32-k tile computes for every output
// (benchmarks/results/2026-12-05-amx-tiles/), so AMX's tiles serve products of many rows in place over
// the panels; vdpbf16ps reproduces it exactly for few rows (and from the block codes): a pair of inputs
// (k + 2, k) gives the even chain's steps k, k + 2 (vdpbf16ps adds its odd element's product first),
// (k + 3, k + 1) the odd chain's. Either way a row's bits depend only on its own inputs.

constexpr int64_t kBlockPairs = 16;  // pairs per 32-k block (one tile's K)
constexpr int64_t kAmxRows = 4;      // products of this many rows or more through the tiles (where AMX is permitted)
// rows whose inputs stay in L2 while the panels pass (each unit decoded from codes once per block of rows: 512,
// not 256, took SmolLM2's decoder projections at 512 and 2048 rows from 92.3 and 335 ms to 85.7 and 317)
constexpr int64_t kTnBlockRows = 512;

inline __m512 ftz(__m512 v) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(0x1p-126f), _CMP_LT_OQ);
  return _mm512_mask_and_ps(v, tiny, v, _mm512_set1_ps(-0.f));
}

// The even and odd chains' weight vectors from two consecutive pair rows a (k, k + 1) and b (k + 2, k + 3)
// of a panel: per column, even = (w[k + 2], w[k]) and odd = (w[k + 3], w[k + 1]) as vdpbf16ps pairs
inline void chains_of(__m512i a, __m512i b, __m512bh& even, __m512bh& odd) {
  even = (__m512bh)_mm512_mask_blend_epi16(0xAAAAAAAA, b, _mm512_slli_epi32(a, 16));
  odd = (__m512bh)_mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(b, 16), a);
}

// The pair rows a (k, k + 1) and b (k + 2, k + 3) back from the chains' vectors (chains_of's inverse)
inline void pairs_of_chains(__m512i even, __m512i odd, __m512i& a, __m512i& b) {
  a = _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(even, 16), odd);
  b = _mm512_mask_blend_epi16(0xAAAAAAAA, even, _mm512_slli_epi32(odd, 16));
}

// A row's inputs for the same steps from its pairs words a (k, k + 1) and b (k + 2, k + 3)
inline __m512bh even_input(uint32_t a, uint32_t b) {
  return (__m512bh)_mm512_set1_epi32(static_cast<int>((b & 0xffffu) | (a << 16)));
}
inline __m512bh odd_input(uint32_t a, uint32_t b) {
  return (__m512bh)_mm512_set1_epi32(static_cast<int>((b >> 16) | (a & 0xffff0000u)));
}

// R rows (x as pairs words, ldx apart) against P consecutive panels (weights from `weights(p, i)`, pair row i of
// panel p as a 32-bf16 vector; CHAINED: rows 2q and 2q + 1 are the even and the odd chain's vectors already):
// c[r][p] in tile numerics
template <int R, int P, bool CHAINED, typename Weights, typename BeginBlock>
inline void tile_chains(const uint32_t* x, int64_t ldx, int64_t pairs, __m512 (&c)[R][P], Weights weights,
                        BeginBlock begin_block) {
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) c[r][p] = _mm512_setzero_ps();
  for (int64_t i0 = 0; i0 < pairs; i0 += kBlockPairs) {
    begin_block(i0);
    __m512 e[R][P], o[R][P];
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
      for (int p = 0; p < P; ++p) e[r][p] = o[r][p] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t i = i0; i < i0 + kBlockPairs; i += 2) {
      __m512bh we[P], wo[P];
#pragma GCC unroll 32
      for (int p = 0; p < P; ++p) {
        if constexpr (CHAINED) {
          we[p] = (__m512bh)weights(p, i), wo[p] = (__m512bh)weights(p, i + 1);
        } else {
          chains_of(weights(p, i), weights(p, i + 1), we[p], wo[p]);
        }
      }
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) {
        const uint32_t a = x[r * ldx + i], b = x[r * ldx + i + 1];
        const __m512bh xe = even_input(a, b), xo = odd_input(a, b);
#pragma GCC unroll 32
        for (int p = 0; p < P; ++p) {
          e[r][p] = _mm512_dpbf16_ps(e[r][p], xe, we[p]);
          o[r][p] = _mm512_dpbf16_ps(o[r][p], xo, wo[p]);
        }
      }
    }
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
      for (int p = 0; p < P; ++p) c[r][p] = ftz(_mm512_add_ps(c[r][p], ftz(_mm512_add_ps(e[r][p], o[r][p]))));
  }
}

constexpr int kTnRows = 4;    // rows per register block of the vdpbf16ps path (3 accumulators an output)
constexpr int kTnPanels = 2;  // panels per unit (the tiles' 32 columns)

// R rows against P panels of packed weights (stride pairs * 32) by vdpbf16ps, tile numerics
template <int R, int P>
void block_tn(const uint32_t* x, int64_t ldx, const uint16_t* panel, int64_t pairs, c10::BFloat16* y, int64_t ldc,
              int64_t cols, const float* bias) {
  __m512 c[R][P];
  tile_chains<R, P, false>(
      x, ldx, pairs, c, [&](int p, int64_t i) { return _mm512_loadu_si512(panel + (p * pairs + i) * 2 * kPanel); },
      [](int64_t) {});
  store_rows<R, P>(c, y, ldc, cols, bias);
}

using BlockTnFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, c10::BFloat16*, int64_t, int64_t,
                           const float*);
template <int P, int... R>
constexpr std::array<BlockTnFn, kTnRows> tn_blocks_of(std::integer_sequence<int, R...>) {
  return {&block_tn<R + 1, P>...};
}
// kTnBlocks[panels - 1][rows - 1]
constexpr std::array<std::array<BlockTnFn, kTnRows>, kTnPanels> kTnBlocks = {
    tn_blocks_of<1>(std::make_integer_sequence<int, kTnRows>()),
    tn_blocks_of<2>(std::make_integer_sequence<int, kTnRows>())};

// R rows against P panels straight from their block codes (a block of 32 k is a group of codes: its d and m
// set up at the block's start; the codes in the chains' order, pack_bf16_block_codes), tile numerics. Panels past `count` repeat panel 0 (computed, not stored).
template <int R, int P, Codes C, typename S>
void direct_tn(const uint32_t* x, int64_t ldx, const uint8_t* codes, const S* scales, const S* offsets,
               int64_t pairs, int64_t count, c10::BFloat16* y, int64_t ldc, int64_t cols, const float* bias) {
  const int64_t k = 2 * pairs, groups = k / kGroup;
  const block_codes::Panels<P, S> at(codes, scales, offsets, (k / per_byte(C)) * kPanel, groups, count);
  alignas(64) float dm[P][64];  // the block's d and m of each panel, fp32, in pair order
  __m512 c[R][P];
  tile_chains<R, P, true>(
      x, ldx, pairs, c, [&](int p, int64_t i) { return (__m512i)pair_weights<C, S>(at.q[p], i, dm[p]); },
      [&](int64_t i0) {
        const int64_t g = i0 / kBlockPairs;
#pragma GCC unroll 32
        for (int p = 0; p < P; ++p) store_pair_scales(at.d[p] + g * kPanel, at.m[p] + g * kPanel, dm[p]);
      });
  store_rows<R, P>(c, y, ldc, cols, bias);
}

// 4-bit codes in column blocks (tile numerics). A column's 32 weights of one block share its d and m, so its
// codes index a table of the block's 16 weights, bf16(float(q) * d + m) for q = 0..15, one table a column: one
// vpermw gives a column's 32 bf16 weights of the block, in k order (a row of the tiles' A side, see "Few rows"
// below). Rebuilt one by one, each 32 weights took two code lookups, a multiply-add per 16 and a conversion,
// and the conversion and vdpbf16ps each hold port 5 ~2 cycles on Sapphire Rapids (they bound direct_tn).
// Layout (cpu_kernels.pack_bf16_block_codes): per panel and 32-k block, 4 quads of 32 16-bit words; word l of
// quad c holds columns 4c .. 4c + 3's codes at k = 32 g + l in its bits 0-3, 4-7, 8-11 and 12-15 (256 bytes,
// the block's bytes as before, in another order). Bytes (Q8_0) keep the chains' order.
constexpr int64_t kQuadWords = 32;
constexpr int64_t kBlockBytes = 4 * kQuadWords * 2;  // a panel's block of 4-bit codes

// One panel's 32-k block as 16 rows [16 columns][32 k] of bf16 weights (w = float(q) * d + m rounded to bf16,
// the bits pair_weights gives each) into rows
template <Codes C, typename S>
inline void decode_rows(const uint8_t* q, const S* d, const S* m, uint16_t* rows) {
  static_assert(C != Codes::kBytes, "256 codes do not make a table");
  alignas(64) float df[kPanel], mf[kPanel];
  _mm512_store_ps(df, vec::load(d));
  _mm512_store_ps(mf, vec::load(m));
  __asm__ volatile("" ::: "memory");  // (the broadcasts below read memory: not permutes on port 5)
  const __m512 codes = C == Codes::kNibbles ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                            : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  const __m512i low = _mm512_set1_epi16(0xF), second = _mm512_set1_epi16(16);
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i w = _mm512_loadu_si512(q + c * kQuadWords * 2);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // columns a and a + 1 share a vector: entries 0-15 a's table, 16-31 a + 1's
      const int a = 4 * c + 2 * h;
      const __m512 ta = rebuild<S>(codes, _mm512_set1_ps(df[a]), _mm512_set1_ps(mf[a]));
      const __m512 tb = rebuild<S>(codes, _mm512_set1_ps(df[a + 1]), _mm512_set1_ps(mf[a + 1]));
      const __m512i table = (__m512i)to_bf16<S>(ta, tb);
      const __m512i ia = _mm512_and_si512(h == 0 ? w : _mm512_srli_epi16(w, 8), low);
      const __m512i ib = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8 * h + 4), low, second, 0xEA);  // & | 16
      _mm512_storeu_si512(rows + a * 32, _mm512_permutexvar_epi16(ia, table));
      _mm512_storeu_si512(rows + (a + 1) * 32, _mm512_permutexvar_epi16(ib, table));
    }
  }
}

// 16 x 16 32-bit words transposed in registers: r[i] becomes column i
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows 0-3 with 4-7, 8-11 with 12-15
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// 16 rows of 16 32-bit words (`in` rows ld_in words apart) transposed into out (rows ld_out words apart; in place
// where out is in and the strides are equal)
inline void transpose16(const void* in, int64_t ld_in, void* out, int64_t ld_out) {
  __m512i r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(static_cast<const uint32_t*>(in) + i * ld_in);
  transpose16(r);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(static_cast<uint32_t*>(out) + i * ld_out, r[i]);
}

// `count` panels' bf16 weights from their codes (bytes in the chains' order, 4-bit codes in column blocks) in
// pack_bf16_weight's layout, into buf
template <Codes C, typename S>
void decode_panels_tn(const uint8_t* codes, const S* scales, const S* offsets, int64_t pairs, int64_t count,
                      uint16_t* buf) {
  const int64_t k = 2 * pairs, groups = k / kGroup;
  if constexpr (C != Codes::kBytes) {  // each block's rows, transposed to pair rows
    for (int64_t p = 0; p < count; ++p) {
      const uint8_t* q = codes + p * groups * kBlockBytes;
      for (int64_t g = 0; g < groups; ++g) {
        // (asked for ahead, as below: the codes 4 blocks on, the scales 8)
        for (int64_t line = 0; line < kBlockBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(q + (g + 4) * kBlockBytes + line), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(scales + (p * groups + g + 8) * kPanel), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(offsets + (p * groups + g + 8) * kPanel), _MM_HINT_T0);
        alignas(64) uint16_t rows[kPanel * 32];
        decode_rows<C, S>(q + g * kBlockBytes, scales + (p * groups + g) * kPanel, offsets + (p * groups + g) * kPanel,
                          rows);
        transpose16(rows, kPanel, buf + (p * pairs + g * kBlockPairs) * 2 * kPanel, kPanel);  // to pair rows
      }
    }
    return;
  }
  for (int64_t p = 0; p < count; ++p) {
    const uint8_t* q = codes + p * (k / per_byte(C)) * kPanel;
    for (int64_t g = 0; g < groups; ++g) {
      alignas(64) float dm[64];
      store_pair_scales(scales + (p * groups + g) * kPanel, offsets + (p * groups + g) * kPanel, dm);
      // the codes 64 pairs on (1-2 KB) and the scales 8 blocks on, asked for ahead: the loads of the codes
      // waited on memory half the time (these loops are short; the hardware's prefetch starts late on
      // each unit's stream, read between the tiles' work), 12-33 % of the decoding's time
      _mm_prefetch(reinterpret_cast<const char*>(scales + (p * groups + g + 8) * kPanel), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(offsets + (p * groups + g + 8) * kPanel), _MM_HINT_T0);
      for (int64_t i = g * kBlockPairs; i < (g + 1) * kBlockPairs; i += 2) {
        _mm_prefetch(reinterpret_cast<const char*>(q + (i + 64) * 2 * kPanel / per_byte(C)), _MM_HINT_T0);
        __m512i a, b;
        pairs_of_chains((__m512i)pair_weights<C, S>(q, i, dm), (__m512i)pair_weights<C, S>(q, i + 1, dm), a, b);
        _mm512_storeu_si512(buf + (p * pairs + i) * 2 * kPanel, a);
        _mm512_storeu_si512(buf + (p * pairs + i + 1) * 2 * kPanel, b);
      }
    }
  }
}

// Products of up to this many rows from the codes in registers (bytes: 4-bit codes go through few_rows, or the
// buffer path without AMX); from 3 rows on, each unit's codes decoded once
// into a buffer and the tiles (or block_tn) over it are faster: over SmolLM2's projections at 3 and 4 rows,
// 12.5 and 10.5 ms where direct_tn took 20.4 and 23.2 (and the bf16 panels 16.8 and 12.2)
constexpr int64_t kDirectTnRows = 2;
// Panels per call of the direct path: 3 accumulators an output (and at 3 panels SmolLM2's widths, multiples
// of 96 columns, split evenly between two threads)
constexpr int direct_tn_panels(int rows) { return rows <= 1 ? 6 : 3; }
template <Codes C, typename S, int... R>
constexpr std::array<DirectFn<C, S>, kDirectTnRows> direct_tns_of(std::integer_sequence<int, R...>) {
  return {&direct_tn<R + 1, direct_tn_panels(R + 1), C, S>...};
}
template <Codes C, typename S>
constexpr auto kDirectTn = direct_tns_of<C, S>(std::make_integer_sequence<int, kDirectTnRows>());

// Linux lends a process AMX's tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
// refused (an old kernel, a sandbox), or TERCET_AMX=0 in the environment: the vdpbf16ps paths give the same bits
bool amx_permitted() {
  static const bool ok = [] {
    const char* env = std::getenv("TERCET_AMX");
    return !(env != nullptr && std::strcmp(env, "0") == 0) && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg with the whole 64-byte config as its operand: GCC 12's _tile_loadconfig names only its first 8 bytes
// as read, so the stores of the rest may be dropped as dead (they were, in a test program: #GP)
inline void load_tile_config(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" ::"m"(cfg)); }

// Tiles 0-3: y (2 x 2 tiles of 16 rows x 16 fp32), 4-5: x (16 rows x 16 pairs), 6-7: two panels (16 pairs x 32 bf16)
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  load_tile_config(cfg);
}

// Pairs [i0, i1) of rows [0, 16), or [0, 32) where TWO (a second row tile; x as pairs words ldx apart, every
// row of the tiles readable) against two panels, the sums going on from `sums` ([32 rows][32 columns] fp32;
// from zero where `first`) and left there: the tiles' state between two chunks of K is its fp32 sums, stored
// and loaded back unchanged, so the chunks give the bits of one pass
template <bool TWO>
void amx_part(const uint32_t* x, int64_t ldx, const uint16_t* panel0, const uint16_t* panel1, int64_t i0, int64_t i1,
              float* sums, bool first) {
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (TWO) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, sums, 128);
    _tile_loadd(1, sums + 16, 128);
    if constexpr (TWO) {
      _tile_loadd(2, sums + 16 * 32, 128);
      _tile_loadd(3, sums + 16 * 32 + 16, 128);
    }
  }
  const int64_t stride = ldx * 4;
  for (int64_t i = i0; i < i1; i += kBlockPairs) {
    _tile_loadd(4, x + i, stride);
    _tile_loadd(6, panel0 + i * 2 * kPanel, 64);
    _tile_loadd(7, panel1 + i * 2 * kPanel, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, x + 16 * ldx + i, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 128);
  _tile_stored(1, sums + 16, 128);
  if constexpr (TWO) {
    _tile_stored(2, sums + 16 * 32, 128);
    _tile_stored(3, sums + 16 * 32 + 16, 128);
  }
}

// Pairs a chunk of K at most, where the tiles take K in chunks: the two panels' chunk (16 KB) stays in L1 while
// the rows' tiles pass it, where the whole K of a unit (36 KB at K = 576, 96 KB at 1536) and of the rows'
// inputs did not fit beside each other (48 KB) and both came from L2. 2048 rows x SmolLM2's four decoder
// projections, alternated: 8.6-9.9 -> 7.3-8.8 ms from the codes, 8.0-8.6 -> 6.7-8.0 from the panels
// (benchmarks/results/2026-12-05-amx-k-chunks; chunks of 64, 96 and 160 pairs measured no better)
constexpr int64_t kChunkPairs = 128;
// Rows a block needs for its K to go in chunks: with fewer (a decode step of 32-64 requests), each chunk's
// panels serve one or two tiles of rows and storing and loading the sums between chunks costs more than the
// chunk saves (the server's 32-request decode steps were ~5 % slower with chunks at any rows)
constexpr int64_t kChunkRows = 128;

// The tiles over `units` units of two panels each: unit_of(u, buf) gives unit u's two panels' weights in
// the packed layout (in place, or decoded into buf: this thread's); store(u, r, sums) takes row r's 32 fp32
// sums (the first panel's 16, then the second's) once its K is done
template <typename UnitOf, typename Store>
void amx_units(const uint32_t* xp, int64_t m, int64_t pairs, int64_t units, UnitOf unit_of, Store store) {
  const int64_t grain = std::max<int64_t>(1, 8 / ((m + 31) / 32));
  tercet::parallel(units, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> buf;
    std::vector<uint32_t> xpad;  // a last chunk of rows, padded to whole tiles with zero rows
    std::vector<float> acc;  // the block's sums [rows][32 columns] between chunks of K
    configure_tiles();
    for (int64_t r0 = 0; r0 < m; r0 += kTnBlockRows) {
      const int64_t r1 = std::min(m, r0 + kTnBlockRows);
      for (int64_t u = begin; u < end; ++u) {
        const auto [panel, second] = unit_of(u, buf);
        // K in even chunks of whole blocks, where the block has rows enough to pass each chunk many times
        const int64_t chunks = r1 - r0 >= kChunkRows ? (pairs + kChunkPairs - 1) / kChunkPairs : 1;
        const int64_t chunk = ((pairs + chunks - 1) / chunks + kBlockPairs - 1) / kBlockPairs * kBlockPairs;
        acc.resize(static_cast<size_t>((r1 - r0 + 31) / 32 * 32 * 32));
        for (int64_t i0 = 0; i0 < pairs; i0 += chunk) {
          for (int64_t r = r0; r < r1; r += 32) {
            const uint32_t* x = xp + r * pairs;
            if (r + 32 > m) {  // tiles read 16 or 32 rows: the last ones from a zero-padded copy (made once)
              if (xpad.empty()) {
                xpad.assign(static_cast<size_t>(32 * pairs), 0u);
                std::memcpy(xpad.data(), x, static_cast<size_t>((m - r) * pairs) * sizeof(uint32_t));
              }
              x = xpad.data();
            }
            float* sums = acc.data() + (r - r0) * 32;
            if (r1 - r > 16) amx_part<true>(x, pairs, panel, second, i0, std::min(pairs, i0 + chunk), sums, i0 == 0);
            else amx_part<false>(x, pairs, panel, second, i0, std::min(pairs, i0 + chunk), sums, i0 == 0);
          }
        }
        for (int64_t r = r0; r < r1; ++r) store(u, r, acc.data() + (r - r0) * 32);
      }
    }
    _tile_release();
  });
}

// y = x W^T (+ b) in tile numerics over `panels` panels; panel_of(p, count, buf) gives the weights of panels
// p .. p + count - 1 (count <= 2) in the packed layout, in place or decoded into buf (this thread's)
template <typename PanelOf>
void project_tn(const uint32_t* xp, int64_t m, int64_t pairs, int64_t panels, int64_t n, const float* b,
                c10::BFloat16* out, PanelOf panel_of) {
  const int64_t units = (panels + kTnPanels - 1) / kTnPanels;
  const auto columns = [&](int64_t u) { return std::min(kTnPanels * kPanel, n - u * kTnPanels * kPanel); };
  if (m >= kAmxRows && amx_permitted()) {
    amx_units(
        xp, m, pairs, units,
        [&](int64_t u, std::vector<uint16_t>& buf) {
          const int64_t p = u * kTnPanels, count = std::min<int64_t>(kTnPanels, panels - p);
          const uint16_t* panel = panel_of(p, count, buf);
          return std::pair{panel, count > 1 ? panel + pairs * 2 * kPanel : panel};  // (computed, not stored)
        },
        [&](int64_t u, int64_t r, const float* sums) {
          const __m512 c[1][2] = {{_mm512_loadu_ps(sums), _mm512_loadu_ps(sums + 16)}};
          store_rows<1, 2>(c, out + r * n + u * kTnPanels * kPanel, n, columns(u),
                           b != nullptr ? b + u * kTnPanels * kPanel : nullptr);
        });
    return;
  }
  const int64_t grain = std::max<int64_t>(1, 8 / ((m + 31) / 32));
  tercet::parallel(units, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> buf;
    for (int64_t r0 = 0; r0 < m; r0 += kTnBlockRows) {
      const int64_t r1 = std::min(m, r0 + kTnBlockRows);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t p = u * kTnPanels, count = std::min<int64_t>(kTnPanels, panels - p);
        const uint16_t* panel = panel_of(p, count, buf);
        const float* pb = b != nullptr ? b + p * kPanel : nullptr;
        for (int64_t r = r0; r < r1; r += kTnRows) {
          const int64_t rows = std::min<int64_t>(kTnRows, r1 - r);
          kTnBlocks[count - 1][rows - 1](xp + r * pairs, pairs, panel, pairs, out + r * n + p * kPanel, n, columns(u),
                                         pb);
        }
      }
    }
  });
}

// out [m, n / 2] = silu(x W_gate^T + b_gate) * (x W_up^T + b_up) through the tiles, W = [W_gate; W_up] over
// `panels` panels (n / 2 a multiple of 16: gate panel u and up panel u + panels / 2 hold the same columns of
// each); panel_of(p, buf, at) gives panel p's weights, in place or decoded into buf at `at`
template <typename PanelOf>
void project_tn_silu(const uint32_t* xp, int64_t m, int64_t pairs, int64_t panels, const float* b,
                     c10::BFloat16* out, PanelOf panel_of) {
  const int64_t half = panels / 2, width = half * kPanel;
  amx_units(
      xp, m, pairs, half,
      [&](int64_t u, std::vector<uint16_t>& buf) {
        buf.resize(static_cast<size_t>(2 * pairs * 2 * kPanel));
        return std::pair{panel_of(u, buf, 0), panel_of(u + half, buf, pairs * 2 * kPanel)};
      },
      [&](int64_t u, int64_t r, const float* sums) {
        silu_store(_mm512_loadu_ps(sums), _mm512_loadu_ps(sums + 16), b != nullptr ? b + u * kPanel : nullptr,
                   b != nullptr ? b + width + u * kPanel : nullptr, out + r * width + u * kPanel);
      });
}

// ---- Few rows: the weights as the tiles' A side (4-bit codes) ----
//
// y^T = W x^T: A is 16 columns of W over a 32-k block (decode_rows' rows), B is x^T over the block's 16 pairs for
// the m rows (16 rows of m pairs words), C the 16 columns' sums for the m rows. Each output is the same products
// in the same k pairs as with x as A (TDPBF16PS sums each over a 32-k block as the top describes, whichever side
// a factor comes from), so the same bits; and no weight goes through a conversion or a vdpbf16ps of its own.
// SmolLM2's gate_up (3072 x 576) at one row on one thread, hot in L2: 170 us with direct_tn, 122 this way; its
// four decoder projections at one row on two threads 1.2-1.3x faster (benchmarks/results/2026-12-06-few-rows).
// Past 16 rows x^T takes a B tile per 16 rows and the C tiles are transposed back; past 64 rows the buffer
// path (each block's columns transposed to pair rows) and x as A serve.
constexpr int64_t kFewRows = 64;     // products of up to this many rows
constexpr int64_t kGroupRows = 16;   // rows of x^T a B tile holds

// Tiles 0-3: C (16 columns x 16 rows or fewer, fp32), 4, 7 (and 6): B (16 pairs x those rows), 5-6: A (16 columns x
// 16 pairs). `ld`: rows a B tile holds (m, up to 16)
void configure_few_tiles(int64_t ld) {
  TileConfig cfg;
  for (int t : {0, 1, 2, 3, 4, 7}) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(4 * ld);
  for (int t : {5, 6}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  load_tile_config(cfg);
}

// P panels' products (P x G <= 4 sums tiles) over their codes q[p], d[p], m[p] for G groups of rows: x^T in xt
// (group g at xt + g * group_words, its pair i's row words at i * ld), panel p's sums of group g into
// sums[p * G + g] ([16 columns][16] fp32, ld of each 16 used; one row: 16 sums in a row). Block b's A rows are
// decoded while block b - 1's tile ops run. (Tile numbers are immediates: A 5 and 6; B 4, 7, 6 and 4 again;
// C p * G + g.)
template <Codes C, typename S, int P, int G>
void few_rows_unit(const uint32_t* xt, int64_t ld, int64_t group_words, int64_t blocks, const uint8_t* const* q,
                   const S* const* d, const S* const* m, float (*sums)[kPanel * kGroupRows]) {
  static_assert(P * G <= 4 && (P == 1 || G <= 2), "four sums tiles, and A and B tiles beside them");
  alignas(64) uint16_t rows[2][P][kPanel * 32];
  _tile_zero(0);
  if constexpr (P * G > 1) _tile_zero(1);
  if constexpr (P * G > 2) _tile_zero(2);
  if constexpr (P * G > 3) _tile_zero(3);
  const int64_t stride = 4 * ld;
  const auto tiles = [&](int64_t b) {
    const uint32_t* x = xt + b * kBlockPairs * ld;
    _tile_loadd(5, rows[b & 1][0], 64);
    if constexpr (P > 1) _tile_loadd(6, rows[b & 1][1], 64);
    _tile_loadd(4, x, stride);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (P > 1) {  // (the macros spell their tile numbers: C of panel 1 is G)
      if constexpr (G == 1) _tile_dpbf16ps(1, 6, 4);
      else _tile_dpbf16ps(2, 6, 4);
    }
    if constexpr (G > 1) {
      _tile_loadd(7, x + group_words, stride);
      _tile_dpbf16ps(1, 5, 7);
      if constexpr (P > 1) _tile_dpbf16ps(3, 6, 7);  // (G = 2)
    }
    if constexpr (G > 2) {
      _tile_loadd(6, x + 2 * group_words, stride);
      _tile_dpbf16ps(2, 5, 6);
    }
    if constexpr (G > 3) {
      _tile_loadd(4, x + 3 * group_words, stride);
      _tile_dpbf16ps(3, 5, 4);
    }
  };
  for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p)
      decode_rows<C, S>(q[p] + b * kBlockBytes, d[p] + b * kPanel, m[p] + b * kPanel, rows[b & 1][p]);
    if (b > 0) tiles(b - 1);
  }
  tiles(blocks - 1);
  const int64_t out_stride = ld == 1 ? 4 : 64;  // (16 columns x 16 rows, to be transposed; one row: 16 sums)
  _tile_stored(0, sums[0], out_stride);
  if constexpr (P * G > 1) _tile_stored(1, sums[1], out_stride);
  if constexpr (P * G > 2) _tile_stored(2, sums[2], out_stride);
  if constexpr (P * G > 3) _tile_stored(3, sums[3], out_stride);
}

// m <= kFewRows rows of x (pairs words) against units of two panels of 4-bit codes: panels_of(u) gives unit u's
// panels (the second -1: none), store(u, r, a, b) takes row r's sums of them (b: zero where none). Up to 32 rows
// both panels go through the tiles together; from 33 on (3-4 groups of rows) one after the other.
template <Codes C, typename S, typename PanelsOf, typename Store>
void few_rows(const uint32_t* xp, int64_t m, int64_t pairs, const uint8_t* codes, const S* scales, const S* offsets,
              int64_t units, PanelsOf panels_of, Store store) {
  const int64_t blocks = 2 * pairs / kGroup, cstride = blocks * kBlockBytes, sstride = blocks * kPanel;
  const int64_t ld = std::min(m, kGroupRows), groups = (m + kGroupRows - 1) / kGroupRows, group_words = pairs * ld;
  // x^T: [groups][pairs][ld] words, zeros past the last row (the calling thread's, kept: at 64 rows and K = 1536 a
  // fresh one each call was 196 KB mapped and unmapped, its pages faulted in again each time)
  thread_local std::vector<uint32_t> transposed, tail;
  const uint32_t* xt = xp;  // (one row: x^T is x)
  if (m > 1) {
    transposed.resize(static_cast<size_t>(groups * group_words));
    if (ld < kGroupRows) {
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < pairs; ++i) transposed[i * ld + r] = xp[r * pairs + i];
    } else {  // 16 rows by 16 pairs at a time (a last group's rows past m: zeros)
      for (int64_t g = 0; g < groups; ++g) {
        const uint32_t* rows = xp + g * kGroupRows * pairs;
        if ((g + 1) * kGroupRows > m) {
          tail.assign(static_cast<size_t>(kGroupRows * pairs), 0u);
          std::memcpy(tail.data(), rows, static_cast<size_t>((m - g * kGroupRows) * pairs) * sizeof(uint32_t));
          rows = tail.data();
        }
        for (int64_t i = 0; i < pairs; i += kGroupRows)
          transpose16(rows + i, pairs, transposed.data() + g * group_words + i * kGroupRows, kGroupRows);
      }
    }
    xt = transposed.data();
  }
  tercet::parallel(units, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[8][kPanel * kGroupRows];
    configure_few_tiles(ld);
    for (int64_t u = begin; u < end; ++u) {
      const auto [a, b] = panels_of(u);
      const uint8_t* q[2] = {codes + a * cstride, codes + std::max<int64_t>(b, 0) * cstride};
      const S* d[2] = {scales + a * sstride, scales + std::max<int64_t>(b, 0) * sstride};
      const S* mo[2] = {offsets + a * sstride, offsets + std::max<int64_t>(b, 0) * sstride};
      const auto one = [&](auto tag, int p, float (*out)[kPanel * kGroupRows]) {  // panel p alone, G groups
        few_rows_unit<C, S, 1, decltype(tag)::value>(xt, ld, group_words, blocks, q + p, d + p, mo + p, out);
      };
      const auto two = [&](auto tag) {  // both panels (or the first alone), G groups
        constexpr int G = decltype(tag)::value;
        if (b < 0) return few_rows_unit<C, S, 1, G>(xt, ld, group_words, blocks, q, d, mo, sums);
        if constexpr (G <= 2) few_rows_unit<C, S, 2, G>(xt, ld, group_words, blocks, q, d, mo, sums);
        else one(tag, 0, sums), one(tag, 1, sums + G);
      };
      switch (groups) {
        case 1: two(std::integral_constant<int, 1>{}); break;
        case 2: two(std::integral_constant<int, 2>{}); break;
        case 3: two(std::integral_constant<int, 3>{}); break;
        default: two(std::integral_constant<int, 4>{}); break;
      }
      const int64_t used = (b >= 0 ? 2 : 1) * groups;
      if (ld > 1)  // [16 columns][16 rows] -> [16 rows][16 columns]
        for (int64_t t = 0; t < used; ++t) transpose16(sums[t], kPanel, sums[t], kPanel);
      for (int64_t r = 0; r < m; ++r)
        store(u, r, _mm512_loadu_ps(sums[r / kGroupRows] + (r % kGroupRows) * kPanel),
              b >= 0 ? _mm512_loadu_ps(sums[groups + r / kGroupRows] + (r % kGroupRows) * kPanel)
                     : _mm512_setzero_ps());
    }
    _tile_release();
  });
}

// bf16_block_linear over 4-bit codes for m <= kFewRows rows: units of two consecutive panels
template <Codes C, typename S>
void few_rows_linear(const uint32_t* xp, int64_t m, int64_t pairs, const uint8_t* c, const S* d, const S* mo,
                     int64_t panels, int64_t n, const float* bias, c10::BFloat16* out) {
  few_rows<C, S>(
      xp, m, pairs, c, d, mo, (panels + 1) / 2,
      [&](int64_t u) { return std::pair<int64_t, int64_t>{2 * u, 2 * u + 1 < panels ? 2 * u + 1 : -1}; },
      [&](int64_t u, int64_t r, __m512 a, __m512 b) {
        const __m512 sums[1][2] = {{a, b}};
        store_rows<1, 2>(sums, out + r * n + u * 2 * kPanel, n, std::min(2 * kPanel, n - u * 2 * kPanel),
                         bias != nullptr ? bias + u * 2 * kPanel : nullptr);
      });
}

// bf16_block_linear_silu over 4-bit codes for m <= kFewRows rows: gate's panel u with up's u + panels / 2
template <Codes C, typename S>
void few_rows_silu(const uint32_t* xp, int64_t m, int64_t pairs, const uint8_t* c, const S* d, const S* mo,
                   int64_t panels, const float* bias, c10::BFloat16* out) {
  const int64_t half = panels / 2, width = half * kPanel;
  few_rows<C, S>(
      xp, m, pairs, c, d, mo, half, [&](int64_t u) { return std::pair<int64_t, int64_t>{u, u + half}; },
      [&](int64_t u, int64_t r, __m512 gate, __m512 up) {
        silu_store(gate, up, bias != nullptr ? bias + u * kPanel : nullptr,
                   bias != nullptr ? bias + width + u * kPanel : nullptr, out + r * width + u * kPanel);
      });
}
#endif

// x [M, K] bf16 as the blocks read it: each row's pairs of inputs as 32-bit words, in place, or
// copied where the weight has more pairs (K odd, or not whole 32-k blocks in tile numerics: zeros after
// K) or x starts between two words (a view at an odd offset: `padded` holds the copy)
const uint32_t* pairs_of(const at::Tensor& xin, int64_t pairs, std::vector<uint32_t>& padded) {
  const int64_t m = xin.size(0), k = xin.size(1);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xin.data_ptr<at::BFloat16>());
  if (k == 2 * pairs && reinterpret_cast<uintptr_t>(xp) % alignof(uint32_t) == 0) return xp;
  padded.resize(static_cast<size_t>(m * pairs));
  const auto* src = reinterpret_cast<const uint16_t*>(xin.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < pairs; ++i)
      padded[r * pairs + i] = (2 * i < k ? uint32_t{src[r * k + 2 * i]} : 0u) |
                              (2 * i + 1 < k ? uint32_t{src[r * k + 2 * i + 1]} << 16 : 0u);
  return padded.data();
}

// The bias as fp32 (`keep` holds it), or nullptr
const float* checked_bias(const std::optional<at::Tensor>& bias, int64_t n, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK((bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat) && bias->dim() == 1 &&
                  bias->numel() == n && bias->device().is_cpu(), "bias must be a bfloat16 or float32 CPU [n]");
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// y = x W^T (+ b) over `panels` panels; panel_of(p, count, buf) gives the bf16 weights of panels
// p .. p + count - 1 in the packed layout [count, pairs, 32], in place or decoded into buf (this
// thread's, kPanels * pairs * 32).
template <typename PanelOf>
void project(const uint32_t* xp, int64_t m, int64_t pairs, int64_t panels, int64_t n, const float* b,
             int64_t block_rows, c10::BFloat16* out, PanelOf panel_of) {
#if TERCET_BF16_GEMM
  // threads split the panels in units of kPanels (each its own columns of y); rows go in blocks
  // that stay in L2
  const int64_t units = (panels + kPanels - 1) / kPanels;
  const int64_t grain = std::max<int64_t>(1, 8 / kPanels / ((m + kRows - 1) / kRows));
  tercet::parallel(units, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> buf;
    for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
      const int64_t r1 = std::min(m, r0 + block_rows);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t p = u * kPanels, count = std::min<int64_t>(kPanels, panels - p);
        const int64_t cols = std::min(count * kPanel, n - p * kPanel);
        const uint16_t* panel = panel_of(p, count, buf);
        const float* pb = b != nullptr ? b + p * kPanel : nullptr;
        for (int64_t r = r0; r < r1; r += kRows) {
          const int64_t rows = std::min<int64_t>(kRows, r1 - r);
          kBlocks[count - 1][rows - 1](xp + r * pairs, pairs, panel, pairs, out + r * n + p * kPanel, n, cols, pb);
        }
      }
    }
  });
#endif
}

void check_x(const at::Tensor& x, int64_t pairs) {
  TORCH_CHECK(TERCET_BF16_GEMM, "this build has no AVX512_BF16 projection kernel (the CPU lacks avx512_bf16)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be a bfloat16 CPU [M, K]");
  TORCH_CHECK(aligned_pairs((x.size(1) + 1) / 2) == pairs, "x has ", x.size(1), " columns, the weight ",
              2 * pairs - 2 * kPairAlign + 1, " to ", 2 * pairs);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(TERCET_BF16_GEMM, "this build has no AVX512_BF16 projection kernel (the CPU lacks avx512_bf16)");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * kPanel && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.device().is_cpu(), "packed must come from pack_bf16_weight");
  const int64_t m = x.size(0), panels = packed.size(0), pairs = packed.size(1);
  check_x(x, pairs);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n does not match the packed weight");
  at::Tensor keep;
  const float* b = checked_bias(bias, n, keep);
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const auto xin = x.contiguous();
  std::vector<uint32_t> padded;
  const uint32_t* xp = pairs_of(xin, pairs, padded);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const auto in_place = [&](int64_t p, int64_t, std::vector<uint16_t>&) { return w + p * pairs * 2 * kPanel; };
#if TERCET_TILE_NUMERICS
  project_tn(xp, m, pairs, panels, n, b, y.data_ptr<c10::BFloat16>(), in_place);
#else
  project(xp, m, pairs, panels, n, b, kBlockRows, y.data_ptr<c10::BFloat16>(), in_place);
#endif
  return y;
}

#if TERCET_BF16_GEMM
// bf16_block_linear over one layout: codes of kind C, d and m of type S
template <Codes C, typename S>
void codes_linear(const uint32_t* xp, int64_t m, const uint8_t* c, const S* d, const S* mo, int64_t panels,
                  int64_t pairs, int64_t n, const float* b, c10::BFloat16* out) {
  const int64_t k = 2 * pairs, sstride = (k / kGroup) * kPanel, cstride = (k / per_byte(C)) * kPanel;  // a panel's
#if TERCET_TILE_NUMERICS
  // 4-bit codes in column blocks: few rows take them as the tiles' A side; without AMX the buffer path serves
  constexpr bool columns = C != Codes::kBytes;
  if constexpr (columns) {
    if (m <= kFewRows && amx_permitted()) {
      few_rows_linear<C, S>(xp, m, pairs, c, d, mo, panels, n, b, out);
      return;
    }
  }
#else
  constexpr bool columns = false;
#endif
  if constexpr (!columns) {  // bytes in any numerics, and every code in vdpbf16ps's
#if TERCET_TILE_NUMERICS
    constexpr int64_t direct_rows = kDirectTnRows;
    const auto& directs = kDirectTn<C, S>;
    const auto width_of = direct_tn_panels;
#else
    constexpr int64_t direct_rows = kDirectRows;
    const auto& directs = kDirect<C, S>;
    const auto width_of = direct_panels;
#endif
    if (m <= direct_rows) {  // straight from the codes
      const int64_t width = width_of(static_cast<int>(m));
      const int64_t grain = std::max<int64_t>(1, 16 / width);
      tercet::parallel((panels + width - 1) / width, grain, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t p = width * t, count = std::min<int64_t>(width, panels - p);
          const int64_t cols = std::min(count * kPanel, n - p * kPanel);
          const float* pb = b != nullptr ? b + p * kPanel : nullptr;
          directs[m - 1](xp, pairs, c + p * cstride, d + p * sstride, mo + p * sstride, pairs, count,
                         out + p * kPanel, n, cols, pb);
        }
      });
      return;
    }
  }
  // else each unit of panels decoded once per pass of rows into this thread's buffer, in the panels' layout
  const auto decoded = [&](int64_t p, int64_t count, std::vector<uint16_t>& buf) {
    buf.resize(static_cast<size_t>(count * pairs * 2 * kPanel));
#if TERCET_TILE_NUMERICS
    decode_panels_tn<C, S>(c + p * cstride, d + p * sstride, mo + p * sstride, pairs, count, buf.data());
#else
    decode_panels<C, S>(c + p * cstride, d + p * sstride, mo + p * sstride, pairs, count, buf.data());
#endif
    return static_cast<const uint16_t*>(buf.data());
  };
#if TERCET_TILE_NUMERICS
  project_tn(xp, m, pairs, panels, n, b, out, decoded);
#else
  project(xp, m, pairs, panels, n, b, kCodeBlockRows, out, decoded);
#endif
}

template <Codes C>
void codes_linear(const uint32_t* xp, int64_t m, const at::Tensor& codes, const at::Tensor& scales,
                  const at::Tensor& offsets, int64_t pairs, int64_t n, const float* b, c10::BFloat16* out) {
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  if (scales.scalar_type() == at::kHalf) {
    codes_linear<C>(xp, m, c, scales.data_ptr<c10::Half>(), offsets.data_ptr<c10::Half>(), codes.size(0), pairs, n, b,
                    out);
  } else {
    codes_linear<C>(xp, m, c, scales.data_ptr<float>(), offsets.data_ptr<float>(), codes.size(0), pairs, n, b, out);
  }
}
#endif

at::Tensor bf16_block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& offsets, int64_t n, const std::optional<at::Tensor>& bias) {
  const auto [panels, k, nibbles, octets] = block_codes::check(codes, scales, offsets, "pack_bf16_block_codes");
  TORCH_CHECK(!octets, "codes must come from pack_bf16_block_codes (octets are the fp32 kernel's)");
  check_x(x, k / 2);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n does not match the codes");
  at::Tensor keep;
  [[maybe_unused]] const float* b = checked_bias(bias, n, keep);
  const int64_t m = x.size(0);
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
#if TERCET_BF16_GEMM
  const auto xin = x.contiguous();
  std::vector<uint32_t> padded;
  const uint32_t* xp = pairs_of(xin, k / 2, padded);
  auto* out = y.data_ptr<c10::BFloat16>();
  if (!nibbles) {
    codes_linear<Codes::kBytes>(xp, m, codes, scales, offsets, k / 2, n, b, out);
  } else if (codes.scalar_type() == at::kByte) {
    codes_linear<Codes::kNibbles>(xp, m, codes, scales, offsets, k / 2, n, b, out);
  } else {
    codes_linear<Codes::kSignedNibbles>(xp, m, codes, scales, offsets, k / 2, n, b, out);
  }
#endif
  return y;
}

// silu(gate) * up of a gate_up product y [m, n] ([gate | up] per row) into out [m, n / 2]: silu_mul's bits
void silu_rows(const c10::BFloat16* y, int64_t m, int64_t n, c10::BFloat16* out) {
#if TERCET_BF16_GEMM
  const int64_t half = n / 2;
  tercet::parallel(m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < half; i += kPanel)
        silu_store(vec::load(y + r * n + i), vec::load(y + r * n + half + i), nullptr, nullptr, out + r * half + i);
  });
#endif
}

// The gate_up products below: n (gate's and up's widths together) even panels' worth of columns
void check_gate_up(int64_t panels, int64_t n) {
  TORCH_CHECK(n % (2 * kPanel) == 0 && panels * kPanel == n, "n must be the weight's rows, a multiple of ",
              2 * kPanel, " (gate's then up's)");
}

// silu_mul(bf16_linear(x, packed, n, bias)) bit for bit, gate_up's [m, n] never stored where the tiles serve:
// each unit of the tiles takes gate's panel and up's panel of the same 16 columns
at::Tensor bf16_linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * kPanel && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.device().is_cpu(), "packed must come from pack_bf16_weight");
  const int64_t m = x.size(0), panels = packed.size(0), pairs = packed.size(1);
  check_x(x, pairs);
  check_gate_up(panels, n);
  at::Tensor keep;
  [[maybe_unused]] const float* b = checked_bias(bias, n, keep);
  auto out = at::empty({m, n / 2}, x.options());
  if (m == 0) return out;
#if TERCET_TILE_NUMERICS
  if (m >= kAmxRows && amx_permitted()) {
    const auto xin = x.contiguous();
    std::vector<uint32_t> padded;
    const uint32_t* xp = pairs_of(xin, pairs, padded);
    const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
    project_tn_silu(xp, m, pairs, panels, b, out.data_ptr<c10::BFloat16>(),
                    [&](int64_t p, std::vector<uint16_t>&, int64_t) { return w + p * pairs * 2 * kPanel; });
    return out;
  }
#endif
  const auto y = bf16_linear(x, packed, n, bias);
  silu_rows(y.data_ptr<c10::BFloat16>(), m, n, out.data_ptr<c10::BFloat16>());
  return out;
}

// silu_mul(bf16_block_linear(x, codes, scales, offsets, n, bias)) bit for bit, as bf16_linear_silu: each unit
// of the tiles decodes gate's panel and up's panel of the same 16 columns
at::Tensor bf16_block_linear_silu(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                  const at::Tensor& offsets, int64_t n, const std::optional<at::Tensor>& bias) {
  const auto [panels, k, nibbles, octets] = block_codes::check(codes, scales, offsets, "pack_bf16_block_codes");
  TORCH_CHECK(!octets, "codes must come from pack_bf16_block_codes (octets are the fp32 kernel's)");
  check_x(x, k / 2);
  check_gate_up(panels, n);
  at::Tensor keep;
  [[maybe_unused]] const float* b = checked_bias(bias, n, keep);
  const int64_t m = x.size(0);
  auto out = at::empty({m, n / 2}, x.options());
  if (m == 0) return out;
#if TERCET_TILE_NUMERICS
  static_assert(kAmxRows > kDirectTnRows, "the tiles serve none of the direct path's row counts");
  const bool few = nibbles && m <= kFewRows;  // (4-bit codes: the weights as the tiles' A side)
  if ((few || m >= kAmxRows) && amx_permitted()) {
    const auto xin = x.contiguous();
    std::vector<uint32_t> padded;
    const int64_t pairs = k / 2;
    const uint32_t* xp = pairs_of(xin, pairs, padded);
    auto* o = out.data_ptr<c10::BFloat16>();
    const auto run = [&](auto codes_tag, const auto* d, const auto* mo) {
      constexpr Codes C = decltype(codes_tag)::value;
      using S = std::remove_const_t<std::remove_pointer_t<decltype(d)>>;
      const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
      if constexpr (C != Codes::kBytes) {
        if (few) return few_rows_silu<C, S>(xp, m, pairs, c, d, mo, panels, b, o);
      }
      const int64_t sstride = (k / kGroup) * kPanel, cstride = (k / per_byte(C)) * kPanel;  // a panel's, each
      project_tn_silu(xp, m, pairs, panels, b, o, [&](int64_t p, std::vector<uint16_t>& buf, int64_t at) {
        decode_panels_tn<C, S>(c + p * cstride, d + p * sstride, mo + p * sstride, pairs, 1, buf.data() + at);
        return static_cast<const uint16_t*>(buf.data() + at);
      });
    };
    const auto with_scales = [&](auto codes_tag) {
      if (scales.scalar_type() == at::kHalf) run(codes_tag, scales.data_ptr<c10::Half>(), offsets.data_ptr<c10::Half>());
      else run(codes_tag, scales.data_ptr<float>(), offsets.data_ptr<float>());
    };
    if (!nibbles) with_scales(std::integral_constant<Codes, Codes::kBytes>{});
    else if (codes.scalar_type() == at::kByte) with_scales(std::integral_constant<Codes, Codes::kNibbles>{});
    else with_scales(std::integral_constant<Codes, Codes::kSignedNibbles>{});
    return out;
  }
#endif
  const auto y = bf16_block_linear(x, codes, scales, offsets, n, bias);
  silu_rows(y.data_ptr<c10::BFloat16>(), m, n, out.data_ptr<c10::BFloat16>());
  return out;
}

bool bf16_linear_available() { return TERCET_BF16_GEMM; }

// Whether this build sums in tile numerics (a CPU with AMX-BF16), and whether AMX's tiles serve
bool bf16_tile_numerics() { return TERCET_TILE_NUMERICS; }
bool bf16_amx_serves() {
#if TERCET_TILE_NUMERICS
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tercet, m) {
  m.def("pack_bf16_weight(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("bf16_block_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int n, Tensor? bias) -> Tensor");
  m.def("bf16_linear_silu(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("bf16_block_linear_silu(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int n, Tensor? bias) -> Tensor");
  m.def("bf16_linear_available() -> bool", &bf16_linear_available);
  m.def("bf16_tile_numerics() -> bool", &bf16_tile_numerics);
  m.def("bf16_amx_serves() -> bool", &bf16_amx_serves);
  m.impl("pack_bf16_weight", c10::DispatchKey::CPU, TORCH_FN(pack_bf16_weight));
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
  m.impl("bf16_block_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_block_linear));
  m.impl("bf16_linear_silu", c10::DispatchKey::CPU, TORCH_FN(bf16_linear_silu));
  m.impl("bf16_block_linear_silu", c10::DispatchKey::CPU, TORCH_FN(bf16_block_linear_silu));
}

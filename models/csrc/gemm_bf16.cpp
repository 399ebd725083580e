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
// in the panels' layout and runs the panel kernel's blocks over it.
// The rounding: with fp16 d and m every rebuilt w is 0 or a multiple of 2^-24, never an fp32
// denormal, so vcvtne2ps2bf16 (which would flush one) rounds as torch does; with fp32 d and m
// (a weight some block of which is not exactly fp16) the integer rounding of vec.h.
//
//   bf16_block_linear(x [M, K] bf16, codes, scales, offsets, n, bias? [n] bf16 or fp32) -> y [M, n] bf16

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "block_codes.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define TERCET_BF16_GEMM 1
#else
#define TERCET_BF16_GEMM 0
#endif

namespace {

constexpr int64_t kPanel = 16;      // output columns per panel
constexpr int kRows = 8;            // rows per register block
constexpr int kPanels = 3;          // panels per register block: 8 x 3 zmm accumulators of the 32
constexpr int64_t kBlockRows = 96;  // rows whose inputs stay in L2 while the panels pass (a multiple of kRows)
// Each panel's weights are prefetched this many k pairs ahead (a line per pair): at 8 rows, where W
// streams from memory, 1.3-1.5x the hardware prefetcher alone (24 and 96 measured between)
constexpr int64_t kPrefetch = 48;
constexpr int64_t kGroup = 32;            // k per block of codes
constexpr int64_t kCodeBlockRows = 384;   // rows per pass of the buffer path: each pass decodes every panel once
constexpr int64_t kDirectRows = kRows;    // products of up to this many rows rebuild the weights in registers

at::Tensor pack_bf16_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "w must be a bfloat16 CPU [N, K]");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel, pairs = (k + 1) / 2;
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
      _mm_prefetch(reinterpret_cast<const char*>(panel + (p * pairs + i + kPrefetch) * 2 * kPanel), _MM_HINT_T0);
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
template <int R, int P, Codes C, typename S>
void direct(const uint32_t* x, int64_t ldx, const uint8_t* codes, const S* scales, const S* offsets, int64_t pairs,
            int64_t count, c10::BFloat16* y, int64_t ldc, int64_t cols, const float* bias) {
  const int64_t k = 2 * pairs, groups = k / kGroup;
  const uint8_t* q[P];
  const S* ds[P];
  const S* ms[P];
  for (int p = 0; p < P; ++p) {
    const int64_t at = p < count ? p : 0;
    q[p] = codes + at * (k / per_byte(C)) * kPanel;
    ds[p] = scales + at * groups * kPanel, ms[p] = offsets + at * groups * kPanel;
  }
  __m512 c[R][P];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) c[r][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    alignas(64) float dm[P][64];  // this group's d and m of each panel, fp32, in pair order
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p) store_pair_scales(ds[p] + g * kPanel, ms[p] + g * kPanel, dm[p]);
#pragma GCC unroll 2
    for (int64_t i = g * kGroup / 2; i < (g + 1) * kGroup / 2; ++i) {
      __m512bh b[P];
#pragma GCC unroll 32
      for (int p = 0; p < P; ++p) b[p] = pair_weights<C, S>(q[p], i, dm[p]);
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

// x [M, K] bf16 as the blocks read it: each row's pairs of inputs as 32-bit words, in place, or
// copied where K is odd (each row's last pair padded with a zero) or x starts between two words (a
// view at an odd offset: `padded` holds the copy)
const uint32_t* pairs_of(const at::Tensor& xin, int64_t pairs, std::vector<uint32_t>& padded) {
  const int64_t m = xin.size(0), k = xin.size(1);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xin.data_ptr<at::BFloat16>());
  if (k % 2 == 0 && reinterpret_cast<uintptr_t>(xp) % alignof(uint32_t) == 0) return xp;
  padded.resize(static_cast<size_t>(m * pairs));
  const auto* src = reinterpret_cast<const uint16_t*>(xin.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t i = 0; i < pairs; ++i)
      padded[r * pairs + i] = src[r * k + 2 * i] | (2 * i + 1 < k ? uint32_t{src[r * k + 2 * i + 1]} << 16 : 0u);
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
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
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
  TORCH_CHECK((x.size(1) + 1) / 2 == pairs, "x has ", x.size(1), " columns, the weight ", 2 * pairs - 1, " or ", 2 * pairs);
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
  project(xp, m, pairs, panels, n, b, kBlockRows, y.data_ptr<c10::BFloat16>(),
          [&](int64_t p, int64_t, std::vector<uint16_t>&) { return w + p * pairs * 2 * kPanel; });
  return y;
}

#if TERCET_BF16_GEMM
// bf16_block_linear over one layout: codes of kind C, d and m of type S
template <Codes C, typename S>
void codes_linear(const uint32_t* xp, int64_t m, const uint8_t* c, const S* d, const S* mo, int64_t panels,
                  int64_t pairs, int64_t n, const float* b, c10::BFloat16* out) {
  const int64_t k = 2 * pairs, sstride = (k / kGroup) * kPanel, cstride = (k / per_byte(C)) * kPanel;  // a panel's
  if (m <= kDirectRows) {  // straight from the codes
    const int64_t width = direct_panels(static_cast<int>(m));
    at::parallel_for(0, (panels + width - 1) / width, std::max<int64_t>(1, 16 / width), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = width * t, count = std::min<int64_t>(width, panels - p);
        const int64_t cols = std::min(count * kPanel, n - p * kPanel);
        const float* pb = b != nullptr ? b + p * kPanel : nullptr;
        kDirect<C, S>[m - 1](xp, pairs, c + p * cstride, d + p * sstride, mo + p * sstride, pairs, count,
                             out + p * kPanel, n, cols, pb);
      }
    });
    return;
  }
  project(xp, m, pairs, panels, n, b, kCodeBlockRows, out, [&](int64_t p, int64_t count, std::vector<uint16_t>& buf) {
    buf.resize(static_cast<size_t>(kPanels * pairs * 2 * kPanel));
    decode_panels<C, S>(c + p * cstride, d + p * sstride, mo + p * sstride, pairs, count, buf.data());
    return static_cast<const uint16_t*>(buf.data());
  });
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
  const auto [panels, k, nibbles] = block_codes::check(codes, scales, offsets, "pack_bf16_block_codes");
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

bool bf16_linear_available() { return TERCET_BF16_GEMM; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tercet, m) {
  m.def("pack_bf16_weight(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("bf16_block_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int n, Tensor? bias) -> Tensor");
  m.def("bf16_linear_available() -> bool", &bf16_linear_available);
  m.impl("pack_bf16_weight", c10::DispatchKey::CPU, TORCH_FN(pack_bf16_weight));
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
  m.impl("bf16_block_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_block_linear));
}

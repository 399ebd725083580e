// fp32 projections y = x W^T (+ b), W prepacked once at load; written over vec.h (AVX-512 or
// AVX2 + FMA + F16C).
//
// Why: MKL's sgemm and oneDNN's reach 50-65 % of the FMA peak on SmolLM2's shapes (K = 576 / 1536,
// 1-2048 rows) on an AVX2 EPYC (Zen 3); a register-blocked kernel over a prepacked W does better,
// and at a few rows it streams W once at memory speed. On AVX-512 (Zen 5) it is even with
// oneDNN's prepacked fp32 GEMM at 8-64 rows (~90 % of the FMA peak) and ahead at 1-2.
//
// Layout: W [N, K] is packed into panels of 16 output columns, [ceil(N/16), K, 16] (the last
// panel zero-padded), the same on both builds. A register block is kRows rows of y by kPanels
// panels (AVX2: 6 x 16 in 12 ymm; AVX-512: 8 x 48 in 24 zmm) while k runs over K; each step
// loads the panels' weights at k and broadcasts the rows' inputs.
//
// Each output is one fp32 accumulator fed k = 0, 1, ..., K-1 in order, one fused multiply-add per
// k, whatever the number of rows, the blocking, the threads or the vector width: a row's result
// does not depend on the batch (batch-invariant), and the AVX2 and AVX-512 builds give the same bits.
//
//   pack_linear_weight(w [N, K] fp32) -> packed [ceil(N/16), K, 16]
//   packed_linear(x [M, K] fp32, packed, n, bias?) -> y [M, n]
//   packed_linear_available() -> whether this build has the vector kernel
//
// Block codes: weights dequantized from a GGUF (Q4_1, Q8_0) are, per row and 32 k, exactly
// float(q) * d + m (each op rounded in fp32) with an integer q and fp16 d, m. Found at load, they
// are kept as int8 codes [ceil(N/16), K, 16] and per-block d, m [ceil(N/16), K/32, 16]: 1.25 bytes
// a weight instead of 4. The kernel rebuilds each panel in fp32 (the same bits) into a per-thread
// buffer and runs the same blocks over it, so y has the bits of packed_linear on the fp32 weights;
// at one or two rows, where W is streamed once per token from memory, it rebuilds the weights in
// registers and reads 3.2x fewer bytes.
//
//   pack_block_codes(w [N, K] fp32) -> [codes, scales, offsets], or [] where W is not exactly so
//   block_linear(x [M, K] fp32, codes, scales, offsets, n, bias?) -> y [M, n]

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "vec.h"

#define TERCET_GEMM TERCET_VEC

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
#if defined(__AVX512F__)
constexpr int kRows = 8;    // rows per register block
constexpr int kPanels = 3;  // panels per register block: 8 x 3 zmm accumulators of the 32 (SmolLM2's
                            // widths are multiples of 48; 12 x 2, 6 x 4, 14 x 2 measured the same)
#else
constexpr int kRows = 6;    // 6 x 2 ymm of the 16
constexpr int kPanels = 1;
#endif
constexpr int64_t kBlockRows = 96;  // rows whose inputs stay in L2 while the panels pass (a multiple of kRows)
constexpr int64_t kCodeBlockRows = 384;  // the same for block codes: each pass decodes every panel once
constexpr int64_t kGroup = 32;      // k per block of codes (GGUF's Q4_1 and Q8_0 blocks)
// products of up to this many rows decode the codes in registers, no buffer (AVX2: at 3-4 rows that
// measured even with the buffer for the layers' shapes and slower for the LM head; AVX-512, up to
// a block's rows: 1.1-2.4x the fp32 kernel at 3-8 rows for qkv and gate_up, where the buffer path
// made 0.66-1.3x: bench_gemm)
constexpr int64_t kDirectRows = kRows > 6 ? kRows : 2;
#if TERCET_GEMM
constexpr int kVecs = kPanel / vec::kLanes;  // vectors per panel row
// Panels per call of the direct code paths, by rows: AVX2 8 accumulator chains for one row and two;
// AVX-512 4 for one row (8 panels split 576 columns unevenly between two threads and measured no
// faster), 8 for two, and a block's 3 panels from three rows up
constexpr int direct_panels(int rows) { return rows == 1 ? 4 : rows == 2 ? 8 / kVecs / 2 : kPanels; }
// The rows' inputs: read in place on AVX-512 (grouping them measured 5-20 % slower at 1-8 rows),
// grouped by kRows, interleaved [k][kRows], on AVX2 (one stream for the broadcasts; in place
// measured 15-25 % slower at 8-32 rows). Row r's input i at xr[r][i * kStep].
constexpr bool kInPlace = vec::kLanes == 16;
// Each panel's weights are prefetched this many k ahead (a line per k): at 8 rows, where W streams
// from memory, 1.4-1.7x (AVX-512) and 1.15-1.25x (AVX2) the hardware prefetcher alone.
constexpr int64_t kPrefetch = 64;
constexpr int64_t kStep = kInPlace ? 1 : kRows;

// The R x V accumulators of a block to R rows of y (stride ldc), cols of them, + bias.
template <int R, int V>
inline void store_rows(const vec::vf (&c)[R][V], float* y, int64_t ldc, int64_t cols, const float* bias) {
  for (int r = 0; r < R; ++r) {
    alignas(64) float row[V * vec::kLanes];
    for (int v = 0; v < V; ++v) vec::store(row + v * vec::kLanes, c[r][v]);
    float* out = y + r * ldc;
    if (bias != nullptr) {
      for (int64_t j = 0; j < cols; ++j) out[j] = row[j] + bias[j];
    } else {
      for (int64_t j = 0; j < cols; ++j) out[j] = row[j];
    }
  }
}
#endif

at::Tensor pack_linear_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "w must be a float32 CPU [N, K]");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  const auto src = w.contiguous();
  auto packed = at::zeros({panels, k, kPanel}, w.options());
  const float* s = src.data_ptr<float>();
  float* d = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < std::min(kPanel, n - p * kPanel); ++j)
        for (int64_t i = 0; i < k; ++i) d[(p * k + i) * kPanel + j] = s[(p * kPanel + j) * k + i];
  });
  return packed;
}

// Codes q [32] with v[i] == float(q[i]) * d + m, bit for bit, or false. Tried: GGUF's Q4_1
// (m the block's minimum, q 0..15, d = (max - min) / 15 in fp16) and Q8_0 (m = -0, which adds
// nothing to any value, -0 included; q -128..127, d = max |v| / 127 in fp16), d also one or
// two fp16 steps either side (the quantizer's own rounding may differ from ours).
bool exact_block(const float* v, int8_t* q, float* d_out, float* m_out) {
  float lo = v[0], hi = v[0];
  for (int64_t i = 1; i < kGroup; ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  const auto fits = [&](float d, float m, float qlo, float qhi) {
    if (!std::isfinite(d) || d < 0.f) return false;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float t = d > 0.f ? std::nearbyint(std::clamp((v[i] - m) / d, qlo, qhi)) : 0.f;
      const float w = t * d + m;  // two roundings (-ffp-contract=off), as the kernel and GGUF's reader
      if (std::memcmp(&w, &v[i], sizeof(float)) != 0) return false;
      q[i] = static_cast<int8_t>(t);
    }
    *d_out = d, *m_out = m;
    return true;
  };
  const auto near = [](float value, int step) {
    c10::Half h(value);
    h.x = static_cast<uint16_t>(h.x + step);
    return static_cast<float>(h);
  };
  for (const int step : {0, -1, 1, -2, 2})
    if (fits(near((hi - lo) / 15.f, step), lo, 0.f, 15.f)) return true;
  for (const int step : {0, -1, 1, -2, 2})
    if (fits(near(std::max(-lo, hi) / 127.f, step), -0.f, -128.f, 127.f)) return true;
  return false;
}

std::vector<at::Tensor> pack_block_codes(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "w must be a float32 CPU [N, K]");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel, groups = k / kGroup;
  if (k == 0 || k % kGroup != 0 || n == 0) return {};
  const auto src = w.contiguous();
  auto codes = at::zeros({panels, k, kPanel}, w.options().dtype(at::kChar));
  auto scales = at::zeros({panels, groups, kPanel}, w.options());
  auto offsets = at::zeros({panels, groups, kPanel}, w.options());
  const float* s = src.data_ptr<float>();
  int8_t* c = codes.data_ptr<int8_t>();
  float* d = scales.data_ptr<float>();
  float* m = offsets.data_ptr<float>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    int8_t q[kGroup];
    for (int64_t row = begin; row < end && exact.load(std::memory_order_relaxed); ++row) {
      const int64_t p = row / kPanel, j = row % kPanel;
      for (int64_t g = 0; g < groups; ++g) {
        float dg, mg;
        if (!exact_block(s + row * k + g * kGroup, q, &dg, &mg)) {
          exact = false;
          return;
        }
        d[(p * groups + g) * kPanel + j] = dg, m[(p * groups + g) * kPanel + j] = mg;
        for (int64_t i = 0; i < kGroup; ++i) c[(p * k + g * kGroup + i) * kPanel + j] = q[i];
      }
    }
  });
  if (!exact) return {};
  return {codes, scales, offsets};
}

#if TERCET_GEMM
// R rows of x (in place, ldx apart, or one group) against P consecutive panels (stride k * kPanel):
// y[r, 0:cols] (stride ldc) = x_r . panels (+ bias).
// R * P * kVecs accumulators, each one output lane summed over k in order. GCC keeps the
// fully unrolled arrays in registers (an array indexed by a loop variable was kept in memory).
template <int R, int P>
void block(const float* x, int64_t ldx, const float* panel, int64_t k, float* y, int64_t ldc, int64_t cols,
           const float* bias) {
  constexpr int V = P * kVecs;
  const float* xr[R];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) xr[r] = kInPlace ? x + r * ldx : x + r;
  vec::vf c[R][V];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) c[r][v] = vec::zero();
#pragma GCC unroll 4
  for (int64_t i = 0; i < k; ++i) {
    vec::vf b[V];
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) b[v] = vec::load(panel + (v / kVecs) * k * kPanel + i * kPanel + (v % kVecs) * vec::kLanes);
#pragma GCC unroll 32
    for (int p = 0; p < P; ++p)
      _mm_prefetch(reinterpret_cast<const char*>(panel + p * k * kPanel + (i + kPrefetch) * kPanel), _MM_HINT_T0);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const vec::vf a = vec::set1(xr[r][i * kStep]);
#pragma GCC unroll 32
      for (int v = 0; v < V; ++v) c[r][v] = vec::fmadd(a, b[v], c[r][v]);
    }
  }
  store_rows<R, V>(c, y, ldc, cols, bias);
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*);
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

// `count` consecutive panels' fp32 weights from their codes: w = float(q) * d + m, into buf [count, k, 16].
void decode_panels(const int8_t* codes, const float* scales, const float* offsets, int64_t k, int64_t count,
                   float* buf) {
  for (int64_t g = 0; g < count * (k / kGroup); ++g) {  // the panels' groups, in order (contiguous)
    vec::vf d[kVecs], m[kVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v)
      d[v] = vec::load(scales + g * kPanel + v * vec::kLanes), m[v] = vec::load(offsets + g * kPanel + v * vec::kLanes);
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) {
        const int64_t at = i * kPanel + v * vec::kLanes;
        vec::store(buf + at, vec::add(vec::mul(vec::load(codes + at), d[v]), m[v]));
      }
  }
}

// R rows (as block's x) against P panels straight from their codes, no buffer: R * P *
// kVecs accumulator chains (enough to hide the FMA latency), each output one sum over k in order,
// as block's. For products of a few rows (decode at low concurrency), where decoding into a
// buffer and reading it back costs as much as the weights' bytes save (1.4-2.2x, bench_gemm).
// Panels past `count` repeat panel 0 (computed, not stored).
template <int R, int P>
void direct(const float* x, int64_t ldx, const int8_t* codes, const float* scales, const float* offsets, int64_t k,
            int64_t count, float* y, int64_t ldc, int64_t cols, const float* bias) {
  constexpr int V = P * kVecs;
  const int8_t* q[P];
  int64_t o[P];
  for (int p = 0; p < P; ++p) {
    const int64_t at = p < count ? p : 0;
    q[p] = codes + at * k * kPanel, o[p] = at * (k / kGroup) * kPanel;
  }
  vec::vf c[R][V];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) c[r][v] = vec::zero();
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* d = scales + g * kPanel;
    const float* m = offsets + g * kPanel;
#pragma GCC unroll 4
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) {
      vec::vf a[R];
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) a[r] = vec::set1(kInPlace ? x[r * ldx + i] : x[i * kRows + r]);
#pragma GCC unroll 32
      for (int v = 0; v < V; ++v) {
        const int p = v / kVecs, lane = (v % kVecs) * vec::kLanes;
        const vec::vf w = vec::add(vec::mul(vec::load(q[p] + i * kPanel + lane), vec::load(d + o[p] + lane)),
                                   vec::load(m + o[p] + lane));
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) c[r][v] = vec::fmadd(a[r], w, c[r][v]);
      }
    }
  }
  store_rows<R, V>(c, y, ldc, cols, bias);
}
#endif

#if TERCET_GEMM
using DirectFn = void (*)(const float*, int64_t, const int8_t*, const float*, const float*, int64_t, int64_t, float*,
                          int64_t, int64_t, const float*);
template <int... R>
constexpr std::array<DirectFn, kDirectRows> directs_of(std::integer_sequence<int, R...>) {
  return {&direct<R + 1, direct_panels(R + 1)>...};
}
// kDirect[rows - 1]
constexpr auto kDirect = directs_of(std::make_integer_sequence<int, kDirectRows>());
#endif

const float* checked_bias(const std::optional<at::Tensor>& bias, int64_t n, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == n, "bias must be float32 [n]");
  return keep.data_ptr<float>();
}

#if TERCET_GEMM
// x's rows as the blocks read them (kInPlace: x itself; else in groups of kRows, interleaved per
// k: group g at [g * k * kRows], rows past m zero); rows_at(a, r, k): where row r's block starts
at::Tensor block_rows_of(const at::Tensor& x) {
  if (kInPlace) return x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = (m + kRows - 1) / kRows;
  const auto xin = x.contiguous();
  auto grouped = at::empty({groups * k * kRows}, x.options());
  float* a = grouped.data_ptr<float>();
  const float* src = xin.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t rows = std::min<int64_t>(kRows, m - g * kRows);
      float* dst = a + g * k * kRows;
      for (int64_t i = 0; i < k; ++i)
        for (int64_t r = 0; r < kRows; ++r) dst[i * kRows + r] = r < rows ? src[(g * kRows + r) * k + i] : 0.f;
    }
  });
  return grouped;
}
inline const float* rows_at(const float* a, int64_t r, int64_t k) {
  return kInPlace ? a + r * k : a + (r / kRows) * k * kRows;
}
#endif

// y = x W^T (+ b) over `panels` panels of 16 columns; panel_of(p, count, buf) gives the fp32
// weights of panels p .. p + count - 1 [count, k, 16], in place or decoded into buf (this
// thread's, kPanels * k * 16 floats).
template <typename PanelOf>
at::Tensor project(const at::Tensor& x, int64_t panels, int64_t n, const float* b, int64_t block_rows,
                   PanelOf panel_of) {
  [[maybe_unused]] const int64_t m = x.size(0), k = x.size(1);
  auto y = at::empty({m, n}, x.options());
#if TERCET_GEMM
  float* out = y.data_ptr<float>();
  if (m == 0) return y;
  const auto rows_in = block_rows_of(x);
  const float* a = rows_in.data_ptr<float>();
  // threads split the panels in units of kPanels (each its own columns of y); rows go in blocks
  // that stay in L2
  const int64_t units = (panels + kPanels - 1) / kPanels;
  const int64_t grain = std::max<int64_t>(1, 8 / kPanels / std::max<int64_t>(1, (m + kRows - 1) / kRows));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(kPanels * k * kPanel));
    for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
      const int64_t r1 = std::min(m, r0 + block_rows);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t p = u * kPanels, count = std::min<int64_t>(kPanels, panels - p);
        const int64_t cols = std::min(count * kPanel, n - p * kPanel);
        const float* panel = panel_of(p, count, buf.data());
        const float* pb = b != nullptr ? b + p * kPanel : nullptr;
        for (int64_t r = r0; r < r1; r += kRows) {
          const int64_t rows = std::min<int64_t>(kRows, r1 - r);
          kBlocks[count - 1][rows - 1](rows_at(a, r, k), k, panel, k, out + r * n + p * kPanel, n, cols, pb);
        }
      }
    }
  });
#endif
  return y;
}

void check_x(const at::Tensor& x, int64_t k, int64_t panels, int64_t n) {
  TORCH_CHECK(TERCET_GEMM, "this build has no AVX2 + FMA or AVX-512 projection kernel");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a float32 CPU [M, K]");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n does not match the packed weight");
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(), "packed must come from pack_linear_weight");
  const int64_t k = packed.size(1);
  check_x(x, k, packed.size(0), n);
  at::Tensor keep;
  const float* b = checked_bias(bias, n, keep);
  const float* w = packed.data_ptr<float>();
  return project(x, packed.size(0), n, b, kBlockRows,
                 [&](int64_t p, int64_t, float*) { return w + p * k * kPanel; });
}

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& offsets, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kPanel && codes.scalar_type() == at::kChar &&
                  codes.is_contiguous() && codes.size(1) % kGroup == 0, "codes must come from pack_block_codes");
  const int64_t panels = codes.size(0), k = codes.size(1);
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == panels && t->size(1) == k / kGroup && t->size(2) == kPanel &&
                    t->scalar_type() == at::kFloat && t->is_contiguous(), "scales and offsets must come from pack_block_codes");
  check_x(x, k, panels, n);
  at::Tensor keep;
  const float* b = checked_bias(bias, n, keep);
  [[maybe_unused]] const int8_t* c = codes.data_ptr<int8_t>();
  [[maybe_unused]] const float* d = scales.data_ptr<float>();
  [[maybe_unused]] const float* mo = offsets.data_ptr<float>();
#if TERCET_GEMM
  if (x.size(0) >= 1 && x.size(0) <= kDirectRows) {  // straight from the codes
    const int64_t m = x.size(0), sstride = (k / kGroup) * kPanel;
    const int64_t width = direct_panels(static_cast<int>(m));
    const auto rows_in = block_rows_of(x);
    const float* a = rows_in.data_ptr<float>();
    auto y = at::empty({m, n}, x.options());
    float* out = y.data_ptr<float>();
    at::parallel_for(0, (panels + width - 1) / width, std::max<int64_t>(1, 16 / width), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = width * t, count = std::min<int64_t>(width, panels - p);
        const int64_t cols = std::min(count * kPanel, n - p * kPanel);
        const float* pb = b != nullptr ? b + p * kPanel : nullptr;
        const int8_t* pc = c + p * k * kPanel;
        kDirect[m - 1](a, k, pc, d + p * sstride, mo + p * sstride, k, count, out + p * kPanel, n, cols, pb);
      }
    });
    return y;
  }
#endif
  return project(x, panels, n, b, kCodeBlockRows, [&](int64_t p, int64_t count, float* buf) {
#if TERCET_GEMM
    decode_panels(c + p * k * kPanel, d + p * (k / kGroup) * kPanel, mo + p * (k / kGroup) * kPanel, k, count, buf);
#endif
    return static_cast<const float*>(buf);
  });
}

bool packed_linear_available() { return TERCET_GEMM; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tercet, m) {
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("packed_linear_available() -> bool", &packed_linear_available);
  m.def("pack_block_codes(Tensor w) -> Tensor[]");
  m.def("block_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int n, Tensor? bias) -> Tensor");
  m.impl("pack_block_codes", c10::DispatchKey::CPU, TORCH_FN(pack_block_codes));
  m.impl("block_linear", c10::DispatchKey::CPU, TORCH_FN(block_linear));
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, TORCH_FN(pack_linear_weight));
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
}

// fp32 projections y = x W^T (+ b) on AVX2 + FMA, W prepacked once at load.
//
// Why: on an AVX2-only AMD EPYC (Zen 3, 2 cores) MKL's sgemm and oneDNN's
// reach 50-65 % of the FMA peak on SmolLM2's shapes (K = 576 / 1536, 1-2048
// rows); a register-blocked kernel over a prepacked W does better, and at a
// few rows it streams W once at memory speed.
//
// Layout: W [N, K] is packed into panels of 16 output columns, [ceil(N/16), K, 16]
// (the last panel zero-padded). A 6 x 16 block of y lives in 12 ymm registers
// while k runs over K; each step loads 16 weights and broadcasts 6 inputs.
//
// Each output is one fp32 accumulator fed k = 0, 1, ..., K-1 in order, one
// fused multiply-add per k, whatever the number of rows, the blocking or the
// threads: a row's result does not depend on the batch (batch-invariant).
//
//   pack_linear_weight(w [N, K] fp32) -> packed [ceil(N/16), K, 16]
//   packed_linear(x [M, K] fp32, packed, n, bias?) -> y [M, n]
//   packed_linear_available() -> whether this build has the AVX2 kernel
//
// Block codes: weights dequantized from a GGUF (Q4_1, Q8_0) are, per row and 32 k, exactly
// float(q) * d + m (each op rounded in fp32) with an integer q and fp16 d, m. Found at load, they
// are kept as int8 codes [ceil(N/16), K, 16] and per-block d, m [ceil(N/16), K/32, 16]: 1.25 bytes
// a weight instead of 4. The kernel rebuilds each panel in fp32 (the same bits) into a per-thread
// buffer and runs the same blocks over it, so y has the bits of packed_linear on the fp32 weights;
// at a few rows, where W is streamed once per token from memory, it reads 3.2x fewer bytes.
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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TERCET_GEMM 1
#else
#define TERCET_GEMM 0
#endif

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int kRows = 6;        // rows per register block
constexpr int64_t kBlockRows = 96;  // rows whose inputs stay in L2 while the panels pass (a multiple of kRows)
constexpr int64_t kCodeBlockRows = 384;  // the same for block codes: each pass decodes every panel once
constexpr int64_t kGroup = 32;      // k per block of codes (GGUF's Q4_1 and Q8_0 blocks)
// products of up to this many rows decode the codes in registers (at 3-4 rows that measured even
// with the buffer for the layers' shapes and slower for the LM head: bench_gemm)
constexpr int64_t kDirectRows = 2;

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
// R rows of x (one group, interleaved) against one panel: y[r, 0:cols] (stride ldc) = x_r . panel (+ bias).
// The 2R accumulators are named variables, not an array: GCC kept an array in memory and
// stored it on every k (half the speed).
// (Slicing k so that 8 KB of a panel stays in L1 measured slower here.)
template <int R>
inline void block(const float* x, const float* panel, int64_t k, float* y, int64_t ldc, int64_t cols,
                  const float* bias) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  // x: the group's rows interleaved, [k][kRows] (packed_linear groups them): one stream for the broadcasts
#pragma GCC unroll 8
  for (int64_t i = 0; i < k; ++i) {
    const __m256 b0 = _mm256_loadu_ps(panel + i * kPanel);
    const __m256 b1 = _mm256_loadu_ps(panel + i * kPanel + 8);
    const float* xi = x + i * kRows;
    __m256 a = _mm256_broadcast_ss(xi);
    c00 = _mm256_fmadd_ps(a, b0, c00), c01 = _mm256_fmadd_ps(a, b1, c01);
    if constexpr (R > 1) a = _mm256_broadcast_ss(xi + 1), c10 = _mm256_fmadd_ps(a, b0, c10), c11 = _mm256_fmadd_ps(a, b1, c11);
    if constexpr (R > 2) a = _mm256_broadcast_ss(xi + 2), c20 = _mm256_fmadd_ps(a, b0, c20), c21 = _mm256_fmadd_ps(a, b1, c21);
    if constexpr (R > 3) a = _mm256_broadcast_ss(xi + 3), c30 = _mm256_fmadd_ps(a, b0, c30), c31 = _mm256_fmadd_ps(a, b1, c31);
    if constexpr (R > 4) a = _mm256_broadcast_ss(xi + 4), c40 = _mm256_fmadd_ps(a, b0, c40), c41 = _mm256_fmadd_ps(a, b1, c41);
    if constexpr (R > 5) a = _mm256_broadcast_ss(xi + 5), c50 = _mm256_fmadd_ps(a, b0, c50), c51 = _mm256_fmadd_ps(a, b1, c51);
  }
  const __m256 lo[kRows] = {c00, c10, c20, c30, c40, c50}, hi[kRows] = {c01, c11, c21, c31, c41, c51};
  for (int r = 0; r < R; ++r) {
    alignas(32) float row[kPanel];
    _mm256_store_ps(row, lo[r]);
    _mm256_store_ps(row + 8, hi[r]);
    float* out = y + r * ldc;
    if (bias != nullptr) {
      for (int64_t j = 0; j < cols; ++j) out[j] = row[j] + bias[j];
    } else {
      for (int64_t j = 0; j < cols; ++j) out[j] = row[j];
    }
  }
}

void rows_block(int rows, const float* x, const float* panel, int64_t k, float* y, int64_t ldc, int64_t cols,
                const float* bias) {
  switch (rows) {
    case 6: block<6>(x, panel, k, y, ldc, cols, bias); break;
    case 5: block<5>(x, panel, k, y, ldc, cols, bias); break;
    case 4: block<4>(x, panel, k, y, ldc, cols, bias); break;
    case 3: block<3>(x, panel, k, y, ldc, cols, bias); break;
    case 2: block<2>(x, panel, k, y, ldc, cols, bias); break;
    default: block<1>(x, panel, k, y, ldc, cols, bias); break;
  }
}
#endif

#if TERCET_GEMM
// One panel's fp32 weights from its codes: w = float(q) * d + m, into buf [k, 16].
void decode_panel(const int8_t* codes, const float* scales, const float* offsets, int64_t k, float* buf) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const __m256 d0 = _mm256_loadu_ps(scales + g * kPanel), d1 = _mm256_loadu_ps(scales + g * kPanel + 8);
    const __m256 m0 = _mm256_loadu_ps(offsets + g * kPanel), m1 = _mm256_loadu_ps(offsets + g * kPanel + 8);
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * kPanel));
      const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
      const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
      _mm256_storeu_ps(buf + i * kPanel, _mm256_add_ps(_mm256_mul_ps(q0, d0), m0));
      _mm256_storeu_ps(buf + i * kPanel + 8, _mm256_add_ps(_mm256_mul_ps(q1, d1), m1));
    }
  }
}

// Half a panel's 8 weights at k row i of group g: float(q) * d + m.
inline __m256 decode8(const int8_t* codes, __m256 d, __m256 m) {
  const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))));
  return _mm256_add_ps(_mm256_mul_ps(q, d), m);
}

// One row against four panels straight from their codes (no buffer): eight independent
// accumulator chains hide the FMA latency that bounds one panel's two; each output still one
// sum over k in order, as block<R>. For one-row products (batch-1 decode), where the
// decode of the weights, not their use, is the work.
void row_by_four_panels(const float* x, const int8_t* codes, const float* scales, const float* offsets,
                        int64_t k, int64_t panels, float* y, int64_t n, const float* bias) {
  const int64_t cstride = k * kPanel, sstride = (k / kGroup) * kPanel;
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  const int8_t* q0 = codes;
  const int8_t* q1 = codes + (panels > 1 ? 1 : 0) * cstride;
  const int8_t* q2 = codes + (panels > 2 ? 2 : 0) * cstride;
  const int8_t* q3 = codes + (panels > 3 ? 3 : 0) * cstride;
  const int64_t o1 = (panels > 1 ? 1 : 0) * sstride, o2 = (panels > 2 ? 2 : 0) * sstride, o3 = (panels > 3 ? 3 : 0) * sstride;
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* d = scales + g * kPanel;
    const float* m = offsets + g * kPanel;
    const __m256 d00 = _mm256_loadu_ps(d), d01 = _mm256_loadu_ps(d + 8), m00 = _mm256_loadu_ps(m), m01 = _mm256_loadu_ps(m + 8);
    const __m256 d10 = _mm256_loadu_ps(d + o1), d11 = _mm256_loadu_ps(d + o1 + 8), m10 = _mm256_loadu_ps(m + o1), m11 = _mm256_loadu_ps(m + o1 + 8);
#pragma GCC unroll 4
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * kRows);
      c0 = _mm256_fmadd_ps(a, decode8(q0 + i * kPanel, d00, m00), c0);
      c1 = _mm256_fmadd_ps(a, decode8(q0 + i * kPanel + 8, d01, m01), c1);
      c2 = _mm256_fmadd_ps(a, decode8(q1 + i * kPanel, d10, m10), c2);
      c3 = _mm256_fmadd_ps(a, decode8(q1 + i * kPanel + 8, d11, m11), c3);
      c4 = _mm256_fmadd_ps(a, decode8(q2 + i * kPanel, _mm256_loadu_ps(d + o2), _mm256_loadu_ps(m + o2)), c4);
      c5 = _mm256_fmadd_ps(a, decode8(q2 + i * kPanel + 8, _mm256_loadu_ps(d + o2 + 8), _mm256_loadu_ps(m + o2 + 8)), c5);
      c6 = _mm256_fmadd_ps(a, decode8(q3 + i * kPanel, _mm256_loadu_ps(d + o3), _mm256_loadu_ps(m + o3)), c6);
      c7 = _mm256_fmadd_ps(a, decode8(q3 + i * kPanel + 8, _mm256_loadu_ps(d + o3 + 8), _mm256_loadu_ps(m + o3 + 8)), c7);
    }
  }
  const __m256 acc[8] = {c0, c1, c2, c3, c4, c5, c6, c7};
  for (int64_t p = 0; p < std::min<int64_t>(4, panels); ++p) {
    alignas(32) float row[kPanel];
    _mm256_store_ps(row, acc[2 * p]);
    _mm256_store_ps(row + 8, acc[2 * p + 1]);
    const int64_t cols = std::min(kPanel, n - p * kPanel);
    for (int64_t j = 0; j < cols; ++j) y[p * kPanel + j] = bias != nullptr ? row[j] + bias[p * kPanel + j] : row[j];
  }
}

// Two rows against two panels straight from their codes: eight accumulator chains, each
// output one sum over k in order (as block<R>). x: the rows' inputs, stride kRows per k (grouped).
// For two-row products (decode at concurrency 2), where decoding into a buffer and reading it back
// costs as much as the weights' bytes save (1.4-2.2x the buffer path, bench_gemm).
void rows_by_two_panels(const float* x, const int8_t* codes, const float* scales, const float* offsets,
                        int64_t k, int64_t panels, float* y, int64_t ldc, int64_t n, const float* bias) {
  const int64_t o1 = panels > 1 ? (k / kGroup) * kPanel : 0;
  const int8_t* q0 = codes;
  const int8_t* q1 = codes + (panels > 1 ? k * kPanel : 0);
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* d = scales + g * kPanel;
    const float* m = offsets + g * kPanel;
#pragma GCC unroll 4
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) {
      const __m256 w0 = decode8(q0 + i * kPanel, _mm256_loadu_ps(d), _mm256_loadu_ps(m));
      const __m256 w1 = decode8(q0 + i * kPanel + 8, _mm256_loadu_ps(d + 8), _mm256_loadu_ps(m + 8));
      const __m256 w2 = decode8(q1 + i * kPanel, _mm256_loadu_ps(d + o1), _mm256_loadu_ps(m + o1));
      const __m256 w3 = decode8(q1 + i * kPanel + 8, _mm256_loadu_ps(d + o1 + 8), _mm256_loadu_ps(m + o1 + 8));
      const __m256 a0 = _mm256_broadcast_ss(x + i * kRows);
      c00 = _mm256_fmadd_ps(a0, w0, c00), c01 = _mm256_fmadd_ps(a0, w1, c01);
      c02 = _mm256_fmadd_ps(a0, w2, c02), c03 = _mm256_fmadd_ps(a0, w3, c03);
      const __m256 a1 = _mm256_broadcast_ss(x + i * kRows + 1);
      c10 = _mm256_fmadd_ps(a1, w0, c10), c11 = _mm256_fmadd_ps(a1, w1, c11);
      c12 = _mm256_fmadd_ps(a1, w2, c12), c13 = _mm256_fmadd_ps(a1, w3, c13);
    }
  }
  const __m256 acc[2][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}};
  for (int r = 0; r < 2; ++r)
    for (int64_t p = 0; p < std::min<int64_t>(2, panels); ++p) {
      alignas(32) float row[kPanel];
      _mm256_store_ps(row, acc[r][2 * p]);
      _mm256_store_ps(row + 8, acc[r][2 * p + 1]);
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      float* out = y + r * ldc + p * kPanel;
      for (int64_t j = 0; j < cols; ++j) out[j] = bias != nullptr ? row[j] + bias[p * kPanel + j] : row[j];
    }
}
#endif

const float* checked_bias(const std::optional<at::Tensor>& bias, int64_t n, at::Tensor& keep) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == n, "bias must be float32 [n]");
  return keep.data_ptr<float>();
}

// y = x W^T (+ b) over `panels` panels of 16 columns; panel_of(p, buf) gives panel p's fp32
// weights [k, 16], in place or decoded into buf (this thread's, k * 16 floats).
template <typename PanelOf>
at::Tensor project(const at::Tensor& x, int64_t panels, int64_t n, const float* b, int64_t block_rows,
                   PanelOf panel_of) {
  [[maybe_unused]] const int64_t m = x.size(0), k = x.size(1);
  const auto xin = x.contiguous();
  auto y = at::empty({m, n}, x.options());
#if TERCET_GEMM
  float* out = y.data_ptr<float>();
  if (m == 0) return y;
  // x's rows in groups of kRows, interleaved per k: group g at a + g * k * kRows
  const int64_t groups = (m + kRows - 1) / kRows;
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
  // threads split the panels (each its own columns of y); rows go in blocks that stay in L2
  const int64_t grain = std::max<int64_t>(1, 8 / std::max<int64_t>(1, (m + kRows - 1) / kRows));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(k * kPanel));
    for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
      const int64_t r1 = std::min(m, r0 + block_rows);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        const float* panel = panel_of(p, buf.data());
        const float* pb = b != nullptr ? b + p * kPanel : nullptr;
        for (int64_t r = r0; r < r1; r += kRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kRows, r1 - r));
          rows_block(rows, a + (r / kRows) * k * kRows, panel, k, out + r * n + p * kPanel, n, cols, pb);
        }
      }
    }
  });
#endif
  return y;
}

void check_x(const at::Tensor& x, int64_t k, int64_t panels, int64_t n) {
  TORCH_CHECK(TERCET_GEMM, "this build has no AVX2 + FMA projection kernel");
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
  return project(x, packed.size(0), n, b, kBlockRows, [&](int64_t p, float*) { return w + p * k * kPanel; });
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
  if (x.size(0) >= 1 && x.size(0) <= kDirectRows) {  // straight from the codes: one row over four panels, two over two
    const int64_t m = x.size(0), sstride = (k / kGroup) * kPanel, width = m == 1 ? 4 : 2;
    const auto xin = x.contiguous();
    const float* src = xin.data_ptr<float>();
    std::vector<float> xg(static_cast<size_t>(k * kRows), 0.f);  // one group of kRows, interleaved per k
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i) xg[i * kRows + r] = src[r * k + i];
    auto y = at::empty({m, n}, x.options());
    float* out = y.data_ptr<float>();
    at::parallel_for(0, (panels + width - 1) / width, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = width * t, count = std::min<int64_t>(width, panels - p);
        const float* pb = b != nullptr ? b + p * kPanel : nullptr;
        const int8_t* pc = c + p * k * kPanel;
        if (m == 1)
          row_by_four_panels(xg.data(), pc, d + p * sstride, mo + p * sstride, k, count, out + p * kPanel,
                             n - p * kPanel, pb);
        else
          rows_by_two_panels(xg.data(), pc, d + p * sstride, mo + p * sstride, k, count, out + p * kPanel, n,
                             n - p * kPanel, pb);
      }
    });
    return y;
  }
#endif
  return project(x, panels, n, b, kCodeBlockRows, [&](int64_t p, float* buf) {
#if TERCET_GEMM
    decode_panel(c + p * k * kPanel, d + p * (k / kGroup) * kPanel, mo + p * (k / kGroup) * kPanel, k, buf);
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

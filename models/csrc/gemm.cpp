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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

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

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(TERCET_GEMM, "packed_linear: this build has no AVX2 + FMA kernel");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a float32 CPU [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(), "packed must come from pack_linear_weight");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " columns, the weight ", packed.size(1));
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n does not match the packed weight");
  const float* b = nullptr;
  at::Tensor bias_in;
  if (bias.has_value() && bias->defined()) {
    bias_in = bias->contiguous();
    TORCH_CHECK(bias_in.scalar_type() == at::kFloat && bias_in.numel() == n, "bias must be float32 [n]");
    b = bias_in.data_ptr<float>();
  }
  const auto xin = x.contiguous();
  auto y = at::empty({m, n}, x.options());
#if TERCET_GEMM
  const float* w = packed.data_ptr<float>();
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
    for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
      const int64_t r1 = std::min(m, r0 + kBlockRows);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t cols = std::min(kPanel, n - p * kPanel);
        const float* panel = w + p * k * kPanel;
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

bool packed_linear_available() { return TERCET_GEMM; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tercet, m) {
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("packed_linear_available() -> bool", &packed_linear_available);
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, TORCH_FN(pack_linear_weight));
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
}

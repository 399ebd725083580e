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
#endif

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(TERCET_BF16_GEMM, "this build has no AVX512_BF16 projection kernel (the CPU lacks avx512_bf16)");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 2 * kPanel && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.device().is_cpu(), "packed must come from pack_bf16_weight");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be a bfloat16 CPU [M, K]");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK((k + 1) / 2 == pairs, "x has ", k, " columns, the weight ", 2 * pairs - 1, " or ", 2 * pairs);
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "n does not match the packed weight");
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK((bias->scalar_type() == at::kBFloat16 || bias->scalar_type() == at::kFloat) && bias->dim() == 1 &&
                    bias->numel() == n && bias->device().is_cpu(), "bias must be a bfloat16 or float32 CPU [n]");
    b32 = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({m, n}, x.options());
#if TERCET_BF16_GEMM
  if (m == 0) return y;
  const float* b = b32.defined() ? b32.data_ptr<float>() : nullptr;
  // x's rows as pairs of inputs (32-bit words), read in place; copied where K is odd (each row's last
  // pair padded with a zero) or x starts between two words (a view at an odd offset)
  const auto xin = x.contiguous();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xin.data_ptr<at::BFloat16>());
  std::vector<uint32_t> padded;
  if (k % 2 != 0 || reinterpret_cast<uintptr_t>(xp) % alignof(uint32_t) != 0) {
    padded.resize(static_cast<size_t>(m * pairs));
    const auto* src = reinterpret_cast<const uint16_t*>(xin.data_ptr<at::BFloat16>());
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < pairs; ++i)
        padded[r * pairs + i] = src[r * k + 2 * i] | (2 * i + 1 < k ? uint32_t{src[r * k + 2 * i + 1]} << 16 : 0u);
    xp = padded.data();
  }
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* out = y.data_ptr<c10::BFloat16>();
  // threads split the panels in units of kPanels (each its own columns of y); rows go in blocks
  // that stay in L2
  const int64_t units = (panels + kPanels - 1) / kPanels;
  const int64_t grain = std::max<int64_t>(1, 8 / kPanels / ((m + kRows - 1) / kRows));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
      const int64_t r1 = std::min(m, r0 + kBlockRows);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t p = u * kPanels, count = std::min<int64_t>(kPanels, panels - p);
        const int64_t cols = std::min(count * kPanel, n - p * kPanel);
        const uint16_t* panel = w + p * pairs * 2 * kPanel;
        const float* pb = b != nullptr ? b + p * kPanel : nullptr;
        for (int64_t r = r0; r < r1; r += kRows) {
          const int64_t rows = std::min<int64_t>(kRows, r1 - r);
          kBlocks[count - 1][rows - 1](xp + r * pairs, pairs, panel, pairs, out + r * n + p * kPanel, n, cols, pb);
        }
      }
    }
  });
#endif
  return y;
}

bool bf16_linear_available() { return TERCET_BF16_GEMM; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tercet, m) {
  m.def("pack_bf16_weight(Tensor w) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("bf16_linear_available() -> bool", &bf16_linear_available);
  m.impl("pack_bf16_weight", c10::DispatchKey::CPU, TORCH_FN(pack_bf16_weight));
  m.impl("bf16_linear", c10::DispatchKey::CPU, TORCH_FN(bf16_linear));
}

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
// Block codes: weights dequantized from a GGUF (Q4_1, Q4_0, Q8_0) are, per row and 32 k, exactly
// float(q) * d + m (each op rounded in fp32) with an integer q and fp16 d, m. Found at load, they
// are kept as codes in panels, [ceil(N/16), K / per byte, 16], and per-block d, m [ceil(N/16), K/32, 16]:
//   - codes: two a byte where every code of the weight fits 4 bits (Q4_1's 0..15: uint8; Q4_0's
//     -8..7: int8, two's complement nibbles), k = 2i in byte i's low nibble, 2i + 1 in its high
//     one; else one int8 a code (Q8_0, or a weight of both kinds);
//   - d and m: fp16 where every one of the weight is exactly an fp16 (a GGUF's always are), else fp32.
// On AVX2, 0..15 nibbles with fp16 d, m may go in octets instead (octet_codes, below: the same bytes,
// int32 [ceil(N/16), K/8, 16]), which products of up to four rows read with fewer instructions.
// So a Q4_1 weight takes 0.625 bytes instead of 4, as in the GGUF file (Q8_0: 1.125, m kept); with
// compact=false, one int8 a code and fp32 d, m (1.25 bytes a weight, the layout before nibbles).
// Every layout rebuilds the same fp32 weights. The kernel rebuilds each panel in fp32 (the same
// bits) into a per-thread buffer and runs the same blocks over it, so y has the bits of
// packed_linear on the fp32 weights; at a few rows, where W is streamed once per token from
// memory, it rebuilds the weights in registers and reads 6.4x fewer bytes (Q4_1) than the panels.
//
//   pack_block_codes(w [N, K] fp32, compact = true) -> [codes, scales, offsets], or [] where W is not exactly so
//   block_linear(x [M, K] fp32, codes, scales, offsets, n, bias?) -> y [M, n]
//   octet_codes(codes [P, K/2, 16] uint8, scales, offsets [P, K/32, 16] fp16) -> [octets [P, K/8, 16] int32,
//     scales, offsets]: the same codes as octets, the three in pairs of panels (below)
//   octet_codes_preferred() -> whether this build reads octets (AVX2; AVX-512 keeps the nibbles)

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

#include "block_codes.h"
#include "share.h"
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
// octets go straight from the codes (direct_octets, one call a panel's rows) up to 3 rows: against their buffer
// path (rebuild into a buffer, then the fp32 blocks) SmolLM2's projections at 3 rows 1.45-1.62x (Zen 3 EPYC, 2
// threads). Decode steps of one request with its drafts are 2-5 rows.
constexpr int64_t kOctetDirectRows = 3;
// AVX2, past those rows and up to grouped_rows(C): still from the codes, no buffer, a group of rows after another
// over each panel (its codes in L1 for the next group; a last lone row read in place, a group never across a
// block of kRows). Octets: 4-5 rows at once (block_octets), 6-8 in threes then the rest; bytes (the LM head's
// Q8_0) and nibbles: pairs. Alternated on a Zen 3 EPYC (2 threads, SmolLM2): against the buffer path, octets in threes at
// 5-8 rows 1.00-1.08x a projection, the head in pairs at 3-4 rows 1.09-1.11x (at 5-8 0.83-0.96x: not taken);
// decode steps at 3-8 rows 1.02x. Then block_octets against direct_octets at 4 rows and threes + 2 at 5: steps
// 1.05-1.06x; at 6 rows against threes 0.87x (not taken). AVX-512 keeps its direct rows.
constexpr int64_t kGroupedOctetRows = 8, kGroupedRows = 4;
// A call on one panel of a pair (two rows up, and the buffer path past them) reads every other block's
// bytes: those calls ask for their lines this many blocks ahead (without: 2-4 rows 4-9 % slower, 8 rows 5 %,
// than panel after panel; with: even, alternated in one window on a Zen 3 EPYC)
constexpr int64_t kOctetAhead = 4;  // blocks
// direct's codes (and d, m) asked for this many groups of 32 k ahead, on AVX2: SmolLM2's Q8_0 head at one row, from
// memory, 2 threads, against the hardware prefetchers alone, alternated in one process (Zen 3 EPYC): 1.03x and 1.12x
// (medians of two runs); 2 and 8 groups measured no better. Not measured with AVX-512, so not asked there.
#if defined(__AVX512F__)
constexpr int64_t kDirectAhead = 0;
#else
constexpr int64_t kDirectAhead = 4;
#endif
#if TERCET_GEMM
constexpr int kVecs = kPanel / vec::kLanes;  // vectors per panel row
// Panels per call of the direct code paths, by rows: AVX2 4 accumulator chains for one row (two panels,
// the group's d and m in registers; four panels spilled them and made SmolLM2's projections 4-8 % slower
// on a Zen 3 EPYC), 4 for two (with k in pairs for the nibbles, 8 spilled to the stack: one panel
// measured 5-10 % faster at two rows than two panels, Q4_1 and Q8_0 alike, on an AVX-512 Xeon built
// for AVX2); AVX-512 4 for
// one row (8 panels split 576 columns unevenly between two threads and measured no faster), 8 for
// two, and a block's 3 panels from three rows up
constexpr int direct_panels(int rows) {
  return rows == 1 ? (kVecs == 2 ? 2 : 4) : rows == 2 ? (kVecs == 2 ? 1 : 4) : kPanels;
}
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
// (m the block's minimum, q 0..15, d = (max - min) / 15 in fp16), Q4_0 (m = -0, which adds
// nothing to any value, -0 included; q -8..7, d = -v / 8 in fp16 for the v of largest magnitude,
// so d < 0 where that v is positive) and Q8_0 (m = -0; q -128..127, d = max |v| / 127 in fp16),
// d also one or two fp16 steps either side (the quantizer's own rounding may differ from ours).
// The 4-bit forms first, Q4_0's first where `signed_first`: many Q4_0 blocks are also exactly
// Q4_1's form (codes q + 8, m = -8d), and a weight packs into nibbles only where all its blocks
// have the one form.
bool exact_block(const float* v, bool signed_first, int8_t* q, float* d_out, float* m_out) {
  float lo = v[0], hi = v[0], far = v[0];
  for (int64_t i = 1; i < kGroup; ++i) {
    lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
    if (std::fabs(v[i]) > std::fabs(far)) far = v[i];
  }
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  const auto fits = [&](float d, float m, float qlo, float qhi) {
    if (!std::isfinite(d)) return false;
    for (int64_t i = 0; i < kGroup; ++i) {
      // the code as the kernel sees it, float(int): -0 made +0 (Q4_0's d < 0 turns a zero code into -0)
      const int code = d != 0.f ? static_cast<int>(std::nearbyint(std::clamp((v[i] - m) / d, qlo, qhi))) : 0;
      const float t = static_cast<float>(code);
      const float w = t * d + m;  // two roundings (-ffp-contract=off), as the kernel and GGUF's reader
      if (std::memcmp(&w, &v[i], sizeof(float)) != 0) return false;
      q[i] = static_cast<int8_t>(code);
    }
    *d_out = d, *m_out = m;
    return true;
  };
  const auto near = [](float value, int step) {
    c10::Half h(value);
    h.x = static_cast<uint16_t>(h.x + step);
    return static_cast<float>(h);
  };
  const auto q4_1 = [&] {
    for (const int step : {0, -1, 1, -2, 2})
      if (fits(near((hi - lo) / 15.f, step), lo, 0.f, 15.f)) return true;
    return false;
  };
  const auto q4_0 = [&] {
    for (const int step : {0, -1, 1, -2, 2})
      if (fits(near(far / -8.f, step), -0.f, -8.f, 7.f)) return true;
    return false;
  };
  if (signed_first ? q4_0() || q4_1() : q4_1() || q4_0()) return true;
  for (const int step : {0, -1, 1, -2, 2})
    if (fits(near(std::max(-lo, hi) / 127.f, step), -0.f, -128.f, 127.f)) return true;
  return false;
}

// How a weight's codes are kept: one int8 a code, or two a byte (k = 2i low, 2i + 1 high):
// 0..15 (uint8) or -8..7 (int8, two's complement nibbles); or 0..15 as octets (octet_codes)
enum class Codes { kBytes, kNibbles, kSignedNibbles, kOctets };
constexpr int64_t direct_rows(Codes c) { return c == Codes::kOctets ? kOctetDirectRows : kDirectRows; }
constexpr int64_t grouped_rows(Codes c) {
  return kInPlace ? direct_rows(c) : c == Codes::kOctets ? kGroupedOctetRows : kGroupedRows;
}
constexpr int64_t per_byte(Codes c) { return c == Codes::kBytes ? 1 : 2; }

// Octets: per panel and block g of 32 k, four rows j = 0..3 of 16 int32 lanes, lane l of row j holding
// the codes of k = 32g + 4t + j (t = 0..7) in its bits 4t..4t + 3 (row 4g + j of [P, K/8, 16]).
// Code t masked in place is q * 16^t, exactly (t = 7 shifted down instead: a mask would leave the
// sign bit set), and float(q * 16^t) * (d * 16^-t) is float(q) * d, exactly the same real number (d
// an fp16, so d * 16^-7 is far from fp32's subnormals): one rounded fused multiply-add rebuilds the
// same weight from one AND and one conversion a code, where nibbles take a shuffle, a shift or an
// AND, and a conversion (SmolLM2's projections at one row: ~15 % fewer cycles on a Zen 3 EPYC).
// Built for AVX2 only (octet_codes_preferred): the AVX-512 kernel keeps the nibbles.
#if TERCET_GEMM && !defined(__AVX512F__)
constexpr bool kOctetBuild = true;
#else
constexpr bool kOctetBuild = false;
#endif

bool octet_codes_preferred() { return kOctetBuild; }

// Octets keep their panels in pairs (2q and 2q + 1; a last odd panel alone): per block g of 32 k, the
// pair's four rows panel after panel, and its d and its m the same way. A one-row product takes a pair a
// call, so each of codes, d and m is read as one stream, in order, across a thread's panels. Panel after
// panel (the nibbles' order), each call began six short streams (two panels' codes, d and m) and a
// standalone copy of the one-row loop ran 1.35-1.5x slower on weights streamed from memory (Zen 3 EPYC,
// one thread), where the same loop over data in cache runs the same in either order.
// Element `e` of panel p's block g (`per` elements a panel and block: 64 codes lanes, 16 scales):
inline int64_t octet_at(int64_t panels, int64_t groups, int64_t p, int64_t g, int64_t per) {
  const int64_t pair = p / 2, width = (p | 1) < panels ? 2 : 1;
  return (pair * 2 * groups + g * width + p % 2) * per;
}

struct OctetPanel {  // one panel of octets: block g's rows at q + g * qs, its d and m at d + g * ss, m + g * ss
  const int32_t* q;
  const c10::Half* d;
  const c10::Half* m;
  int64_t qs, ss;
};

inline OctetPanel octet_panel(const int32_t* q, const c10::Half* d, const c10::Half* m, int64_t panels,
                              int64_t groups, int64_t p) {
  const int64_t width = (p | 1) < panels ? 2 : 1, s = octet_at(panels, groups, p, 0, kPanel);
  return {q + octet_at(panels, groups, p, 0, 4 * kPanel), d + s, m + s, width * 4 * kPanel, width * kPanel};
}

std::vector<at::Tensor> octet_codes(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == kPanel &&
                  codes.is_contiguous() && codes.size(1) > 0 && (codes.size(1) * 2) % kGroup == 0,
              "codes must be pack_block_codes' 0..15 nibbles [P, K/2, 16]");
  const int64_t panels = codes.size(0), k = codes.size(1) * 2, groups = k / kGroup;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && offsets.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  offsets.is_contiguous() && scales.sizes() == at::IntArrayRef({panels, groups, kPanel}) &&
                  offsets.sizes() == scales.sizes(),
              "octets take pack_block_codes' fp16 scales and offsets [P, K/32, 16] beside their codes");
  auto out = at::empty({panels, k / 8, kPanel}, codes.options().dtype(at::kInt));
  auto d_out = at::empty(scales.sizes(), scales.options()), m_out = at::empty(offsets.sizes(), offsets.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  auto* o = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  const c10::Half *d = scales.data_ptr<c10::Half>(), *m = offsets.data_ptr<c10::Half>();
  c10::Half *dq = d_out.data_ptr<c10::Half>(), *mq = m_out.data_ptr<c10::Half>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t j = 0; j < 4; ++j)
          for (int64_t l = 0; l < kPanel; ++l) {
            uint32_t lane = 0;
            for (int64_t t = 0; t < 8; ++t) {
              const int64_t i = g * kGroup + 4 * t + j;
              const uint8_t byte = c[(p * (k / 2) + i / 2) * kPanel + l];
              lane |= static_cast<uint32_t>(i % 2 ? byte >> 4 : byte & 15) << (4 * t);
            }
            o[octet_at(panels, groups, p, g, 4 * kPanel) + j * kPanel + l] = lane;
          }
        const int64_t at = octet_at(panels, groups, p, g, kPanel), from = (p * groups + g) * kPanel;
        std::copy(d + from, d + from + kPanel, dq + at);
        std::copy(m + from, m + from + kPanel, mq + at);
      }
  });
  return {out, d_out, m_out};
}

// Whether every float of t is exactly an fp16 (bit for bit: -0 stays -0)
bool all_half(const at::Tensor& t) {
  const float* p = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float back = static_cast<float>(c10::Half(p[i]));
    if (std::memcmp(&back, p + i, sizeof(float)) != 0) return false;
  }
  return true;
}

// int8 codes [P, K, 16] -> two a byte [P, K/2, 16] (dtype: uint8 for 0..15, int8 for -8..7)
at::Tensor nibbles_of(const at::Tensor& codes, at::ScalarType dtype) {
  const int64_t panels = codes.size(0), pairs = codes.size(1) / 2;
  auto out = at::empty({panels, pairs, kPanel}, codes.options().dtype(dtype));
  const int8_t* c = codes.data_ptr<int8_t>();
  auto* o = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t i = 0; i < pairs; ++i)
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t at = (p * pairs + i) * kPanel + j, low = (p * pairs * 2 + 2 * i) * kPanel + j;
        o[at] = static_cast<uint8_t>((c[low] & 15) | ((c[low + kPanel] & 15) << 4));
      }
  return out;
}

// w's codes [P, K, 16] int8 and d, m [P, K/32, 16] fp32 (exact_block's, `signed_first` as there), or {}
std::vector<at::Tensor> find_codes(const at::Tensor& src, bool signed_first) {
  const int64_t n = src.size(0), k = src.size(1), panels = (n + kPanel - 1) / kPanel, groups = k / kGroup;
  auto codes = at::zeros({panels, k, kPanel}, src.options().dtype(at::kChar));
  auto scales = at::zeros({panels, groups, kPanel}, src.options());
  auto offsets = at::zeros({panels, groups, kPanel}, src.options());
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
        if (!exact_block(s + row * k + g * kGroup, signed_first, q, &dg, &mg)) {
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

std::pair<int, int> code_range(const at::Tensor& codes) {
  return {codes.min().item<int8_t>(), codes.max().item<int8_t>()};
}

std::vector<at::Tensor> pack_block_codes(const at::Tensor& w, bool compact) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "w must be a float32 CPU [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  if (k == 0 || k % kGroup != 0 || n == 0) return {};
  const auto src = w.contiguous();
  auto found = find_codes(src, false);
  if (found.empty() || !compact) return found;
  auto [lo, hi] = code_range(found[0]);
  if (lo < 0 && hi > 7) {  // not one 4-bit form: a Q4_0 weight some of whose blocks Q4_1's form found?
    auto again = find_codes(src, true);
    if (!again.empty()) {
      const auto [lo2, hi2] = code_range(again[0]);
      if (lo2 >= -8 && hi2 <= 7) found = again, lo = lo2, hi = hi2;
    }
  }
  at::Tensor &codes = found[0], &scales = found[1], &offsets = found[2];
  if (lo >= 0 && hi <= 15) {
    codes = nibbles_of(codes, at::kByte);
  } else if (lo >= -8 && hi <= 7) {
    codes = nibbles_of(codes, at::kChar);
  }
  if (all_half(scales) && all_half(offsets)) scales = scales.to(at::kHalf), offsets = offsets.to(at::kHalf);
  return found;
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

// The codes of k = i and i + 1 (i even) at lanes lane.. of the panels whose codes start at q, as floats.
template <Codes C>
inline void load_codes(const uint8_t* q, int64_t i, int64_t lane, vec::vf& w0, vec::vf& w1) {
  if constexpr (C == Codes::kBytes) {
    const auto* p = reinterpret_cast<const int8_t*>(q) + i * kPanel + lane;
    w0 = vec::load(p), w1 = vec::load(p + kPanel);
  } else if constexpr (C == Codes::kNibbles) {
    vec::load_nibbles(q + i / 2 * kPanel + lane, w0, w1);
  } else {
    vec::load_nibbles(reinterpret_cast<const int8_t*>(q) + i / 2 * kPanel + lane, w0, w1);
  }
}

// w = float(q) * d + m, each op rounded. With fp16 d (S = c10::Half) q * d is exact in fp32 (a code
// of at most 8 bits times an 11-bit significand, far from fp32's subnormals), so one fused
// multiply-add, rounded once, gives the same bits (a zero's sign too: an exact zero takes the sign
// rule of the addition) in one instruction instead of two.
template <typename S>
inline vec::vf rebuild(vec::vf q, vec::vf d, vec::vf m) {
  if constexpr (std::is_same_v<S, c10::Half>) {
    return vec::fmadd(q, d, m);
  } else {
    return vec::add(vec::mul(q, d), m);
  }
}

#if TERCET_GEMM && !defined(__AVX512F__)
// Octets (above): code t of row j's 8 lanes as float(q * 16^t), `mask` 15 << 4t (t < 7; t a
// constant once the loops over it are unrolled)
inline vec::vf octet_code(const int32_t* row, int t, __m256i mask) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  return _mm256_cvtepi32_ps(t == 7 ? _mm256_srli_epi32(raw, 28) : _mm256_and_si256(raw, mask));
}
// d * 16^-t for code t from d * 16^-(t - 1) (t = 7: d again), each exact
inline vec::vf octet_scale(vec::vf d, int t) { return vec::mul(d, vec::set1(t == 7 ? 16777216.f : 1.f / 16)); }
#endif

#if TERCET_GEMM && !defined(__AVX512F__)
// Block g of a panel of octets: its 32 k x 16 fp32 weights, w = float(q) * d + m (the bits of rebuild<S>), into
// out [32, 16], k in order; the lines kOctetAhead blocks on asked for (every other block's bytes where the panel
// has a pair: as direct_octets)
inline void decode_octet_block(const OctetPanel& at, int64_t g, float* out) {
  vec::vf d[kVecs], m[kVecs];
  for (int v = 0; v < kVecs; ++v)
    d[v] = vec::load(at.d + g * at.ss + v * vec::kLanes), m[v] = vec::load(at.m + g * at.ss + v * vec::kLanes);
  const int32_t* rows = at.q + g * at.qs;
  for (int l = 0; l < 4; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(rows + kOctetAhead * at.qs) + 64 * l, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(at.d + (g + kOctetAhead) * at.ss), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(at.m + (g + kOctetAhead) * at.ss), _MM_HINT_T0);
  __m256i mask = _mm256_set1_epi32(15);
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
    if (t > 0) {
      for (int v = 0; v < kVecs; ++v) d[v] = octet_scale(d[v], t);
      mask = _mm256_slli_epi32(mask, 4);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
#pragma GCC unroll 2
      for (int v = 0; v < kVecs; ++v)
        vec::store(out + (4 * t + j) * kPanel + v * vec::kLanes,
                   vec::fmadd(octet_code(rows + j * kPanel + v * vec::kLanes, t, mask), d[v], m[v]));
  }
}

// R rows (x as block's) against one panel of octets, each block decoded into 2 KB (L1) and the rows' 2R
// accumulator chains fed from there, k in order: the bits of direct_octets. With the weights decoded first,
// neither d, m nor the mask stay live beside the accumulators: direct_octets spills from 4 rows (a standalone
// copy, one thread, a Zen 3 EPYC: 4 rows 6.2-6.7 cycles a k and 16 columns against 5.8-6.3 here, 5 rows 13.4-13.9
// against 6.7-7.2, 6 rows 16 against 7.7-8.1; the FMAs alone: 1 + R)
template <int R>
void block_octets(const float* x, int64_t, const OctetPanel* at, int64_t k, float* y, int64_t ldc, int64_t cols,
                  const float* bias) {
  vec::vf c[R][kVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) c[r][v] = vec::zero();
  alignas(64) float w[kGroup * kPanel];
  for (int64_t g = 0; g < k / kGroup; ++g) {
    decode_octet_block(at[0], g, w);
#pragma GCC unroll 32
    for (int i = 0; i < kGroup; ++i) {
      vec::vf wv[kVecs];
#pragma GCC unroll 2
      for (int v = 0; v < kVecs; ++v) wv[v] = vec::load(w + i * kPanel + v * vec::kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const vec::vf a = vec::set1(x[(g * kGroup + i) * kRows + r]);
#pragma GCC unroll 2
        for (int v = 0; v < kVecs; ++v) c[r][v] = vec::fmadd(a, wv[v], c[r][v]);
      }
    }
  }
  store_rows<R, kVecs>(c, y, ldc, cols, bias);
}
#endif

// One panel of octets' fp32 weights, w = float(q) * d + m (the bits of rebuild<S>), into buf [k, 16]
void decode_octets([[maybe_unused]] const OctetPanel& at, [[maybe_unused]] int64_t groups,
                   [[maybe_unused]] float* buf) {
#if TERCET_GEMM && !defined(__AVX512F__)
  for (int64_t g = 0; g < groups; ++g) decode_octet_block(at, g, buf + g * kGroup * kPanel);
#else
  TORCH_CHECK(false, "octets need AVX2");
#endif
}

// `count` consecutive panels' fp32 weights from their codes: w = float(q) * d + m, into buf [count, k, 16].
template <Codes C, typename S>
void decode_panels(const uint8_t* codes, const S* scales, const S* offsets, int64_t k, int64_t count, float* buf) {
  static_assert(C != Codes::kOctets, "octets: decode_octets, a panel at a time");
  for (int64_t g = 0; g < count * (k / kGroup); ++g) {  // the panels' groups, in order (contiguous)
    vec::vf d[kVecs], m[kVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v)
      d[v] = vec::load(scales + g * kPanel + v * vec::kLanes), m[v] = vec::load(offsets + g * kPanel + v * vec::kLanes);
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; i += 2)
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) {
        vec::vf q0, q1;
        load_codes<C>(codes, i, v * vec::kLanes, q0, q1);
        const int64_t at = i * kPanel + v * vec::kLanes;
        vec::store(buf + at, rebuild<S>(q0, d[v], m[v]));
        vec::store(buf + at + kPanel, rebuild<S>(q1, d[v], m[v]));
      }
  }
}

// R rows (as block's x) against P panels straight from their codes, no buffer: R * P *
// kVecs accumulator chains (enough to hide the FMA latency), each output one sum over k in order,
// as block's. For products of a few rows (decode at low concurrency), where decoding into a
// buffer and reading it back costs as much as the weights' bytes save (1.4-2.2x, bench_gemm).
// k goes in pairs (a byte of nibbles), each accumulator fed k = i, then i + 1. The group's d and m
// are taken as fp32 once per group. Panels past `count` repeat panel 0 (computed, not stored). One row
// is read in place on either build (x itself: no grouped copy to make).
template <int R, int P, Codes C, typename S>
void direct(const float* x, int64_t ldx, const uint8_t* codes, const S* scales, const S* offsets, int64_t k,
            int64_t count, float* y, int64_t ldc, int64_t cols, const float* bias) {
  constexpr int V = P * kVecs;
  const block_codes::Panels<P, S> at(codes, scales, offsets, (k / per_byte(C)) * kPanel, k / kGroup, count);
  vec::vf c[R][V];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) c[r][v] = vec::zero();
  for (int64_t g = 0; g < k / kGroup; ++g) {
    if constexpr (kDirectAhead > 0) {  // (past the last group: the next panel's lines or none; a prefetch never faults)
      constexpr int64_t bytes = kGroup / per_byte(C) * kPanel;
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const char* ahead = reinterpret_cast<const char*>(at.q[p] + (g + kDirectAhead) * bytes);
#pragma GCC unroll 8
        for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(at.d[p] + (g + kDirectAhead) * kPanel), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(at.m[p] + (g + kDirectAhead) * kPanel), _MM_HINT_T0);
      }
    }
    alignas(64) float d[V * vec::kLanes], m[V * vec::kLanes];  // this group's, fp32, by v
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) {
      const int p = v / kVecs, lane = (v % kVecs) * vec::kLanes;
      vec::store(d + v * vec::kLanes, vec::load(at.d[p] + g * kPanel + lane));
      vec::store(m + v * vec::kLanes, vec::load(at.m[p] + g * kPanel + lane));
    }
#pragma GCC unroll 4
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; i += 2) {
      vec::vf a0[R], a1[R];
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) {
        a0[r] = vec::set1(kInPlace || R == 1 ? x[r * ldx + i] : x[i * kRows + r]);
        a1[r] = vec::set1(kInPlace || R == 1 ? x[r * ldx + i + 1] : x[(i + 1) * kRows + r]);
      }
#pragma GCC unroll 32
      for (int v = 0; v < V; ++v) {
        const int p = v / kVecs, lane = (v % kVecs) * vec::kLanes;
        vec::vf q0, q1;
        load_codes<C>(at.q[p], i, lane, q0, q1);
        const vec::vf dv = vec::load(d + v * vec::kLanes), mv = vec::load(m + v * vec::kLanes);
        const vec::vf w0 = rebuild<S>(q0, dv, mv);
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) c[r][v] = vec::fmadd(a0[r], w0, c[r][v]);
        const vec::vf w1 = rebuild<S>(q1, dv, mv);
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) c[r][v] = vec::fmadd(a1[r], w1, c[r][v]);
      }
    }
  }
  store_rows<R, V>(c, y, ldc, cols, bias);
}

// direct over octets (S = c10::Half): k in the same order, each block's 32 k as 8 codes t of its four
// rows j (k = 32g + 4t + j), the scale stepped to d * 16^-t between codes. One row keeps plain arrays
// and a scalar broadcast: with the R-row form's c[R][V] and a[R] (even flattened) GCC spilled an
// accumulator at one row, and octets measured no faster than nibbles.
template <int R, int P>
void direct_octets([[maybe_unused]] const float* x, [[maybe_unused]] int64_t ldx,
                   [[maybe_unused]] const OctetPanel* at, [[maybe_unused]] int64_t k, [[maybe_unused]] float* y,
                   [[maybe_unused]] int64_t ldc, [[maybe_unused]] int64_t cols, [[maybe_unused]] const float* bias) {
#if !defined(__AVX512F__)
  constexpr int V = P * kVecs;
  if constexpr (R == 1) {  // (one row: plain arrays, which GCC keeps in registers)
  __m256 c[V];
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) c[v] = _mm256_setzero_ps();
  const int groups = static_cast<int>(k / kGroup);
  for (int g = 0; g < groups; ++g) {
    __m256 m[V], dt[V];
    const int32_t* q[P];  // the panels' rows of block g
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) q[p] = at[p].q + g * at[p].qs;
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) {
      const int p = v / kVecs, lane = (v % kVecs) * vec::kLanes;
      dt[v] = vec::load(at[p].d + g * at[p].ss + lane), m[v] = vec::load(at[p].m + g * at[p].ss + lane);
    }
    const __m256 sixteenth = _mm256_set1_ps(1.f / 16);
    __m256i mask = _mm256_set1_epi32(15);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int i = g * 32 + 4 * t + j;
        const __m256 a = _mm256_set1_ps(x[i]);
#pragma GCC unroll 32
        for (int v = 0; v < V; ++v) {
          const __m256i raw = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(q[v / kVecs] + j * kPanel + (v % kVecs) * vec::kLanes));
          const __m256i code = t < 7 ? _mm256_and_si256(raw, mask) : _mm256_srli_epi32(raw, 28);
          const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), dt[v], m[v]);
          c[v] = _mm256_fmadd_ps(a, w, c[v]);
        }
      }
      if (t < 6) {
        mask = _mm256_slli_epi32(mask, 4);
#pragma GCC unroll 32
        for (int v = 0; v < V; ++v) dt[v] = _mm256_mul_ps(dt[v], sixteenth);
      } else if (t == 6) {
#pragma GCC unroll 32
        for (int v = 0; v < V; ++v) dt[v] = _mm256_mul_ps(dt[v], _mm256_set1_ps(16777216.f));
      }
    }
  }
  __m256 out[1][V];
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) out[0][v] = c[v];
  store_rows<1, V>(out, y, ldc, cols, bias);
  } else {
  __m256 c[R][V];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) c[r][v] = _mm256_setzero_ps();
  const int groups = static_cast<int>(k / kGroup);
  for (int g = 0; g < groups; ++g) {
    __m256 m[V], dt[V];
    const int32_t* q[P];  // the panels' rows of block g
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      q[p] = at[p].q + g * at[p].qs;
      // (a panel of a pair, every other block's bytes: ask for the lines kOctetAhead blocks on)
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(q[p] + kOctetAhead * at[p].qs) + 64 * l, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(at[p].d + (g + kOctetAhead) * at[p].ss), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(at[p].m + (g + kOctetAhead) * at[p].ss), _MM_HINT_T0);
    }
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) {
      const int p = v / kVecs, lane = (v % kVecs) * vec::kLanes;
      dt[v] = vec::load(at[p].d + g * at[p].ss + lane), m[v] = vec::load(at[p].m + g * at[p].ss + lane);
    }
    const __m256 sixteenth = _mm256_set1_ps(1.f / 16);
    __m256i mask = _mm256_set1_epi32(15);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int i = g * 32 + 4 * t + j;
        __m256 a[R];
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) a[r] = _mm256_set1_ps(R == 1 ? x[i] : x[i * kRows + r]);
#pragma GCC unroll 32
        for (int v = 0; v < V; ++v) {
          const __m256i raw = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(q[v / kVecs] + j * kPanel + (v % kVecs) * vec::kLanes));
          const __m256i code = t < 7 ? _mm256_and_si256(raw, mask) : _mm256_srli_epi32(raw, 28);
          const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), dt[v], m[v]);
#pragma GCC unroll 32
          for (int r = 0; r < R; ++r) c[r][v] = _mm256_fmadd_ps(a[r], w, c[r][v]);
        }
      }
      if (t < 6) {
        mask = _mm256_slli_epi32(mask, 4);
#pragma GCC unroll 32
        for (int v = 0; v < V; ++v) dt[v] = _mm256_mul_ps(dt[v], sixteenth);
      } else if (t == 6) {
#pragma GCC unroll 32
        for (int v = 0; v < V; ++v) dt[v] = _mm256_mul_ps(dt[v], _mm256_set1_ps(16777216.f));
      }
    }
  }
  store_rows<R, V>(c, y, ldc, cols, bias);
  }
#endif
}
#endif

#if TERCET_GEMM
template <Codes C, typename S>
using DirectFn = void (*)(const float*, int64_t, const uint8_t*, const S*, const S*, int64_t, int64_t, float*,
                          int64_t, int64_t, const float*);
template <int R, int P, Codes C, typename S>
constexpr DirectFn<C, S> direct_of() {
  if constexpr (C == Codes::kOctets) return nullptr;  // (octets: kOctetDirect)
  else return &direct<R, P, C, S>;
}
template <Codes C, typename S, int... R>
constexpr std::array<DirectFn<C, S>, direct_rows(C)> directs_of(std::integer_sequence<int, R...>) {
  return {direct_of<R + 1, direct_panels(R + 1), C, S>()...};
}
// kDirect<C, S>[rows - 1]
template <Codes C, typename S>
constexpr auto kDirect = directs_of<C, S>(std::make_integer_sequence<int, direct_rows(C)>());
// Half as wide (at least a panel), for the panels left after a thread's whole calls
template <Codes C, typename S, int... R>
constexpr std::array<DirectFn<C, S>, direct_rows(C)> narrow_directs_of(std::integer_sequence<int, R...>) {
  return {direct_of<R + 1, std::max(1, direct_panels(R + 1) / 2), C, S>()...};
}
template <Codes C, typename S>
constexpr auto kDirectNarrow = narrow_directs_of<C, S>(std::make_integer_sequence<int, direct_rows(C)>());
// The same for octets, by rows: each call its P panels as OctetPanel (past `count`, the first again)
using OctetFn = void (*)(const float*, int64_t, const OctetPanel*, int64_t, float*, int64_t, int64_t, const float*);
template <int... R>
constexpr std::array<OctetFn, kOctetDirectRows> octet_directs_of(std::integer_sequence<int, R...>, bool narrow) {
  return {(narrow ? &direct_octets<R + 1, std::max(1, direct_panels(R + 1) / 2)>
                  : &direct_octets<R + 1, direct_panels(R + 1)>)...};
}
constexpr auto kOctetDirect = octet_directs_of(std::make_integer_sequence<int, kOctetDirectRows>(), false);
constexpr auto kOctetNarrow = octet_directs_of(std::make_integer_sequence<int, kOctetDirectRows>(), true);
// A group of rows over one panel (grouped_rows): direct_octets up to kOctetDirectRows, block_octets past them
#if !defined(__AVX512F__)
constexpr std::array<OctetFn, 5> kOctetGroup = {&direct_octets<1, 1>, &direct_octets<2, 1>, &direct_octets<3, 1>,
                                                &block_octets<4>, &block_octets<5>};
#endif
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
  tercet::parallel(groups, 1, [&](int64_t g0, int64_t g1) {
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
  tercet::parallel(units, grain, [&](int64_t begin, int64_t end) {
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

#if TERCET_GEMM
// block_linear over one layout: codes of kind C, d and m of type S
template <Codes C, typename S>
at::Tensor codes_linear(const at::Tensor& x, const uint8_t* c, const S* d, const S* mo, int64_t panels, int64_t k,
                        int64_t n, const float* b) {
  const int64_t sstride = (k / kGroup) * kPanel, cstride = (k / per_byte(C)) * kPanel;  // a panel's, each
  if (x.size(0) >= 1 && x.size(0) <= grouped_rows(C)) {  // straight from the codes
    const int64_t m = x.size(0);
    const bool whole = m <= direct_rows(C);  // one call a panel's rows, else groups of rows (kGroupedOctetRows)
    const int64_t width = whole ? direct_panels(static_cast<int>(m)) : 1;
    const auto xin = x.contiguous();
    const auto rows_in = m == 1 ? xin : block_rows_of(xin);  // (one row is read in place: see direct)
    const float* a = rows_in.data_ptr<float>();
    // a group's first row, r of rows: in its block (r % kRows within it), or in place for a lone row
    const auto group_at = [&](int64_t r, int64_t rows) {
      return rows == 1 ? xin.data_ptr<float>() + r * k : rows_at(a, r, k) + r % kRows;
    };
    auto y = at::empty({m, n}, x.options());
    float* out = y.data_ptr<float>();
    // Each thread takes an even share of the panels, in calls of `width` and a narrower one for what is
    // left (SmolLM2's qkv, 15 panels, went to one thread as units of 4 with a grain; o and down, 9
    // units, split 5 / 4). Which thread computes a column does not change its bits.
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), panels));
    tercet::parallel(threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t last = panels * (t + 1) / threads;
        for (int64_t p = panels * t / threads; p < last;) {
          const int64_t count = std::min<int64_t>(width, last - p);
          const int64_t cols = std::min(count * kPanel, n - p * kPanel);
          const float* pb = b != nullptr ? b + p * kPanel : nullptr;
          if constexpr (C == Codes::kOctets) {
            OctetPanel at[4];  // (P <= 2 on AVX2)
            for (int64_t i = 0; i < 4; ++i)
              at[i] = octet_panel(reinterpret_cast<const int32_t*>(c), d, mo, panels, k / kGroup, p + (i < count ? i : 0));
            if (whole) {
              (count * 2 <= width ? kOctetNarrow : kOctetDirect)[m - 1](a, k, at, k, out + p * kPanel, n, cols, pb);
            } else {
#if !defined(__AVX512F__)
              for (int64_t r = 0, rows; r < m; r += rows) {  // (4-5 rows at once; 6-8 in threes, then 1-2)
                rows = m <= 5 ? m : std::min<int64_t>(3, m - r);
                kOctetGroup[rows - 1](group_at(r, rows), k, at, k, out + r * n + p * kPanel, n, cols, pb);
              }
#endif
            }
          } else if (whole) {
            const auto& fns = count * 2 <= width ? kDirectNarrow<C, S> : kDirect<C, S>;
            fns[m - 1](a, k, c + p * cstride, d + p * sstride, mo + p * sstride, k, count, out + p * kPanel, n, cols,
                       pb);
          } else {
            for (int64_t r = 0, rows; r < m; r += rows) {
              rows = std::min<int64_t>(2, m - r);  // (pairs: a group in one block of kRows)
              kDirectNarrow<C, S>[rows - 1](group_at(r, rows), k, c + p * cstride, d + p * sstride, mo + p * sstride,
                                            k, count, out + r * n + p * kPanel, n, cols, pb);
            }
          }
          p += count;
        }
      }
    });
    return y;
  }
  return project(x, panels, n, b, kCodeBlockRows, [&](int64_t p, int64_t count, float* buf) {
    if constexpr (C == Codes::kOctets) {
      for (int64_t i = 0; i < count; ++i)
        decode_octets(octet_panel(reinterpret_cast<const int32_t*>(c), d, mo, panels, k / kGroup, p + i), k / kGroup,
                      buf + i * k * kPanel);
    } else {
      decode_panels<C, S>(c + p * cstride, d + p * sstride, mo + p * sstride, k, count, buf);
    }
    return static_cast<const float*>(buf);
  });
}

template <Codes C>
at::Tensor codes_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& offsets, int64_t k, int64_t n, const float* b) {
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  if (scales.scalar_type() == at::kHalf)
    return codes_linear<C>(x, c, scales.data_ptr<c10::Half>(), offsets.data_ptr<c10::Half>(), codes.size(0), k, n, b);
  if constexpr (C == Codes::kOctets) {
    TORCH_CHECK(false, "octets need fp16 scales");  // (block_linear refuses them before)
  } else {
    return codes_linear<C>(x, c, scales.data_ptr<float>(), offsets.data_ptr<float>(), codes.size(0), k, n, b);
  }
}
#endif

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& offsets, int64_t n, const std::optional<at::Tensor>& bias) {
  const auto [panels, k, nibbles, octets] = block_codes::check(codes, scales, offsets, "pack_block_codes");
  check_x(x, k, panels, n);
  TORCH_CHECK(!octets || (kOctetBuild && scales.scalar_type() == at::kHalf),
              "octets need an AVX2 build (octet_codes_preferred) and fp16 scales");
  at::Tensor keep;
  const float* b = checked_bias(bias, n, keep);
#if TERCET_GEMM
  if (octets) return codes_linear<Codes::kOctets>(x, codes, scales, offsets, k, n, b);
  if (!nibbles) return codes_linear<Codes::kBytes>(x, codes, scales, offsets, k, n, b);
  if (codes.scalar_type() == at::kByte) return codes_linear<Codes::kNibbles>(x, codes, scales, offsets, k, n, b);
  return codes_linear<Codes::kSignedNibbles>(x, codes, scales, offsets, k, n, b);
#else
  return at::Tensor();  // (check_x refused: no vector kernel in this build)
#endif
}

bool packed_linear_available() { return TERCET_GEMM; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tercet, m) {
  m.def("pack_linear_weight(Tensor w) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("packed_linear_available() -> bool", &packed_linear_available);
  m.def("pack_block_codes(Tensor w, bool compact=True) -> Tensor[]");
  m.def("block_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int n, Tensor? bias) -> Tensor");
  m.def("octet_codes(Tensor codes, Tensor scales, Tensor offsets) -> Tensor[]");
  m.def("octet_codes_preferred() -> bool", &octet_codes_preferred);
  m.impl("octet_codes", c10::DispatchKey::CPU, TORCH_FN(octet_codes));
  m.impl("pack_block_codes", c10::DispatchKey::CPU, TORCH_FN(pack_block_codes));
  m.impl("block_linear", c10::DispatchKey::CPU, TORCH_FN(block_linear));
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, TORCH_FN(pack_linear_weight));
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
}

// Block-coded projections with int8 activations (the opt-in `int8_activations` mode): y = x W^T (+ b) where W is
// GGUF block codes (w = q * d + m per 32 k, as pack_block_codes finds them) and each row of x is rounded, per block
// of 32 k, to int8 codes qx with one fp32 scale dx (x ~ qx * dx), as llama.cpp multiplies its Q4 and Q8 weights
// (its Q8_1 activations). A block's products are then exact integers:
//
//   sum_k w_k x_k ~ d dx sum_k q_k qx_k + m sx,  sx = dx sum_k qx_k
//
// Why: the exact fp32 path rebuilds each weight and multiplies it in fp32, two FMAs a weight and output row; on an
// AVX2 CPU without bf16 units that is the floor (a Zen 3 EPYC: one row at ~55 % of the memory bound, 64 rows at
// ~85 % of the fp32 FMA peak). Here 32 products of a 4-bit code and an int8 take one vpmaddubsw and one 16-bit add,
// and a block's fp32 work is two FMAs per output and row (SmolLM2's projections 1.2-2.6x the fp32 kernel). On
// AVX512-VNNI, vpdpbusd over pairs of panels a zmm; on a Zen 4 (with AVX512-BF16) that is twice vdpbf16ps's
// multiply-adds a cycle, but a block's fp32 work runs on the same pipes (~2/3 of vpdpbusd's peak at most): 1.4-3.2x
// the bf16 kernel at one row, 1.04-1.4x at 64-512 rows. It changes the outputs (the activations are rounded to 8
// bits, ~0.4 % of a block's largest value), which is why it is a mode of its own, off by default.
// Figures: benchmarks/results/2026-12-07-zen4-int8, 2026-12-07-zen4-i8-tiles.
//
// The bits: each (row, output) is one fp32 accumulator fed block after block in order, y = fma(float(isum_b),
// d_b * dx_b, y) then y = fma(m_b, sx_b, y), with isum_b an exact integer; a row's codes depend on that row alone.
// So a row's result does not depend on the other rows, their number, the tiling or the threads (batch-invariant),
// and the scalar path (`reference`, and builds without AVX2) gives the vector path's bits.
//
// Layout (pack_i8_codes, from pack_block_codes' compact codes): panels of 8 outputs, a block's codes as 8 steps of
// 4 k, each step 32 bytes (output j's 4 codes at bytes 4j..4j+3):
//   - 0..15 codes (Q4_1): two steps a 32-byte row, step 2t in the low nibbles, 2t + 1 in the high ones:
//     uint8 [N/8, K/32, 128];
//   - int8 codes (Q8_0): int8 [N/8, K/32, 256];
//   - d and m: [N/8, K/32, 8], fp16 where pack_block_codes found them so (a GGUF's), else fp32.
// vpmaddubsw adds a pair of products in 16 bits with saturation: |q qx| <= 15 * 127 for 0..15 codes, so a block's
// 16 products a lane (3810 * 8 = 30480) fit without it; int8 codes (|q| <= 127: 2 * 127 * 127 = 32258 a pair) go
// through vpmaddwd every step (AVX2: |q| against the sign-moved qx; VNNI: q as it is against qx + 128 as uint8, less
// 128 sum q, every term exact). Codes of -128 are refused at packing (their pair could saturate).
// A bias is added to the fp32 sums, then y is rounded to x's dtype once.
//
//   pack_i8_codes(codes, scales, offsets) -> [codes, scales, offsets] in this layout, or [] for codes it does not
//     take (signed nibbles, octets)
//   i8_block_linear(x [M, K] fp32 or bf16, codes, scales, offsets, n, bias?) -> y [M, n] in x's dtype
//   i8_block_linear_reference(...): the same through the scalar path
//   quantize_rows_i8(x [M, K]) -> [qx int8 [M, K], dx [M, K/32], sx [M, K/32]]: the activations' codes
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/stack.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "share.h"
#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TERCET_I8 1
#include <immintrin.h>
#else
#define TERCET_I8 0
#endif
// AVX512-VNNI (and BW for bytes in zmm): whole panels in pairs through vpdpbusd (tile_pairs), the same integers
#if TERCET_I8 && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define TERCET_VNNI 1
#else
#define TERCET_VNNI 0
#endif

namespace {

constexpr int64_t kLanes = 8;    // outputs per panel
constexpr int64_t kGroup = 32;   // k per block
constexpr int64_t kRowTile = 4;  // rows per register block (many rows; VNNI: pair_columns' tiles)
constexpr int64_t kRowBlock = 64;  // rows whose codes stay in L2 while a thread's panels pass

inline float scale_of(float s) { return s; }
inline float scale_of(c10::Half s) { return static_cast<float>(s); }

// ---- the activations' codes: per row and block, dx = amax / 127, qx = nearest(x * (127 / amax)), sx = dx * sum qx;
// a block holding an inf or a NaN gets dx = sx = NaN (its rows' outputs are NaN, as the fp32 path's), codes 0; a
// block whose amax is under kTiny (2^-100: 127 / amax would overflow near the subnormals) counts as zeros
constexpr float kTiny = 0x1p-100f;

template <typename T>
void quantize_block_scalar(const T* x, int8_t* q, float* dx, float* sx) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < kGroup; ++i) {
    const float v = static_cast<float>(x[i]);
    finite = finite && std::isfinite(v);
    amax = std::max(amax, std::fabs(v));
  }
  if (!finite) {
    std::memset(q, 0, kGroup);
    *dx = *sx = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  if (amax < kTiny) amax = 0.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < kGroup; ++i) {
    const float r = std::nearbyint(static_cast<float>(x[i]) * inv);  // to nearest even, as vcvtps2dq
    const int32_t c = static_cast<int32_t>(std::min(127.f, std::max(-127.f, r)));
    q[i] = static_cast<int8_t>(c);
    sum += c;
  }
  *dx = amax / 127.f;
  *sx = *dx * static_cast<float>(sum);
}

#if TERCET_I8
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

template <typename T>
void quantize_block(const T* x, int8_t* q, float* dx, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.f), zero = _mm256_setzero_ps();
  __m256 v[4], amax = zero, probe = zero;
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    probe = _mm256_add_ps(probe, _mm256_mul_ps(v[i], zero));  // NaN where a lane held an inf or a NaN
  }
  const float m = hmax(amax) < kTiny ? 0.f : hmax(amax);
  if (_mm256_movemask_ps(_mm256_cmp_ps(probe, probe, _CMP_UNORD_Q))) {
    std::memset(q, 0, kGroup);
    *dx = *sx = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i)
    c[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_round_ps(_mm256_mul_ps(v[i], inv),
                                                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  // int32 -> int8 in order: packs work within 128-bit halves, the permute puts the dwords back
  const __m256i w16a = _mm256_packs_epi32(c[0], c[1]), w16b = _mm256_packs_epi32(c[2], c[3]);
  const __m256i b8 = _mm256_packs_epi16(w16a, w16b);
  const __m256i ordered = _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *dx = m / 127.f;
  *sx = *dx * static_cast<float>(_mm_cvtsi128_si32(s4));
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, int8_t* q, float* dx, float* sx, bool scalar) {
  const int64_t blocks = k / kGroup;
  tercet::parallel(m * blocks, m * blocks >= 4096 ? 1024 : m * blocks, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / blocks, b = i % blocks;
      const T* src = x + r * k + b * kGroup;
#if TERCET_I8
      if (!scalar) {
        quantize_block(src, q + i * kGroup, dx + i, sx + i);
        continue;
      }
#endif
      quantize_block_scalar(src, q + i * kGroup, dx + i, sx + i);
    }
  });
}

// ---- the products

struct Rows {  // the activations' codes of M rows: row r's block b at q + (r * blocks + b) * 32
  const int8_t* q;
  const float* dx;
  const float* sx;
  int64_t blocks;
  const uint8_t* u;  // VNNI with int8 weights: the codes + 128 as uint8 (q ^ 0x80), else null
  // VNNI, a bf16 result: whole pairs of panels are stored rounded (plus the bias in fp32) straight from the tiles
  // into `rounded` at their offset from `sums` (row stride n), not summed into `sums` for `finish` to round
  const float* sums = nullptr;
  c10::BFloat16* rounded = nullptr;
  const float* bias = nullptr;
  int64_t n = 0;
};

template <bool Nibbles, typename S>
struct Weights {  // the packed codes: panel p's block b at codes + (p * blocks + b) * bytes
  const uint8_t* codes;
  const S* d;
  const S* m;
  int64_t blocks;
  static constexpr int64_t kBytes = Nibbles ? 128 : 256;
};

// the scalar path: the vector path's sums and roundings, one output at a time
template <bool Nibbles, typename S>
void tile_scalar(const Rows& x, const Weights<Nibbles, S>& w, int64_t r0, int64_t rows, int64_t p, float* y,
                 int64_t ldy, int64_t cols) {
  for (int64_t r = r0; r < r0 + rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* c = w.codes + (p * w.blocks + b) * w.kBytes;
        const int8_t* qx = x.q + (r * x.blocks + b) * kGroup;
        int32_t isum = 0;
        for (int64_t s = 0; s < 8; ++s)
          for (int64_t i = 0; i < 4; ++i) {
            int32_t q;
            if constexpr (Nibbles) {
              const uint8_t byte = c[(s / 2) * 32 + 4 * j + i];
              q = s % 2 ? byte >> 4 : byte & 15;
            } else {
              q = static_cast<int8_t>(c[s * 32 + 4 * j + i]);
            }
            isum += q * qx[4 * s + i];
          }
        const int64_t at = (p * w.blocks + b) * kLanes + j;
        const float bi = x.dx[r * x.blocks + b], si = x.sx[r * x.blocks + b];
        acc = std::fma(static_cast<float>(isum), scale_of(w.d[at]) * bi, acc);
        acc = std::fma(scale_of(w.m[at]), si, acc);
      }
      y[(r - r0) * ldy + j] = acc;
    }
}

#if TERCET_I8
inline __m256 scales8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 scales8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// R rows of C consecutive panels from p on, AVX2 (vpmaddubsw; on VNNI builds only the panels tile_pairs leaves): y[r][j]
// holds row r0 + r's outputs 8 (p + j) .. 8 (p + j) + 7. Every (row, output) goes through the same integer sums and
// the same two FMAs a block whatever R and C: the same bits.
template <int R, int C, bool Nibbles, typename S>
void tile(const Rows& x, const Weights<Nibbles, S>& w, int64_t r0, int64_t p, __m256 (&y)[R][C], bool ahead) {
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(15);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) y[r][j] = _mm256_setzero_ps();
  const int64_t stride = w.blocks * w.kBytes;  // one panel's codes
  const uint8_t* c = w.codes + p * stride;
  // `ahead`: the next C panels asked for as these are read, as tile_pairs does (the AVX2 build's one-row int8 steps
  // 1.06-1.09x on a Zen 4 EPYC, 4 rows 1.00x, alternated in one process), into L2 where a tile reads several panels
  // (one row 1.13x more than into L1) and into L1 where it reads one (4 rows: into L2 0.975-0.987x)
  const char* next_d = reinterpret_cast<const char*>(w.d + (p + C) * w.blocks * kLanes);
  const char* next_m = reinterpret_cast<const char*>(w.m + (p + C) * w.blocks * kLanes);
  const int64_t scale_bytes = C * w.blocks * kLanes * static_cast<int64_t>(sizeof(S));
  for (int64_t b = 0; b < w.blocks; ++b, c += w.kBytes) {
    if (ahead) {
      for (int j = 0; j < C; ++j)
        for (int64_t l = 0; l < w.kBytes; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(c + (C + j) * stride + l), C > 1 ? _MM_HINT_T1 : _MM_HINT_T0);
      if (b * 64 < scale_bytes) _mm_prefetch(next_d + b * 64, _MM_HINT_T0), _mm_prefetch(next_m + b * 64, _MM_HINT_T0);
    }
    __m256i isum[R][C];
    const int8_t* qx[R];
    for (int r = 0; r < R; ++r) qx[r] = x.q + ((r0 + r) * x.blocks + b) * kGroup;
    if constexpr (Nibbles) {
      __m256i acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < C; ++j) acc[r][j] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        __m256i lo[C], hi[C];
        for (int j = 0; j < C; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * stride + 32 * t));
          lo[j] = _mm256_and_si256(raw, mask), hi[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xa = bcast4(qx[r] + 8 * t), xb = bcast4(qx[r] + 8 * t + 4);
          for (int j = 0; j < C; ++j) {
            acc[r][j] = _mm256_add_epi16(acc[r][j], _mm256_maddubs_epi16(lo[j], xa));
            acc[r][j] = _mm256_add_epi16(acc[r][j], _mm256_maddubs_epi16(hi[j], xb));
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < C; ++j) isum[r][j] = _mm256_madd_epi16(acc[r][j], ones);
    } else {
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < C; ++j) isum[r][j] = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        __m256i q[C], aq[C];
        for (int j = 0; j < C; ++j) {
          q[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * stride + 32 * s));
          aq[j] = _mm256_abs_epi8(q[j]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xs = bcast4(qx[r] + 4 * s);
          for (int j = 0; j < C; ++j) {
            const __m256i pairs = _mm256_maddubs_epi16(aq[j], _mm256_sign_epi8(xs, q[j]));
            isum[r][j] = _mm256_add_epi32(isum[r][j], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    for (int j = 0; j < C; ++j) {
      const int64_t at = ((p + j) * w.blocks + b) * kLanes;
      const __m256 d = scales8(w.d + at), m = scales8(w.m + at);
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (r0 + r) * x.blocks + b;
        y[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][j]), _mm256_mul_ps(d, _mm256_set1_ps(x.dx[xb])), y[r][j]);
        y[r][j] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sx[xb]), y[r][j]);
      }
    }
  }
}

#if TERCET_VNNI
// tile() on AVX512-VNNI for R rows of 2P panels from p on, a pair of panels a zmm (panel p + 2i in the low half,
// p + 2i + 1 in the high one): per lane the same integer sums (vpdpbusd: four u8 x s8 products and their sum added to
// a lane in one instruction; two chains, the even and the odd steps) and the same two FMAs a block as tile(), so the
// same bits, in fewer instructions (Zen 4 runs a zmm op as two ymm halves: what it saves is issue slots)
inline __m512i pair_load(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}
inline __m512 pair_scales(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
inline __m512 pair_scales(const c10::Half* a, const c10::Half* b) {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_cvtph_ps(h);
}
inline __m512i bcast4z(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int R, int P, bool Nibbles, typename S>
void tile_pairs(const Rows& x, const Weights<Nibbles, S>& w, int64_t r0, int64_t p, __m512 (&y)[R][P], bool ahead) {
  const __m512i mask = _mm512_set1_epi8(15), one8 = _mm512_set1_epi8(1);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) y[r][j] = _mm512_setzero_ps();
  const int64_t stride = w.blocks * w.kBytes;
  const uint8_t* c = w.codes + p * stride;
  // `ahead`: the next 2P panels asked for as these are read, block by block (their codes into L2, and their scales
  // into L1 a line a block): the hardware's prefetchers alone left the 2P streams waiting on memory (into L1: one-row
  // int8 steps 1.03x, 4 rows 1.10x, 8 rows 1.07x, 16 rows 1.01x on a Zen 4 EPYC, alternated; two or four groups
  // ahead: 0.99x and 0.92x). The codes into L2 rather than L1: one row 1.09-1.11x more, 4 rows 1.02x, 8 rows 1.05x,
  // 32 rows 1.01x (L1's few misses in flight bound the streams; two groups ahead into L2, 0.99x). Only past the last
  // panel may it ask for addresses outside the weights: a prefetch never faults.
  const char* next_d = reinterpret_cast<const char*>(w.d + (p + 2 * P) * w.blocks * kLanes);
  const char* next_m = reinterpret_cast<const char*>(w.m + (p + 2 * P) * w.blocks * kLanes);
  const int64_t scale_bytes = 2 * P * w.blocks * kLanes * static_cast<int64_t>(sizeof(S));
  for (int64_t b = 0; b < w.blocks; ++b, c += w.kBytes) {
    if (ahead) {
      for (int j = 0; j < 2 * P; ++j)
        for (int64_t l = 0; l < w.kBytes; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(c + (2 * P + j) * stride + l), _MM_HINT_T1);
      if (b * 64 < scale_bytes) _mm_prefetch(next_d + b * 64, _MM_HINT_T0), _mm_prefetch(next_m + b * 64, _MM_HINT_T0);
    }
    // a block's integer sums: two chains per lane (even and odd steps) where the tile has few, one where it has
    // enough to hide vpdpbusd's latency (the same integers either way)
    constexpr bool kTwo = R * P < 8;
    __m512i even[R][P], odd[kTwo ? R : 1][kTwo ? P : 1];
    const int8_t* qx[R];
    for (int r = 0; r < R; ++r) {
      qx[r] = x.q + ((r0 + r) * x.blocks + b) * kGroup;
      for (int j = 0; j < P; ++j) {
        even[r][j] = _mm512_setzero_si512();
        if constexpr (kTwo) odd[r][j] = _mm512_setzero_si512();
      }
    }
    if constexpr (Nibbles) {
      for (int t = 0; t < 4; ++t) {
        __m512i lo[P], hi[P];
        for (int j = 0; j < P; ++j) {
          const uint8_t* a = c + 2 * j * stride + 32 * t;
          const __m512i raw = pair_load(a, a + stride);
          lo[j] = _mm512_and_si512(raw, mask), hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i xa = bcast4z(qx[r] + 8 * t), xb = bcast4z(qx[r] + 8 * t + 4);
          for (int j = 0; j < P; ++j) {
            even[r][j] = _mm512_dpbusd_epi32(even[r][j], lo[j], xa);
            if constexpr (kTwo) odd[r][j] = _mm512_dpbusd_epi32(odd[r][j], hi[j], xb);
            else even[r][j] = _mm512_dpbusd_epi32(even[r][j], hi[j], xb);
          }
        }
      }
    } else {
      __m512i wsum[P];
      for (int j = 0; j < P; ++j) wsum[j] = _mm512_setzero_si512();
      // the steps in pairs, the even step's sums in `even` and the odd one's in `odd`: every accumulator named
      // at compile time (a step's parity picked at run time kept them on the stack: Q8_0 at 64 rows ~2x slower)
      for (int s = 0; s < 8; s += 2) {
        __m512i qe[P], qo[P];
        for (int j = 0; j < P; ++j) {
          const uint8_t* a = c + 2 * j * stride + 32 * s;
          qe[j] = pair_load(a, a + stride), qo[j] = pair_load(a + 32, a + stride + 32);
          wsum[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(wsum[j], one8, qe[j]), one8, qo[j]);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* u = reinterpret_cast<const int8_t*>(x.u) + (qx[r] - x.q) + 4 * s;
          const __m512i xe = bcast4z(u), xo = bcast4z(u + 4);
          for (int j = 0; j < P; ++j) {
            even[r][j] = _mm512_dpbusd_epi32(even[r][j], xe, qe[j]);
            if constexpr (kTwo) odd[r][j] = _mm512_dpbusd_epi32(odd[r][j], xo, qo[j]);
            else even[r][j] = _mm512_dpbusd_epi32(even[r][j], xo, qo[j]);
          }
        }
      }
      for (int j = 0; j < P; ++j) {
        const __m512i shift = _mm512_slli_epi32(wsum[j], 7);
        for (int r = 0; r < R; ++r) even[r][j] = _mm512_sub_epi32(even[r][j], shift);
      }
    }
    for (int j = 0; j < P; ++j) {
      const int64_t at = ((p + 2 * j) * w.blocks + b) * kLanes, next = at + w.blocks * kLanes;
      const __m512 d = pair_scales(w.d + at, w.d + next), m = pair_scales(w.m + at, w.m + next);
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (r0 + r) * x.blocks + b;
        __m512i sum = even[r][j];
        if constexpr (kTwo) sum = _mm512_add_epi32(sum, odd[r][j]);
        const __m512 isum = _mm512_cvtepi32_ps(sum);
        y[r][j] = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(x.dx[xb])), y[r][j]);
        y[r][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sx[xb]), y[r][j]);
      }
    }
  }
}

// R rows of 2P panels, every one whole (the caller keeps a last partial panel for tile_store)
template <int R, int P, bool Nibbles, typename S>
void pairs_store(const Rows& x, const Weights<Nibbles, S>& w, int64_t r0, int64_t p, float* y, int64_t ldy,
                 bool ahead = true) {
  __m512 acc[R][P];
  tile_pairs<R, P>(x, w, r0, p, acc, ahead);
  if (x.rounded != nullptr) {  // rounded as finish() would: the bias added in fp32, then to bf16 (vec.h's rounding)
    const int64_t at = y - x.sums, col = at % x.n;
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < P; ++j) {
        const __m512 v = x.bias != nullptr ? _mm512_add_ps(acc[r][j], vec::load(x.bias + col + 2 * j * kLanes)) : acc[r][j];
        vec::store(x.rounded + at + r * ldy + 2 * j * kLanes, v);
      }
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) _mm512_storeu_ps(y + r * ldy + 2 * j * kLanes, acc[r][j]);
}
#endif

// the tile into y (row stride ldy): panel p + j's outputs at y + 8 j, `cols` of the last panel's (the rest whole)
template <int R, int C, bool Nibbles, typename S>
void tile_store(const Rows& x, const Weights<Nibbles, S>& w, int64_t r0, int64_t p, float* y, int64_t ldy,
                int64_t cols, bool ahead = true) {
  __m256 acc[R][C];
  tile<R, C>(x, w, r0, p, acc, ahead);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) {
      float* out = y + r * ldy + j * kLanes;
      if (j + 1 < C || cols == kLanes) {
        _mm256_storeu_ps(out, acc[r][j]);
      } else {
        alignas(32) float tmp[kLanes];
        _mm256_store_ps(tmp, acc[r][j]);
        std::memcpy(out, tmp, cols * sizeof(float));
      }
    }
}

// R rows (at most kRowTile) of panels [p, end): C at a time, then one by one; returns where the pairs through
// pairs_store ended (p where there were none)
template <int R, int C, bool Nibbles, typename S>
int64_t rows_over_panels(const Rows& x, const Weights<Nibbles, S>& w, int64_t r0, int64_t p, int64_t end, float* y,
                         int64_t ldy, int64_t n) {
#if TERCET_VNNI
  if constexpr (C % 2 == 0) {  // whole panels in pairs through zmm; a last partial panel below
    const int64_t whole = std::min(end, n / kLanes);
    for (; p + C <= whole; p += C) pairs_store<R, C / 2>(x, w, r0, p, y + p * kLanes, ldy);
    for (; p + 2 <= whole; p += 2) pairs_store<R, 1>(x, w, r0, p, y + p * kLanes, ldy);
  }
#endif
  const int64_t paired = p;
  for (; p + C <= end; p += C) tile_store<R, C>(x, w, r0, p, y + p * kLanes, ldy, std::min(kLanes, n - (p + C - 1) * kLanes));
  for (; p < end; ++p) tile_store<R, 1>(x, w, r0, p, y + p * kLanes, ldy, std::min(kLanes, n - p * kLanes));
  return paired;
}
#endif

#if TERCET_VNNI
// rows [r, rows) of 2P panels from p: the last tile of fewer than R rows, as one tile of its own size
template <int R, int P, bool Nibbles, typename S>
void pairs_tail(const Rows& x, const Weights<Nibbles, S>& w, int64_t r0, int64_t r, int64_t rows, int64_t p,
                float* out, int64_t n) {
  if constexpr (R > 0) {
    if (rows - r == R) pairs_store<R, P>(x, w, r0 + r, p, out + r * n, n, r == 0);
    else pairs_tail<R - 1, P>(x, w, r0, r, rows, p, out, n);
  }
}

// every row over panels [p, end) 2P at a time, tiles of R rows (the next panels asked for by the first tile of
// rows only: the others find these in L1); returns where it stopped (fewer than 2P whole panels left)
template <int R, int P, bool Nibbles, typename S>
int64_t pair_columns(const Rows& x, const Weights<Nibbles, S>& w, int64_t r0, int64_t rows, int64_t p, int64_t end,
                     float* y, int64_t n) {
  for (; p + 2 * P <= end; p += 2 * P) {
    float* out = y + p * kLanes;
    int64_t r = 0;
    for (; r + R <= rows; r += R) pairs_store<R, P>(x, w, r0 + r, p, out + r * n, n, r == 0);
    pairs_tail<R - 1, P>(x, w, r0, r, rows, p, out, n);
  }
  return p;
}
#endif

// rows r0..r0+rows of panels [begin, end) into y (rows r0.. of the output, row stride n); returns where the
// panels that went through pairs_store end (they start at begin)
template <bool Nibbles, typename S>
int64_t panel_rows(const Rows& x, const Weights<Nibbles, S>& w, int64_t r0, int64_t rows, int64_t begin, int64_t end,
                float* y, int64_t n, bool scalar) {
#if TERCET_I8
  if (!scalar) {
    // few rows: several panels a tile (more independent sums); many: a panel's codes in L1 for every tile of rows
    switch (rows) {
      case 1: return rows_over_panels<1, 4>(x, w, r0, begin, end, y, n, n);
      case 2: return rows_over_panels<2, 2>(x, w, r0, begin, end, y, n, n);
      case 3: return rows_over_panels<3, 2>(x, w, r0, begin, end, y, n, n);
      default: break;
    }
#if TERCET_VNNI
    {  // pairs of whole panels, every tile of rows over a pair (its codes in L1); what is left below
      const int64_t whole = std::min(end, n / kLanes);
      // tiles of 4 rows by 2 pairs, one integer chain an accumulator (8 chains hide vpdpbusd's latency of 4): Q4_1
      // at 8-512 rows 0.91-1.18x the tiles before (4 rows by one pair, two chains; gate_up and down 0.99-1.18x) on
      // a Zen 4, alternated; 8 rows by one pair 0.91-1.00x these, 6 rows by 2 pairs 0.95-1.10x
      begin = pair_columns<4, 2>(x, w, r0, rows, begin, whole, y, n);
      begin = pair_columns<4, 1>(x, w, r0, rows, begin, whole, y, n);
    }
#endif
    const int64_t paired = begin;
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kLanes, n - p * kLanes);
      int64_t r = 0;
      for (; r + kRowTile <= rows; r += kRowTile)
        tile_store<kRowTile, 1>(x, w, r0 + r, p, y + r * n + p * kLanes, n, cols, r == 0);
      switch (rows - r) {
        case 3: tile_store<3, 1>(x, w, r0 + r, p, y + r * n + p * kLanes, n, cols, r == 0); break;
        case 2: tile_store<2, 1>(x, w, r0 + r, p, y + r * n + p * kLanes, n, cols, r == 0); break;
        case 1: tile_store<1, 1>(x, w, r0 + r, p, y + r * n + p * kLanes, n, cols, r == 0); break;
        default: break;
      }
    }
    return paired;
  }
#endif
  for (int64_t p = begin; p < end; ++p)
    tile_scalar(x, w, r0, rows, p, y + p * kLanes, n, std::min(kLanes, n - p * kLanes));
  return begin;
}

// finish(c0, c1) after each range of panels: its columns [c0, c1) of every row are summed
template <bool Nibbles, typename S, typename Finish>
void product(const Rows& x, const Weights<Nibbles, S>& w, int64_t m, int64_t panels, int64_t n, float* y,
             bool scalar, const Finish& finish) {
  // each thread a range of panels (one stream of codes), every row block over it
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(16, panels / (2 * at::get_num_threads())));
  tercet::parallel(panels, grain, [&](int64_t begin, int64_t end) {
    int64_t paired = begin;  // (every row block pairs the same panels)
    for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, m - r0);
      paired = panel_rows(x, w, r0, rows, begin, end, y + r0 * n, n, scalar);
    }
    // with Rows::rounded, the panels that went through pairs_store are rounded already
    finish((x.rounded != nullptr ? paired : begin) * kLanes, std::min(end * kLanes, n));
  });
}

// The activations' codes and the fp32 sums of a bf16 product, reused call after call (a decode step
// makes ~120 products of a few microseconds each: allocating them was a fifth of that)
struct Scratch {
  std::vector<int8_t> q;
  std::vector<uint8_t> u;
  std::vector<float> dx, sx, y;
};

constexpr int64_t kScratchSums = int64_t{1} << 20;  // the most sums the scratch keeps (4 MB)

Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

template <typename V>
auto* at_least(V& v, int64_t size) {
  if (static_cast<int64_t>(v.size()) < size) v.resize(static_cast<size_t>(size));
  return v.data();
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                  int64_t n, const std::optional<at::Tensor>& bias, bool scalar) {
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == kLanes && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                  offsets.sizes() == scales.sizes() && offsets.scalar_type() == scales.scalar_type() &&
                  offsets.is_contiguous(), "scales and offsets must come from pack_i8_codes");
  const int64_t panels = scales.size(0), blocks = scales.size(1), k = blocks * kGroup;
  const bool nibbles = codes.scalar_type() == at::kByte;
  TORCH_CHECK(codes.dim() == 3 && codes.size(0) == panels && codes.size(1) == blocks && codes.is_contiguous() &&
                  ((nibbles && codes.size(2) == 128) || (codes.scalar_type() == at::kChar && codes.size(2) == 256)),
              "codes must come from pack_i8_codes");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.device().is_cpu(), "x must be a CPU fp32 or bf16 [M, ", k, "]");
  TORCH_CHECK(n > 0 && n <= panels * kLanes, "n does not match the packed weight");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n), "bias must be [n]");
  const auto src = x.contiguous();
  const int64_t m = x.size(0);
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  Scratch& s = scratch();
  int8_t* q = at_least(s.q, m * k);
  float* dx = at_least(s.dx, m * blocks);
  float* sx = at_least(s.sx, m * blocks);
  if (x.scalar_type() == at::kFloat) quantize_rows(src.data_ptr<float>(), m, k, q, dx, sx, scalar);
  else quantize_rows(src.data_ptr<c10::BFloat16>(), m, k, q, dx, sx, scalar);
  const uint8_t* u = nullptr;  // (VNNI, int8 weights: Rows::u)
  if (TERCET_VNNI && !nibbles && !scalar) {
    uint8_t* to = at_least(s.u, m * k);
    for (int64_t i = 0; i < m * k; ++i) to[i] = static_cast<uint8_t>(q[i]) ^ 0x80;
    u = to;
  }
  // the sums: straight into an fp32 result, else into the scratch and rounded to bf16 range by range (to
  // nearest even, as torch's conversion), each plus the bias in fp32 first
  const bool direct = x.scalar_type() == at::kFloat;
  at::Tensor sums;  // (a large product's own, not kept)
  if (!direct && m * n > kScratchSums) sums = at::empty({m, n}, x.options().dtype(at::kFloat));
  float* y = direct ? out.data_ptr<float>() : sums.defined() ? sums.data_ptr<float>() : at_least(s.y, m * n);
  at::Tensor bias32;
  const float* b = nullptr;
  if (bias) bias32 = bias->to(at::kFloat).contiguous(), b = bias32.data_ptr<float>();
  auto* rounded = direct ? nullptr : out.data_ptr<c10::BFloat16>();
  Rows rows{q, dx, sx, blocks, u};
  // (VNNI: whole pairs of panels rounded in the tiles, not summed here and rounded after: 1.02-1.05x at 8 rows,
  // 1.01-1.18x at 64, 1.06-1.36x at 512 on a Zen 4, alternated; one row even)
  if (TERCET_VNNI && !direct && !scalar) rows.sums = y, rows.rounded = rounded, rows.bias = b, rows.n = n;
  const auto finish = [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < m; ++r) {
      float* from = y + r * n;
      if (direct) {
        if (b != nullptr)
          for (int64_t c = c0; c < c1; ++c) from[c] += b[c];
        continue;
      }
      c10::BFloat16* to = rounded + r * n;
      int64_t c = c0;
#if TERCET_VEC
      for (; c + vec::kLanes <= c1; c += vec::kLanes)
        vec::store(to + c, b != nullptr ? vec::add(vec::load(from + c), vec::load(b + c)) : vec::load(from + c));
#endif
      for (; c < c1; ++c) to[c] = c10::BFloat16(b != nullptr ? from[c] + b[c] : from[c]);
    }
  };
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  const int64_t used = (n + kLanes - 1) / kLanes;  // (pack_block_codes pads to 16 outputs)
  if (scales.scalar_type() == at::kHalf) {
    const auto* d = scales.data_ptr<c10::Half>();
    const auto* o = offsets.data_ptr<c10::Half>();
    if (nibbles) product(rows, Weights<true, c10::Half>{c, d, o, blocks}, m, used, n, y, scalar, finish);
    else product(rows, Weights<false, c10::Half>{c, d, o, blocks}, m, used, n, y, scalar, finish);
  } else {
    const auto* d = scales.data_ptr<float>();
    const auto* o = offsets.data_ptr<float>();
    if (nibbles) product(rows, Weights<true, float>{c, d, o, blocks}, m, used, n, y, scalar, finish);
    else product(rows, Weights<false, float>{c, d, o, blocks}, m, used, n, y, scalar, finish);
  }
  return out;
}

at::Tensor i8_block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           const at::Tensor& offsets, int64_t n, const std::optional<at::Tensor>& bias) {
  return linear(x, codes, scales, offsets, n, bias, false);
}

at::Tensor i8_block_linear_reference(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                                     const at::Tensor& offsets, int64_t n, const std::optional<at::Tensor>& bias) {
  return linear(x, codes, scales, offsets, n, bias, true);
}

std::vector<at::Tensor> quantize_rows_i8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a CPU fp32 [M, K] with K a multiple of 32");
  const auto src = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  auto q = at::empty({m, k}, x.options().dtype(at::kChar));
  auto dx = at::empty({m, k / kGroup}, x.options()), sx = at::empty_like(dx);
  quantize_rows(src.data_ptr<float>(), m, k, q.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>(), false);
  return {q, dx, sx};
}

// pack_block_codes' compact codes ([P16, K/2, 16] uint8 nibbles 0..15, or [P16, K, 16] int8; d, m [P16, K/32, 16])
// -> this file's layout; [] where they are neither (signed nibbles, octets) or an int8 code is -128
std::vector<at::Tensor> pack_i8_codes(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets) {
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == 16 && offsets.sizes() == scales.sizes() &&
                  codes.dim() == 3 && codes.size(0) == scales.size(0) && codes.size(2) == 16,
              "codes, scales and offsets must come from pack_block_codes");
  const int64_t p16 = scales.size(0), blocks = scales.size(1), k = blocks * kGroup;
  const bool nibbles = codes.scalar_type() == at::kByte && codes.size(1) * 2 == k;
  const bool bytes = codes.scalar_type() == at::kChar && codes.size(1) == k;
  if (!nibbles && !bytes) return {};
  const auto src = codes.contiguous();
  if (bytes) {
    const int8_t* c = src.data_ptr<int8_t>();
    if (std::any_of(c, c + src.numel(), [](int8_t v) { return v == -128; })) return {};
  }
  // every code as one int [P16 * 16 outputs, K] (nibbles: k = 2i low, 2i + 1 high)
  at::Tensor wide;
  if (nibbles) {
    const auto c = src.to(at::kInt);
    wide = at::stack({c.bitwise_and(15), c.bitwise_right_shift(4)}, 2).flatten(1, 2);  // [P16, K, 16]
  } else {
    wide = src.to(at::kInt);
  }
  wide = wide.transpose(1, 2).reshape({p16 * 16, k});  // [outputs, K]
  const int64_t panels = p16 * 2;
  // [panels, 8 outputs, blocks, 8 steps, 4] -> [panels, blocks, steps, outputs, 4]
  auto steps = wide.view({panels, kLanes, blocks, 8, 4}).permute({0, 2, 3, 1, 4}).contiguous();
  at::Tensor packed;
  if (nibbles) {  // steps 2t (low nibble) and 2t + 1 (high) in one 32-byte row
    auto pairs = steps.view({panels, blocks, 4, 2, 32});
    packed = pairs.select(3, 0).bitwise_or(pairs.select(3, 1).bitwise_left_shift(4)).to(at::kByte).reshape({panels, blocks, 128});
  } else {
    packed = steps.to(at::kChar).reshape({panels, blocks, 256});
  }
  auto per8 = [&](const at::Tensor& t) {  // [P16, blocks, 16] -> [panels, blocks, 8]
    return t.view({p16, blocks, 2, kLanes}).transpose(1, 2).reshape({panels, blocks, kLanes}).contiguous();
  };
  return {packed.contiguous(), per8(scales), per8(offsets)};
}

bool i8_vector_build() { return TERCET_I8; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tercet, m) {
  m.def("pack_i8_codes(Tensor codes, Tensor scales, Tensor offsets) -> Tensor[]");
  m.def("i8_block_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int n, Tensor? bias) -> Tensor");
  m.def("i8_block_linear_reference(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int n, Tensor? bias) -> Tensor");
  m.def("quantize_rows_i8(Tensor x) -> Tensor[]");
  m.def("i8_vector_build() -> bool", &i8_vector_build);
  m.impl("pack_i8_codes", c10::DispatchKey::CPU, TORCH_FN(pack_i8_codes));
  m.impl("i8_block_linear", c10::DispatchKey::CPU, TORCH_FN(i8_block_linear));
  m.impl("i8_block_linear_reference", c10::DispatchKey::CPU, TORCH_FN(i8_block_linear_reference));
  m.impl("quantize_rows_i8", c10::DispatchKey::CPU, TORCH_FN(quantize_rows_i8));
}

// The vector layer of tercet's CPU kernels: one set of names over the widest float vector
// the compiler targets (-march=native), so each kernel is written once.
//
//   AVX-512F          kLanes = 16  (__m512; the instructions the kernels used before this layer)
//   AVX2 + FMA + F16C kLanes = 8   (__m256)
//   anything else     TERCET_VEC 0: the kernels' portable scalar paths serve
//
// Loads and stores convert the model dtype (float, bf16, fp16) to and from fp32 lanes (loads also
// int8 codes, exactly); stores round to nearest even, as torch's conversions do. vexp is exp on
// every lane (~2 ulp over x <= 0, the softmax's range; overflow gives +inf, as std::exp).
// load_nibbles: bytes of two 4-bit codes each (GGUF's Q4 blocks) as two vectors of floats, exactly.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define TERCET_VEC 1
#include <immintrin.h>
#else
#define TERCET_VEC 0
#endif

#if TERCET_VEC
namespace vec {

#if defined(__AVX512F__)

constexpr int kLanes = 16;
using vf = __m512;
using vi = __m512i;
using vm = __mmask16;

inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf zero() { return _mm512_setzero_ps(); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vf load(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vf load(const int8_t* p) {  // 16 int8 codes as floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store(float* p, vf x) { _mm512_storeu_ps(p, x); }
// 16 bytes of two codes each as floats, exactly: lo the low nibbles (k), hi the high ones (k + 1);
// uint8: codes 0..15, int8: -8..7 (two's complement nibbles)
inline void load_nibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline void load_nibbles(const int8_t* p, vf& lo, vf& hi) {
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(b, 28), 28));
  hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(b, 4));
}

inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
// The lanes added as halves pairwise: (i + 8), then (i + 4), (i + 2), (0 + 1) -- GCC's
// _mm512_reduce_add_ps, written out so that reduce_lanes below can keep its order
inline float reduce_add(vf x) {
  const __m256 s8 = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)),
                                  _mm512_castps512_ps256(x));
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  s = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(vf x) { return _mm512_reduce_max_ps(x); }
// out[j] = reduce_add(x[j]) for the 16 vectors x, bit for bit (each lane's sum is the same
// additions in the same tree, four levels done for all vectors at once): 15 adds and 31
// shuffles for 16 sums, not 16 horizontal reductions
inline vf reduce_lanes(const vf (&x)[16]) {
  vf w[8], u[4], z[2];
  for (int j = 0; j < 8; ++j)  // [a | b] quarters: (a0 a1 b0 b1) + (a2 a3 b2 b3): lane i + 8 of each
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * j], x[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // quarter q of u[j]: vector 4j + q's four lanes, i + 4 added
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)  // quarter q of z[j]: vectors 8j + q, 8j + 4 + q, two lanes each (i + 2)
    z[j] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * j], u[2 * j + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * j], u[2 * j + 1], 0xEE));
  // lane 4q + m: vector q + 4m (0 + 1); then put in vector order
  const vf t = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

inline vm greater(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline vm unordered(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }  // NaN lanes
inline vm either(vm a, vm b) { return static_cast<vm>(a | b); }
inline bool any(vm m) { return m != 0; }
inline vf select(vm m, vf if_false, vf if_true) { return _mm512_mask_mov_ps(if_false, m, if_true); }
inline vi lane_index() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline vi add_int(vi a, int b) { return _mm512_add_epi32(a, _mm512_set1_epi32(b)); }
inline vi select(vm m, vi if_false, vi if_true) { return _mm512_mask_mov_epi32(if_false, m, if_true); }
inline void store(int32_t* p, vi x) { _mm512_storeu_si512(p, x); }

// x rounded to bf16's precision, still as floats: to nearest even, a NaN made bf16's quiet NaN
inline vf round_bf16(vf x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __m512i rounded = _mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000)));
}
inline vf round_half(vf x) { return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); }
inline void store(c10::BFloat16* p, vf x) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(x)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}
inline void store(c10::Half* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
inline vf round_nearest(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral

#else  // AVX2 + FMA + F16C

constexpr int kLanes = 8;
using vf = __m256;
using vi = __m256i;
using vm = __m256;  // all-ones lanes where true

inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf zero() { return _mm256_setzero_ps(); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vf load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf load(const int8_t* p) {  // 8 int8 codes as floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void store(float* p, vf x) { _mm256_storeu_ps(p, x); }
// 8 bytes of two codes each as floats, exactly (as the AVX-512 load_nibbles)
inline void load_nibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
inline void load_nibbles(const int8_t* p, vf& lo, vf& hi) {
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28));
  hi = _mm256_cvtepi32_ps(_mm256_srai_epi32(b, 4));
}

inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline float reduce_add(vf x) {  // halves added pairwise: (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then 0+1
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// out[j] = reduce_add(x[j]) for the 8 vectors x, bit for bit (the same tree for all at once)
inline vf reduce_lanes(const vf (&x)[8]) {
  vf w[4], z[2];
  for (int j = 0; j < 4; ++j)  // [a | b] halves: lane i + 4 of each
    w[j] = _mm256_add_ps(_mm256_permute2f128_ps(x[2 * j], x[2 * j + 1], 0x20),
                         _mm256_permute2f128_ps(x[2 * j], x[2 * j + 1], 0x31));
  for (int j = 0; j < 2; ++j)  // half h of z[j]: vectors 4j + h, 4j + 2 + h, two lanes each (i + 2)
    z[j] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * j], w[2 * j + 1], 0x44),
                         _mm256_shuffle_ps(w[2 * j], w[2 * j + 1], 0xEE));
  // lane 4h + m: vector 2m + h (0 + 1); then put in vector order
  const vf t = _mm256_add_ps(_mm256_shuffle_ps(z[0], z[1], 0x88), _mm256_shuffle_ps(z[0], z[1], 0xDD));
  return _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline float reduce_max(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline vm greater(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline vm unordered(vf a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }  // NaN lanes
inline vm either(vm a, vm b) { return _mm256_or_ps(a, b); }
inline bool any(vm m) { return _mm256_movemask_ps(m) != 0; }
inline vf select(vm m, vf if_false, vf if_true) { return _mm256_blendv_ps(if_false, if_true, m); }
inline vi lane_index() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline vi add_int(vi a, int b) { return _mm256_add_epi32(a, _mm256_set1_epi32(b)); }
inline vi select(vm m, vi if_false, vi if_true) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_false), _mm256_castsi256_ps(if_true), m));
}
inline void store(int32_t* p, vi x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }

inline vf round_bf16(vf x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i rounded = _mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}
inline vf round_half(vf x) { return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); }
inline void store(c10::BFloat16* p, vf x) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(x)), 16);  // each lane < 2^16
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store(c10::Half* p, vf x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
inline vf round_nearest(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n in [-126, 128], as AVX-512's scalef: 2^n as two exact powers of two
// (each half within float's exponent range), so only the final product rounds or overflows
inline vf scale_pow2(vf p, vf n) {
  const vf lo = _mm256_round_ps(_mm256_mul_ps(n, set1(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const vf hi = _mm256_sub_ps(n, lo);
  const auto pow2 = [](vf e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(lo)), pow2(hi));
}

#endif

// exp: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2. Below -87.3 the result is e^-87.3 (the softmax's
// underflow, never a denormal); from 88.8 up +inf.
inline vf exp(vf x) {
  x = max(x, set1(-87.3f));
#if !defined(__AVX512F__)
  x = _mm256_min_ps(x, set1(89.f));  // keeps n <= 128, where scale_pow2 is exact (e^89 is +inf in float)
#endif
  const vf n = round_nearest(mul(x, set1(1.44269504089f)));
  vf r = fnmadd(n, set1(0.693145751953125f), x);
  r = fnmadd(n, set1(1.428606765330187e-06f), r);
  vf p = set1(1.0f / 5040);
  p = fmadd(p, r, set1(1.0f / 720));
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return scale_pow2(p, n);
}

// through the model dtype T and back, in registers: what an eager op's T-typed result holds
template <typename T>
inline vf round_to(vf x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_bf16(x);
  } else {
    return round_half(x);
  }
}

}  // namespace vec
#endif

// 1-row products from Q4_1 nibble codes: vdpbf16ps direct vs decode-to-L1 + AMX tiles (M = 1)
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
static double now(){timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
double freq(){ long x=3; long n=100000000; double a=now(); for(long i=0;i<n;i++) __asm__ volatile("imul %0,%0\n\timul %0,%0":"+r"(x)); return 6.0*n/(now()-a); }

constexpr int K = 576, PAIRS = K / 2, GROUPS = K / 32;
constexpr int N = 3072, PANELS = N / 16;
uint8_t* codes;   // [PANELS][PAIRS][16] nibbles (a pair row of a panel: 16 bytes)
_Float16* scales; _Float16* offsets;  // [PANELS][GROUPS][16]
uint32_t xw[PAIRS];
uint16_t* y;

static inline void pair_scales(const _Float16* s, __m512& lo, __m512& hi) {
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
  lo = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), v);
  hi = _mm512_permutexvar_ps(_mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15), v);
}
static inline void store_pair_scales(const _Float16* d, const _Float16* m, float* dm) {
  __m512 lo, hi; pair_scales(d, lo, hi); _mm512_store_ps(dm, lo), _mm512_store_ps(dm + 16, hi);
  pair_scales(m, lo, hi); _mm512_store_ps(dm + 32, lo), _mm512_store_ps(dm + 48, hi);
}
static const __m512 kTable = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
static inline __m512bh pair_weights(const uint8_t* q, int64_t i, const float* dm) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + i * 16)));
  __m512 lo = _mm512_permutexvar_ps(b, kTable), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), kTable);
  lo = _mm512_fmadd_ps(lo, _mm512_load_ps(dm), _mm512_load_ps(dm + 32));
  hi = _mm512_fmadd_ps(hi, _mm512_load_ps(dm + 16), _mm512_load_ps(dm + 48));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// A: vdpbf16ps, 6 panels, even/odd chains (as direct_tn<1, 6>)
template <int P>
void direct(int p0) {
  __m512 c[P];
  for (int p = 0; p < P; ++p) c[p] = _mm512_setzero_ps();
  for (int g = 0; g < GROUPS; ++g) {
    alignas(64) float dm[P][64];
    for (int p = 0; p < P; ++p) store_pair_scales(scales + ((p0 + p) * GROUPS + g) * 16, offsets + ((p0 + p) * GROUPS + g) * 16, dm[p]);
    __m512 e[P], o[P];
    for (int p = 0; p < P; ++p) e[p] = o[p] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int i = g * 16; i < g * 16 + 16; i += 2) {
      __m512bh we[P], wo[P];
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const uint8_t* q = codes + (size_t)(p0 + p) * PAIRS * 16;
        we[p] = pair_weights(q, i, dm[p]); wo[p] = pair_weights(q, i + 1, dm[p]);
      }
      const uint32_t a = xw[i], b = xw[i + 1];
      const __m512bh xe = (__m512bh)_mm512_set1_epi32((b & 0xffff) | (a << 16)), xo = (__m512bh)_mm512_set1_epi32((b >> 16) | (a & 0xffff0000u));
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) { e[p] = _mm512_dpbf16_ps(e[p], xe, we[p]); o[p] = _mm512_dpbf16_ps(o[p], xo, wo[p]); }
    }
    for (int p = 0; p < P; ++p) c[p] = _mm512_add_ps(c[p], _mm512_add_ps(e[p], o[p]));
  }
  for (int p = 0; p < P; ++p) _mm256_storeu_si256((__m256i*)(y + (p0 + p) * 16), (__m256i)_mm512_cvtneps_pbh(c[p]));
}

struct alignas(64) TileConfig { uint8_t palette = 1, start_row = 0; uint8_t reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
void configure(int m) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = m, cfg.colsb[t] = 64;   // y
  cfg.rows[4] = m, cfg.colsb[4] = 64;  // x: m rows x 16 pairs
  for (int t = 6; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // panels: 16 pairs x 32 bf16
  __asm__ volatile("ldtilecfg %0" :: "m"(cfg));
}
// B: per unit of 2 panels, per 32-k block: decode 2 panels' 16 pair rows into L1 (2 KB), then 2 tdpbf16ps
alignas(64) uint16_t bufs[2][2][16 * 32];
alignas(64) float sums[16][32];
void amx_unit(int u) {
  const int pa = 2 * u, pb = 2 * u + 1;
  _tile_zero(0); _tile_zero(1);
  for (int g = 0; g < GROUPS; ++g) {
    uint16_t (*buf)[16 * 32] = bufs[g & 1];
    alignas(64) float dm[2][64];
    store_pair_scales(scales + (pa * GROUPS + g) * 16, offsets + (pa * GROUPS + g) * 16, dm[0]);
    store_pair_scales(scales + (pb * GROUPS + g) * 16, offsets + (pb * GROUPS + g) * 16, dm[1]);
    const uint8_t* qa = codes + (size_t)pa * PAIRS * 16; const uint8_t* qb = codes + (size_t)pb * PAIRS * 16;
#pragma GCC unroll 4
    for (int i = 0; i < 16; ++i) {
      _mm512_store_si512(buf[0] + i * 32, (__m512i)pair_weights(qa, g * 16 + i, dm[0]));
      _mm512_store_si512(buf[1] + i * 32, (__m512i)pair_weights(qb, g * 16 + i, dm[1]));
    }
    _tile_loadd(4, xw + g * 16, 4 * PAIRS);
    _tile_loadd(6, buf[0], 64);
    _tile_loadd(7, buf[1], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, sums[0], 128);
  _tile_stored(1, sums[0] + 16, 128);
  _mm512_storeu_si512(y + u * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(sums[0] + 16), _mm512_load_ps(sums[0])));
}
// C: decode only (no products): the decode's own cost
void decode_unit(int u) {
  const int pa = 2 * u, pb = 2 * u + 1;
  for (int g = 0; g < GROUPS; ++g) {
    uint16_t (*buf)[16 * 32] = bufs[g & 1];
    alignas(64) float dm[2][64];
    store_pair_scales(scales + (pa * GROUPS + g) * 16, offsets + (pa * GROUPS + g) * 16, dm[0]);
    store_pair_scales(scales + (pb * GROUPS + g) * 16, offsets + (pb * GROUPS + g) * 16, dm[1]);
    const uint8_t* qa = codes + (size_t)pa * PAIRS * 16; const uint8_t* qb = codes + (size_t)pb * PAIRS * 16;
#pragma GCC unroll 4
    for (int i = 0; i < 16; ++i) {
      _mm512_store_si512(buf[0] + i * 32, (__m512i)pair_weights(qa, g * 16 + i, dm[0]));
      _mm512_store_si512(buf[1] + i * 32, (__m512i)pair_weights(qb, g * 16 + i, dm[1]));
    }
  }
}

int main(int argc, char** argv) {
  const bool cold = argc > 1 && argv[1][0] == 'c';
  const size_t copies = cold ? 64 : 1;  // cold: cycle through 64 copies of the weight (70 MB)
  const size_t cb = (size_t)PANELS * PAIRS * 16, sb = (size_t)PANELS * GROUPS * 16;
  uint8_t* call = (uint8_t*)aligned_alloc(64, cb * copies);
  _Float16* sall = (_Float16*)aligned_alloc(64, sb * 2 * copies); _Float16* oall = (_Float16*)aligned_alloc(64, sb * 2 * copies);
  for (size_t i = 0; i < cb * copies; ++i) call[i] = rand();
  for (size_t i = 0; i < sb * copies; ++i) sall[i] = (_Float16)(0.01f * (rand() % 100)), oall[i] = (_Float16)(-0.001f * (rand() % 100));
  for (int i = 0; i < PAIRS; ++i) xw[i] = 0x3f803f80u;
  y = (uint16_t*)aligned_alloc(64, N * 2 * 2);
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) { printf("no amx\n"); return 1; }
  const double f = freq();
  const double groups32 = (double)N * K / 32;
  for (int rep = 0; rep < 3; ++rep) {
    double t[3];
    for (int v = 0; v < 3; ++v) {
      const int iters = 200;
      double a = now();
      for (int it = 0; it < iters; ++it) {
        const size_t c = it % copies;
        codes = call + c * cb; scales = sall + c * sb; offsets = oall + c * sb;
        if (v == 0) { for (int p = 0; p < PANELS; p += 6) direct<6>(p); }
        else if (v == 1) { configure(1); for (int u = 0; u < PANELS / 2; ++u) amx_unit(u); _tile_release(); }
        else { for (int u = 0; u < PANELS / 2; ++u) decode_unit(u); }
      }
      t[v] = (now() - a) / iters;
    }
    printf("%s: direct %.2f  amx(M=1) %.2f  decode only %.2f cycles per 32 weights (%.2f GHz)\n", cold ? "cold" : "hot", t[0] * f / groups32, t[1] * f / groups32, t[2] * f / groups32, f / 1e9);
  }
}

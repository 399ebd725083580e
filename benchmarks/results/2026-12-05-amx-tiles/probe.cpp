// One TDPBF16PS of one pair (A 16x4 bytes, B 1x64 bytes) onto a C tile of given values: which rounding model?
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
struct alignas(64) Cfg { uint8_t palette = 1, start = 0; uint8_t pad[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static float f(uint16_t h) { uint32_t u = uint32_t(h) << 16; float v; std::memcpy(&v, &u, 4); return v; }
static uint16_t bf(float v) { uint32_t u; std::memcpy(&u, &v, 4); return u >> 16; }
static float ftz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.f, v) : v; }
static uint32_t bits(float v) { uint32_t u; std::memcpy(&u, &v, 4); return u; }
int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  int pairs = argc > 1 ? atoi(argv[1]) : 1;  // pairs per instruction
  Cfg cfg; cfg.rows[0] = 16; cfg.colsb[0] = 64; cfg.rows[1] = 16; cfg.colsb[1] = 4 * pairs; cfg.rows[2] = pairs; cfg.colsb[2] = 64;
  _tile_loadconfig(&cfg);
  std::mt19937_64 g(7); std::normal_distribution<float> nd;
  long n = 0, m[8] = {};
  for (int t = 0; t < 20000; ++t) {
    alignas(64) float c[256], y[256]; alignas(64) uint16_t a[16 * 32], b[16 * 32];
    for (int i = 0; i < 256; ++i) c[i] = nd(g) * std::ldexp(1.f, int(g() % 8) - 4);
    for (int i = 0; i < 16 * 2 * pairs; ++i) a[i] = bf(nd(g));
    for (int i = 0; i < 16 * 2 * pairs; ++i) b[i] = bf(nd(g));
    _tile_loadd(0, c, 64); _tile_loadd(1, a, 4 * pairs); _tile_loadd(2, b, 64); _tile_dpbf16ps(0, 1, 2); _tile_stored(0, y, 64);
    for (int r = 0; r < 16; ++r) for (int j = 0; j < 16; ++j) {
      float cc = c[r * 16 + j];
      float te = 0.f, to = 0.f; float m1 = cc, m2 = cc;  __float128 ex = cc; float m4 = cc; float m5 = cc; __float128 sum_all = 0;
      for (int i = 0; i < pairs; ++i) {
        float p0 = f(a[(r * pairs + i) * 2]) * f(b[(i * 16 + j) * 2]);
        float p1 = f(a[(r * pairs + i) * 2 + 1]) * f(b[(i * 16 + j) * 2 + 1]);
        te = ftz(te + p0); to = ftz(to + p1);
        m1 = m1 + p0; m1 = m1 + p1;            // even first, two roundings
        m2 = m2 + p1; m2 = m2 + p0;            // odd first (vdpbf16ps)
        ex += (__float128)p0 + (__float128)p1; // everything exact
        m4 = m4 + (p0 + p1);                   // pair sum rounded, then added
        m5 = (float)((__float128)m5 + (__float128)p0 + (__float128)p1);  // per pair, c+p0+p1 rounded once
        sum_all += (__float128)p0 + (__float128)p1;
      }
      float m7 = ftz(cc + ftz(te + to));
      float m3 = (float)ex;
      float m6 = cc + (float)sum_all;  // products summed exactly, rounded, then added to c
      float v = y[r * 16 + j]; ++n;
      m[1] += bits(m1) == bits(v); m[2] += bits(m2) == bits(v); m[3] += bits(m3) == bits(v); m[4] += bits(m4) == bits(v); m[5] += bits(m5) == bits(v); m[6] += bits(m6) == bits(v); m[7] += bits(m7) == bits(v);
    }
  }
  _tile_release();
  printf("pairs/instr %d, outputs %ld; matches: even-first-2-roundings %ld, odd-first-2-roundings %ld, exact-sum-1-rounding %ld, c+round(p0+p1) %ld, per-pair-fused(c+p0+p1) %ld, c+round(sum all) %ld, SDM (even and odd chains, then c + (even + odd)) %ld\n", pairs, n, m[1], m[2], m[3], m[4], m[5], m[6], m[7]);
}

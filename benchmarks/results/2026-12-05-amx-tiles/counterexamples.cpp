// Two hand-made counterexamples, K = 4 (two pairs), one output: vdpbf16ps vs TDPBF16PS (both pairs in one
// instruction, and one pair per instruction)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
struct alignas(64) Cfg { uint8_t palette = 1, start = 0; uint8_t pad[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static uint32_t bits(float v) { uint32_t u; std::memcpy(&u, &v, 4); return u; }
static float vdp(const uint16_t* x, const uint16_t* w) {
  __m512 c = _mm512_setzero_ps();
  for (int i = 0; i < 2; ++i) {
    uint32_t a = x[2 * i] | uint32_t(x[2 * i + 1]) << 16, b = w[2 * i] | uint32_t(w[2 * i + 1]) << 16;
    c = _mm512_dpbf16_ps(c, (__m512bh)_mm512_set1_epi32(int(a)), (__m512bh)_mm512_set1_epi32(int(b)));
  }
  return _mm512_cvtss_f32(c);
}
static float tdp(const uint16_t* x, const uint16_t* w, int step) {
  Cfg cfg; cfg.rows[0] = 1, cfg.colsb[0] = 4; cfg.rows[1] = 1, cfg.colsb[1] = 4 * step; cfg.rows[2] = step, cfg.colsb[2] = 4;
  _tile_loadconfig(&cfg);
  float c = 0.f; _tile_loadd(0, &c, 4);
  for (int i = 0; i < 2; i += step) { _tile_loadd(1, x + 2 * i, 4 * step); _tile_loadd(2, w + 2 * i, 4); _tile_dpbf16ps(0, 1, 2); }
  _tile_stored(0, &c, 4); _tile_release();
  return c;
}
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  struct { const char* what; uint16_t x[4], w[4]; } cases[] = {
    {"tie: x = w = [1, 0, 2^-12, 2^-12] (pair 1's products 2^-24 + 2^-24 onto 1.0)", {0x3f80, 0, 0x3980, 0x3980}, {0x3f80, 0, 0x3980, 0x3980}},
    {"denormal product: x = w = [2^-60, 0, 2^-70, 0] (2^-120 + 2^-140)", {0x2180, 0, 0x1c80, 0}, {0x2180, 0, 0x1c80, 0}},
  };
  for (auto& c : cases) {
    float v = vdp(c.x, c.w), t2 = tdp(c.x, c.w, 2), t1 = tdp(c.x, c.w, 1);
    printf("%s\n  vdpbf16ps chain   %08x (%a)\n  TDPBF16PS 2 pairs %08x (%a)\n  TDPBF16PS 1+1     %08x (%a)\n", c.what, bits(v), v, bits(t2), t2, bits(t1), t1);
  }
}

// Is a row's TDPBF16PS result a function of that row alone (tile of 16 rows vs the row alone in a 1-row tile,
// other rows' data changed)? 16 pairs per instruction, K = 1024.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
struct alignas(64) Cfg { uint8_t palette = 1, start = 0; uint8_t pad[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static uint16_t bf(float v) { uint32_t u; std::memcpy(&u, &v, 4); return u >> 16; }
static void run(const uint16_t* a, int rows, const uint16_t* b, int K, float* c) {
  Cfg cfg; cfg.rows[0] = rows, cfg.colsb[0] = 64; cfg.rows[1] = rows, cfg.colsb[1] = 64; cfg.rows[2] = 16, cfg.colsb[2] = 64;
  _tile_loadconfig(&cfg);
  std::memset(c, 0, rows * 64); _tile_loadd(0, c, 64);
  for (int i0 = 0; i0 < K / 2; i0 += 16) { _tile_loadd(1, a + 2 * i0, K * 2); _tile_loadd(2, b + i0 * 32, 64); _tile_dpbf16ps(0, 1, 2); }
  _tile_stored(0, c, 64); _tile_release();
}
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  const int K = 1024; std::mt19937_64 g(3); std::normal_distribution<float> nd;
  long diff = 0, n = 0;
  for (int t = 0; t < 200; ++t) {
    std::vector<uint16_t> a(16 * K), a2(16 * K), b(K / 2 * 32);
    for (auto& v : a) v = bf(nd(g) * (g() % 4 == 0 ? 1e3f : 1.f));
    for (auto& v : a2) v = bf(nd(g));
    for (auto& v : b) v = bf(nd(g));
    float c[256], c1[16], c2[256];
    run(a.data(), 16, b.data(), K, c);
    for (int r = 0; r < 16; ++r) {
      run(a.data() + r * K, 1, b.data(), K, c1);
      std::memcpy(a2.data() + r * K, a.data() + r * K, K * 2);  // row r into other data
      run(a2.data(), 16, b.data(), K, c2);
      for (int j = 0; j < 16; ++j) diff += std::memcmp(&c[r * 16 + j], &c1[j], 4) != 0, diff += std::memcmp(&c[r * 16 + j], &c2[r * 16 + j], 4) != 0, n += 2;
    }
  }
  printf("row alone / among other rows vs in the first tile: %ld of %ld outputs differ\n", diff, n);
}

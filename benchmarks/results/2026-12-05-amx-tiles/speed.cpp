// Throughput of TDPBF16PS by A tile width (pairs per instruction), 4 independent C tiles, tiles in L1; and of
// vdpbf16ps (24 independent accumulators). Useful products per cycle (rdtsc ticks).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
struct alignas(64) Cfg { uint8_t palette = 1, start = 0; uint8_t pad[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
alignas(64) static uint16_t A[16 * 32], B[16 * 32];
alignas(64) static float C[256];
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  const long iters = 2000000;
  for (int pairs : {1, 2, 4, 8, 16}) {
    Cfg cfg;
    for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    cfg.rows[4] = 16, cfg.colsb[4] = 4 * pairs, cfg.rows[5] = 16, cfg.colsb[5] = 4 * pairs;
    cfg.rows[6] = pairs, cfg.colsb[6] = 64, cfg.rows[7] = pairs, cfg.colsb[7] = 64;
    _tile_loadconfig(&cfg);
    _tile_loadd(0, C, 64); _tile_loadd(1, C, 64); _tile_loadd(2, C, 64); _tile_loadd(3, C, 64);
    _tile_loadd(4, A, 4 * pairs); _tile_loadd(5, A, 4 * pairs); _tile_loadd(6, B, 64); _tile_loadd(7, B, 64);
    auto t0 = std::chrono::steady_clock::now(); uint64_t c0 = __rdtsc();
    for (long i = 0; i < iters; ++i) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
    uint64_t c1 = __rdtsc(); double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    _tile_stored(0, C, 64); _tile_release();
    double macs = 4.0 * iters * 16 * 16 * 2 * pairs;
    printf("TDPBF16PS %2d pairs/instr: %.1f tsc ticks/instr, %.0f bf16 MAC/tick, %.0f GFLOP/s one core (if 1 product of each pair is a zero partner: %.0f)\n",
           pairs, double(c1 - c0) / (4.0 * iters), macs / double(c1 - c0), 2 * macs / s / 1e9, macs / s / 1e9);
  }
  __m512 acc[24]; for (auto& a : acc) a = _mm512_setzero_ps();
  __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), w = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  auto t0 = std::chrono::steady_clock::now(); uint64_t c0 = __rdtsc();
  for (long i = 0; i < iters * 4; ++i) {
#pragma GCC unroll 24
    for (int j = 0; j < 24; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], x, w);
    asm volatile("" : "+v"(acc[0]), "+v"(acc[5]), "+v"(acc[11]), "+v"(acc[23]));
  }
  uint64_t c1 = __rdtsc(); double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink[16]; _mm512_storeu_ps(sink, acc[3]);
  double macs = 4.0 * iters * 24 * 32;
  printf("vdpbf16ps zmm: %.0f bf16 MAC/tick, %.0f GFLOP/s one core (%g)\n", macs / double(c1 - c0), 2 * macs / s / 1e9, sink[0]);
}

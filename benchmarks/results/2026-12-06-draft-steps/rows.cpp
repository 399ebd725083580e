// Standalone copies of gemm.cpp's multi-row octet loops (one panel, one thread; on purpose: duplicates flags them):
// `cur` as direct_octets' R-row branch (V = 2), `blk` as block_octets (each block rebuilt into 2 KB on the stack,
// then R rows from there); ns and cycles (at 2.6 GHz) a k and 16 columns, best of 7, the two checked for the same
// bits. P panels (36: hot in L2; 6000: streamed from memory), IT passes over them.
//   g++ -O3 -march=native -std=c++17 -ffp-contract=off -o rows rows.cpp && ./rows && P=6000 IT=2 ./rows
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <chrono>
#include <vector>
#include <random>
#include <cstdlib>
using half = uint16_t;
constexpr int kRows = 6;
static inline __m256 ldh(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// current: direct_octets R-row branch, one panel (V=2)
template <int R>
__attribute__((noinline)) void cur(const float* x, const int32_t* q0, const half* d0, const half* m0, int k, float* y) {
  constexpr int V = 2;
  __m256 c[R][V];
  for (int r = 0; r < R; ++r) for (int v = 0; v < V; ++v) c[r][v] = _mm256_setzero_ps();
  const int groups = k / 32;
  for (int g = 0; g < groups; ++g) {
    __m256 m[V], dt[V];
    const int32_t* q = q0 + g * 64;
    for (int v = 0; v < V; ++v) dt[v] = ldh(d0 + g * 16 + 8 * v), m[v] = ldh(m0 + g * 16 + 8 * v);
    const __m256 sixteenth = _mm256_set1_ps(1.f / 16);
    __m256i mask = _mm256_set1_epi32(15);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int i = g * 32 + 4 * t + j;
        __m256 a[R];
#pragma GCC unroll 32
        for (int r = 0; r < R; ++r) a[r] = _mm256_set1_ps(x[i * kRows + r]);
#pragma GCC unroll 32
        for (int v = 0; v < V; ++v) {
          const __m256i raw = _mm256_loadu_si256((const __m256i*)(q + j * 16 + v * 8));
          const __m256i code = t < 7 ? _mm256_and_si256(raw, mask) : _mm256_srli_epi32(raw, 28);
          const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), dt[v], m[v]);
#pragma GCC unroll 32
          for (int r = 0; r < R; ++r) c[r][v] = _mm256_fmadd_ps(a[r], w, c[r][v]);
        }
      }
      if (t < 6) { mask = _mm256_slli_epi32(mask, 4); for (int v = 0; v < V; ++v) dt[v] = _mm256_mul_ps(dt[v], sixteenth); }
      else if (t == 6) { for (int v = 0; v < V; ++v) dt[v] = _mm256_mul_ps(dt[v], _mm256_set1_ps(16777216.f)); }
    }
  }
  for (int r = 0; r < R; ++r) for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + r * 16 + v * 8, c[r][v]);
}

// block: decode block g's 32 k x 16 into a stack buffer (k order), then R rows x 2 vectors from it
template <int R>
__attribute__((noinline)) void blk(const float* x, const int32_t* q0, const half* d0, const half* m0, int k, float* y) {
  constexpr int V = 2;
  __m256 c[R][V];
  for (int r = 0; r < R; ++r) for (int v = 0; v < V; ++v) c[r][v] = _mm256_setzero_ps();
  alignas(64) float wb[32 * 16];
  const int groups = k / 32;
  for (int g = 0; g < groups; ++g) {
    const int32_t* q = q0 + g * 64;
    {
      __m256 m[V], dt[V];
      for (int v = 0; v < V; ++v) dt[v] = ldh(d0 + g * 16 + 8 * v), m[v] = ldh(m0 + g * 16 + 8 * v);
      __m256i mask = _mm256_set1_epi32(15);
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j)
#pragma GCC unroll 2
          for (int v = 0; v < V; ++v) {
            const __m256i raw = _mm256_loadu_si256((const __m256i*)(q + j * 16 + v * 8));
            const __m256i code = t < 7 ? _mm256_and_si256(raw, mask) : _mm256_srli_epi32(raw, 28);
            _mm256_store_ps(wb + (4 * t + j) * 16 + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), dt[v], m[v]));
          }
        if (t < 6) { mask = _mm256_slli_epi32(mask, 4); for (int v = 0; v < V; ++v) dt[v] = _mm256_mul_ps(dt[v], _mm256_set1_ps(1.f / 16)); }
        else if (t == 6) { for (int v = 0; v < V; ++v) dt[v] = _mm256_mul_ps(dt[v], _mm256_set1_ps(16777216.f)); }
      }
    }
#pragma GCC unroll 32
    for (int kk = 0; kk < 32; ++kk) {
      const int i = g * 32 + kk;
      const __m256 w0 = _mm256_load_ps(wb + kk * 16), w1 = _mm256_load_ps(wb + kk * 16 + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_set1_ps(x[i * kRows + r]);
        c[r][0] = _mm256_fmadd_ps(a, w0, c[r][0]);
        c[r][1] = _mm256_fmadd_ps(a, w1, c[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + r * 16 + v * 8, c[r][v]);
}

int main() {
  const int k = 576, P = getenv("P") ? atoi(getenv("P")) : 36; const int iters = getenv("IT") ? atoi(getenv("IT")) : 200;
  std::mt19937 rng(1);
  std::vector<int32_t> q(P * k / 8 * 16);
  for (auto& v : q) v = rng();
  std::vector<half> d(P * k / 32 * 16), m(P * k / 32 * 16);
  for (size_t i = 0; i < d.size(); ++i) { d[i] = _cvtss_sh(0.001f * (1 + rng() % 100), 0); m[i] = _cvtss_sh(-0.01f * (rng() % 100) / 100, 0); }
  std::vector<float> x(k * kRows);
  for (auto& v : x) v = (rng() % 2000) / 1000.f - 1;
  std::vector<float> y1(P * 6 * 16), y2(P * 6 * 16);
  auto run = [&](auto fn, std::vector<float>& y) {
    double best = 1e9;
    for (int rep = 0; rep < 7; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < iters; ++it)
        for (int p = 0; p < P; ++p) fn(x.data(), q.data() + p * (k / 8) * 16, d.data() + p * (k / 32) * 16, m.data() + p * (k / 32) * 16, k, y.data() + p * 96);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best / iters / P / k * 1e9;  // ns per (k, 16 cols)
  };
#define ROW(R) { double a = run(cur<R>, y1), b = run(blk<R>, y2); printf("R=%d cur %.3f ns/unit (%.2f cyc@2.6) blk %.3f (%.2f) same=%d\n", R, a, a*2.6, b, b*2.6, (int)(memcmp(y1.data(), y2.data(), y1.size()*4)==0)); }
  ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6)
}

// A standalone copy of direct_octets' one-row loop (gemm.cpp at 2e27bc8) over octets streamed from memory
// (~31 MB, one thread): panel after panel (planar, as at 2e27bc8), the three in pairs of panels (as 11c1d37), and
// codes, d and m of a pair in one stream; ns a block of 32 weights, best of 5. Same bits from each (checked).
// The variants repeat the loop on purpose: only where they read codes, d and m differs (duplicates flags them).
//   g++ -O3 -march=native -std=c++17 -o streams streams.cpp && ./streams
// octets, one row: V=4 (2 panels, d and m in registers: gemm.cpp today) vs V=6 (3 panels, m from an fp32
// stack copy as the FMA's memory operand) vs V=4 with m from memory.  codes int32 [P][k/8][16], d,m fp16 [P][k/32][16]
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <vector>
using half = uint16_t;
static inline __m256 ldh(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

template <int P, bool MMEM, int PF = 0, int HINT = 3, bool PFS = false>
__attribute__((noinline)) void oct(const float* x, const int32_t* const* q, const half* const* ds, const half* const* ms, int k, float* y) {
  constexpr int V = P * 2;
  __m256 c[V];
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) c[v] = _mm256_setzero_ps();
  alignas(32) float mbuf[V * 8];
  const int groups = k / 32;
  for (int g = 0; g < groups; ++g) {
    if constexpr (PF > 0) {
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)(q[p] + (4 * (g + PF)) * 16) + 64 * l, (_mm_hint)HINT);
      if constexpr (PFS) {
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) {
          _mm_prefetch((const char*)(ds[p] + (g + PF) * 16), (_mm_hint)HINT);
          _mm_prefetch((const char*)(ms[p] + (g + PF) * 16), (_mm_hint)HINT);
        }
      }
    }
    __m256 m[V], dt[V];
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) {
      dt[v] = ldh(ds[v / 2] + g * 16 + (v % 2) * 8);
      if constexpr (MMEM) _mm256_store_ps(mbuf + v * 8, ldh(ms[v / 2] + g * 16 + (v % 2) * 8));
      else m[v] = ldh(ms[v / 2] + g * 16 + (v % 2) * 8);
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
          const __m256i raw = _mm256_loadu_si256((const __m256i*)(q[v / 2] + (4 * g + j) * 16 + (v % 2) * 8));
          const __m256i code = t < 7 ? _mm256_and_si256(raw, mask) : _mm256_srli_epi32(raw, 28);
          const __m256 mv = MMEM ? _mm256_load_ps(mbuf + v * 8) : m[v];
          const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), dt[v], mv);
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
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + v * 8, c[v]);
}

template <int P, bool MMEM, int PF = 0, int HINT = 3, bool PFS = false>
double run(int n, int k, int reps, std::vector<float>& yout) {
  int panels = n / 16;
  std::vector<int32_t> codes((size_t)panels * k / 8 * 16);
  std::vector<half> d((size_t)panels * k / 32 * 16), m(d.size());
  std::vector<float> x(k), y(n + 64);
  srand(1);
  for (auto& c : codes) c = rand();
  for (auto& f : d) f = 0x1C00 + rand() % 512;  // small positive fp16
  for (auto& f : m) f = 0xA000 + rand() % 512;
  for (auto& f : x) f = 0.1f * (rand() % 10);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int p = 0; p + P <= panels; p += P) {
      const int32_t* qp[P]; const half* dp[P]; const half* mp[P];
      for (int j = 0; j < P; ++j) { qp[j] = codes.data() + (size_t)(p + j) * k / 8 * 16; dp[j] = d.data() + (size_t)(p + j) * k / 32 * 16; mp[j] = m.data() + (size_t)(p + j) * k / 32 * 16; }
      oct<P, MMEM, PF, HINT, PFS>(x.data(), qp, dp, mp, k, y.data() + p * 16);
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < best) best = s;
  }
  yout = y;
  return best * 1e9 / ((double)(panels / P * P) * 16 * k / 32);  // ns per 32 weights
}


// one stream: per group, [codes p0 (64 int32) | codes p1 | d p0 (16 half) | d p1 | m p0 | m p1] = 640 B
template <int PF>
__attribute__((noinline)) void oct_il(const float* x, const uint8_t* base, int k, float* y) {
  constexpr int P = 2, V = 4;
  __m256 c[V];
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) c[v] = _mm256_setzero_ps();
  const int groups = k / 32;
  for (int g = 0; g < groups; ++g) {
    const uint8_t* blk = base + (size_t)g * 640;
    if constexpr (PF > 0) {
#pragma GCC unroll 10
      for (int l = 0; l < 10; ++l) _mm_prefetch((const char*)blk + PF * 640 + 64 * l, _MM_HINT_T0);
    }
    const int32_t* q0 = (const int32_t*)blk;
    const half* dd = (const half*)(blk + 512);
    const half* mm = (const half*)(blk + 576);
    __m256 m[V], dt[V];
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) { dt[v] = ldh(dd + v * 8); m[v] = ldh(mm + v * 8); }
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
          const __m256i raw = _mm256_loadu_si256((const __m256i*)(q0 + (v / 2) * 64 + j * 16 + (v % 2) * 8));
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
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + v * 8, c[v]);
}

template <int PF>
double run_il(int n, int k, int reps, std::vector<float>& yout) {
  int panels = n / 16;
  // the same values as run<>: build the planar arrays with the same rand() sequence, then interleave
  std::vector<int32_t> codes((size_t)panels * k / 8 * 16);
  std::vector<half> d((size_t)panels * k / 32 * 16), m(d.size());
  std::vector<float> x(k), y(n + 64);
  srand(1);
  for (auto& c : codes) c = rand();
  for (auto& f : d) f = 0x1C00 + rand() % 512;
  for (auto& f : m) f = 0xA000 + rand() % 512;
  for (auto& f : x) f = 0.1f * (rand() % 10);
  const int groups = k / 32;
  std::vector<uint8_t> il((size_t)panels / 2 * groups * 640);
  for (int pp = 0; pp < panels / 2; ++pp)
    for (int g = 0; g < groups; ++g) {
      uint8_t* blk = il.data() + ((size_t)pp * groups + g) * 640;
      for (int h = 0; h < 2; ++h) {
        const int p = 2 * pp + h;
        memcpy(blk + h * 256, codes.data() + ((size_t)p * k / 8 + 4 * g) * 16, 256);
        memcpy(blk + 512 + h * 32, d.data() + ((size_t)p * groups + g) * 16, 32);
        memcpy(blk + 576 + h * 32, m.data() + ((size_t)p * groups + g) * 16, 32);
      }
    }
  codes.clear(); codes.shrink_to_fit();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int pp = 0; pp < panels / 2; ++pp) oct_il<PF>(x.data(), il.data() + (size_t)pp * groups * 640, k, y.data() + pp * 32);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < best) best = s;
  }
  yout = y;
  return best * 1e9 / ((double)panels * 16 * k / 32);
}

// three streams, each pair-interleaved per group: codes [pair][g][2][64 int32], d/m [pair][g][2][16 half]
__attribute__((noinline)) void oct_3s(const float* x, const int32_t* qb, const half* db, const half* mb, int k, float* y) {
  constexpr int V = 4;
  __m256 c[V];
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) c[v] = _mm256_setzero_ps();
  const int groups = k / 32;
  for (int g = 0; g < groups; ++g) {
    const int32_t* q0 = qb + g * 128;
    __m256 m[V], dt[V];
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) { dt[v] = ldh(db + g * 32 + v * 8); m[v] = ldh(mb + g * 32 + v * 8); }
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
          const __m256i raw = _mm256_loadu_si256((const __m256i*)(q0 + (v / 2) * 64 + j * 16 + (v % 2) * 8));
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
#pragma GCC unroll 32
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + v * 8, c[v]);
}

double run_3s(int n, int k, int reps, std::vector<float>& yout) {
  int panels = n / 16;
  std::vector<int32_t> codes((size_t)panels * k / 8 * 16);
  std::vector<half> d((size_t)panels * k / 32 * 16), m(d.size());
  std::vector<float> x(k), y(n + 64);
  srand(1);
  for (auto& c : codes) c = rand();
  for (auto& f : d) f = 0x1C00 + rand() % 512;
  for (auto& f : m) f = 0xA000 + rand() % 512;
  for (auto& f : x) f = 0.1f * (rand() % 10);
  const int groups = k / 32;
  std::vector<int32_t> q2(codes.size());
  std::vector<half> d2(d.size()), m2(m.size());
  for (int p = 0; p < panels; ++p)
    for (int g = 0; g < groups; ++g) {
      const int pair = p / 2, h = p % 2;
      memcpy(q2.data() + (((size_t)pair * groups + g) * 2 + h) * 64, codes.data() + ((size_t)p * k / 8 + 4 * g) * 16, 256);
      memcpy(d2.data() + (((size_t)pair * groups + g) * 2 + h) * 16, d.data() + ((size_t)p * groups + g) * 16, 32);
      memcpy(m2.data() + (((size_t)pair * groups + g) * 2 + h) * 16, m.data() + ((size_t)p * groups + g) * 16, 32);
    }
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int p = 0; p < panels; p += 2)
      oct_3s(x.data(), q2.data() + (size_t)p / 2 * groups * 128, d2.data() + (size_t)p / 2 * groups * 32, m2.data() + (size_t)p / 2 * groups * 32, k, y.data() + p * 16);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < best) best = s;
  }
  yout = y;
  return best * 1e9 / ((double)panels * 16 * k / 32);
}
int main(int argc, char** argv) {
  const int k = 576;
  for (int round = 0; round < 4; ++round) {
    const int n = 3 * 16 * 2000, reps = 5;
    std::vector<float> y0, y1, y2;
    double r[3];
    r[0] = run<2, false>(n, k, reps, y0);
    r[1] = run_3s(n, k, reps, y1);
    r[2] = run_il<0>(n, k, reps, y2);
    printf("cold ns/32w: planar %.3f | 3 long streams %.3f | 1 stream %.3f (same %d %d)\n", r[0], r[1], r[2],
           memcmp(y0.data(), y1.data(), 4 * n) == 0, memcmp(y0.data(), y2.data(), 4 * n) == 0);
  }
}

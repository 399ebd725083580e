#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <vector>
#include <algorithm>
using vf = __m256;
constexpr int L = 8, kVecs = 2, kPanel = 16, kGroup = 32;
static inline vf ldh(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
// MODE: 0 full; 1 no cvt (cast); 2 no rebuild (acc only with q); 3 no code load (constant ints); 4 magic-number conversion (or+sub); 5 cvt via or + fma with prebiased m
template <int P, int MODE>
__attribute__((noinline)) void direct(const float* x, const uint8_t* const* q, const uint16_t* const* dd, const uint16_t* const* mm, int64_t k, float* y) {
  constexpr int V = P * kVecs;
  vf c[V];
  for (int v = 0; v < V; ++v) c[v] = _mm256_setzero_ps();
  const __m256i b15 = _mm256_set1_epi32(15);
  const __m256i magic = _mm256_set1_epi32(0x4B000000);
  const vf fmagic = _mm256_set1_ps(8388608.0f);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    alignas(64) float d[V * L], m[V * L];
#pragma GCC unroll 32
    for (int v = 0; v < V; ++v) {
      const int p = v / kVecs, lane = (v % kVecs) * L;
      _mm256_store_ps(d + v * L, ldh(dd[p] + g * kPanel + lane));
      _mm256_store_ps(m + v * L, ldh(mm[p] + g * kPanel + lane));
    }
#pragma GCC unroll 4
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; i += 2) {
      const vf a0 = _mm256_set1_ps(x[i]), a1 = _mm256_set1_ps(x[i + 1]);
#pragma GCC unroll 32
      for (int v = 0; v < V; ++v) {
        const int p = v / kVecs, lane = (v % kVecs) * L;
        __m256i b;
        if constexpr (MODE == 3) b = _mm256_set1_epi32(0x53 + v);
        else if constexpr (MODE == 5) { const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[p] + i / 2 * kPanel + lane));
                                        b = _mm256_cvtepu8_epi32(raw); }
        else if constexpr (MODE == 6) { const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[p] + i / 2 * kPanel));
                                        b = lane == 0 ? _mm256_cvtepu8_epi32(raw) : _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(raw, raw)); }
        else b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[p] + i / 2 * kPanel + lane)));
        vf q0, q1;
        if constexpr (MODE == 1) { q0 = _mm256_castsi256_ps(_mm256_and_si256(b, b15)); q1 = _mm256_castsi256_ps(_mm256_srli_epi32(b, 4)); }
        else if constexpr (MODE == 4) { q0 = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(b, b15), magic)), fmagic);
                                        q1 = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_srli_epi32(b, 4), magic)), fmagic); }
        else { q0 = _mm256_cvtepi32_ps(_mm256_and_si256(b, b15)); q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }
        const vf dv = _mm256_load_ps(d + v * L), mv = _mm256_load_ps(m + v * L);
        if constexpr (MODE == 2) {
          c[v] = _mm256_fmadd_ps(a0, q0, c[v]);
          c[v] = _mm256_fmadd_ps(a1, q1, c[v]);
        } else {
          c[v] = _mm256_fmadd_ps(a0, _mm256_fmadd_ps(q0, dv, mv), c[v]);
          c[v] = _mm256_fmadd_ps(a1, _mm256_fmadd_ps(q1, dv, mv), c[v]);
        }
      }
    }
  }
  for (int v = 0; v < V; ++v) _mm256_storeu_ps(y + v * L, c[v]);
}
using Fn = void (*)(const float*, const uint8_t* const*, const uint16_t* const*, const uint16_t* const*, int64_t, float*);
template <int P>
double run(Fn fn, int64_t panels, int64_t k, int reps) {
  std::vector<uint8_t> codes(panels * k / 2 * kPanel);
  std::vector<uint16_t> d(panels * k / 32 * kPanel, 0x3c00), m(panels * k / 32 * kPanel, 0x3800);
  for (auto& b : codes) b = rand();
  std::vector<float> x(k, 0.5f), y(panels * kPanel);
  auto once = [&] {
    for (int64_t p = 0; p < panels; p += P) {
      const uint8_t* q[P]; const uint16_t* dp[P]; const uint16_t* mp[P];
      for (int j = 0; j < P; ++j) { q[j] = codes.data() + (p + j) * k / 2 * kPanel; dp[j] = d.data() + (p + j) * k / 32 * kPanel; mp[j] = m.data() + (p + j) * k / 32 * kPanel; }
      fn(x.data(), q, dp, mp, k, y.data() + p * kPanel);
    }
  };
  once();
  double best = 1e9;
  for (int r = 0; r < 7; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) once();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps);
  }
  return best;
}
int main(int argc, char** argv) {
  if (argc > 2) { const int64_t panels = atoi(argv[2]), k = 576; const double ghz = atof(argv[1]); const double w = panels * kPanel * k;
    auto report = [&](const char* name, double s) { printf("%-34s %7.1f us  %.2f cyc/32w\n", name, s * 1e6, s * ghz * 1e9 / (w / 32)); };
    report("P=4 full", run<4>(direct<4, 0>, panels, k, 2000));
    report("P=4 movq+pmovzx", run<4>(direct<4, 5>, panels, k, 2000));
    report("P=4 16B load + unpack", run<4>(direct<4, 6>, panels, k, 2000));
    report("P=4 no code load", run<4>(direct<4, 3>, panels, k, 2000));
    return 0; }
  double ghz = argc > 1 ? atof(argv[1]) : 2.8;
  const int64_t panels = 60, k = 576;
  const double w = panels * kPanel * k;
  auto report = [&](const char* name, double s) { printf("%-34s %7.1f us  %.2f cyc/32w\n", name, s * 1e6, s * ghz * 1e9 / (w / 32)); };
  report("P=4 full", run<4>(direct<4, 0>, panels, k, 200));
  report("P=4 no cvt", run<4>(direct<4, 1>, panels, k, 200));
  report("P=4 no rebuild", run<4>(direct<4, 2>, panels, k, 200));
  report("P=4 no code load", run<4>(direct<4, 3>, panels, k, 200));
  report("P=4 magic conversion", run<4>(direct<4, 4>, panels, k, 200));
  report("P=2 full", run<2>(direct<2, 0>, panels, k, 200));
  report("P=2 no cvt", run<2>(direct<2, 1>, panels, k, 200));
  report("P=2 no rebuild", run<2>(direct<2, 2>, panels, k, 200));
  report("P=2 no code load", run<2>(direct<2, 3>, panels, k, 200));
  report("P=2 magic", run<2>(direct<2, 4>, panels, k, 200));
}

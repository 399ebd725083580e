// Q8_0 head at one row: int8 codes, fp16 d, m; layouts: planar (panel after panel, a call two panels),
// paired (per group the pair's codes, then d pair, m pair: three streams), one stream (codes, d, m of a group
// together), one stream without m (Q8_0's m = -0: q*d + -0 == q*d). 2 threads, rotating among copies (from memory).
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <thread>
#include <vector>
#include <algorithm>
#include <cstring>
using half = uint16_t;
static inline __m256 ldh(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline __m256 ldq(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
constexpr int K = 576, G = K / 32;
int AHEAD = 4;
// layout 0 planar: codes [P][K][16], d,m [P][G][16]
// layout 1 paired: codes [pair][G][2][32][16], d,m [pair][G][2][16]
// layout 2 one stream: [pair][G]{codes 2x512, d 2x16 half, m 2x16 half} = 1152 B
// layout 3 one stream no m: [pair][G]{codes 1024, d 64 B} = 1088 B
template <int L>
__attribute__((noinline)) void call(const float* x, const int8_t* q0, const int8_t* q1, const half* d0, const half* d1,
                                    const half* m0, const half* m1, const uint8_t* blk, float* y, int ahead) {
  __m256 c[4];
  for (int v = 0; v < 4; ++v) c[v] = _mm256_setzero_ps();
  constexpr int64_t gb = L == 2 ? 1152 : 1088;
  for (int g = 0; g < G; ++g) {
    const int8_t* q[2]; const half* dd[2]; const half* mm[2];
    if constexpr (L == 0) {
      q[0] = q0 + g * 512, q[1] = q1 + g * 512, dd[0] = d0 + g * 16, dd[1] = d1 + g * 16, mm[0] = m0 + g * 16, mm[1] = m1 + g * 16;
      for (int p = 0; p < 2; ++p) {
        const char* a = (const char*)(q[p] + ahead * 512);
        for (int l = 0; l < 512; l += 64) _mm_prefetch(a + l, _MM_HINT_T0);
        _mm_prefetch((const char*)(dd[p] + ahead * 16), _MM_HINT_T0);
        _mm_prefetch((const char*)(mm[p] + ahead * 16), _MM_HINT_T0);
      }
    } else if constexpr (L == 1) {
      q[0] = q0 + g * 1024, q[1] = q[0] + 512, dd[0] = d0 + g * 32, dd[1] = dd[0] + 16, mm[0] = m0 + g * 32, mm[1] = mm[0] + 16;
      const char* a = (const char*)(q[0] + ahead * 1024);
      for (int l = 0; l < 1024; l += 64) _mm_prefetch(a + l, _MM_HINT_T0);
      _mm_prefetch((const char*)(dd[0] + ahead * 32), _MM_HINT_T0);
      _mm_prefetch((const char*)(mm[0] + ahead * 32), _MM_HINT_T0);
    } else {
      const uint8_t* b = blk + g * gb;
      q[0] = (const int8_t*)b, q[1] = q[0] + 512, dd[0] = (const half*)(b + 1024), dd[1] = dd[0] + 16;
      mm[0] = (const half*)(b + 1088), mm[1] = mm[0] + 16;
      const char* a = (const char*)(b + ahead * gb);
      for (int l = 0; l < gb; l += 64) _mm_prefetch(a + l, _MM_HINT_T0);
    }
    alignas(32) float d[32], m[32];
    for (int v = 0; v < 4; ++v) {
      _mm256_store_ps(d + v * 8, ldh(dd[v / 2] + (v % 2) * 8));
      if constexpr (L != 3) _mm256_store_ps(m + v * 8, ldh(mm[v / 2] + (v % 2) * 8));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 32; i += 2) {
      const __m256 a0 = _mm256_set1_ps(x[g * 32 + i]), a1 = _mm256_set1_ps(x[g * 32 + i + 1]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const int8_t* p = q[v / 2] + i * 16 + (v % 2) * 8;
        const __m256 dv = _mm256_load_ps(d + v * 8);
        __m256 w0, w1;
        if constexpr (L == 3) {
          w0 = _mm256_mul_ps(ldq(p), dv), w1 = _mm256_mul_ps(ldq(p + 16), dv);
        } else {
          const __m256 mv = _mm256_load_ps(m + v * 8);
          w0 = _mm256_fmadd_ps(ldq(p), dv, mv), w1 = _mm256_fmadd_ps(ldq(p + 16), dv, mv);
        }
        c[v] = _mm256_fmadd_ps(a0, w0, c[v]);
        c[v] = _mm256_fmadd_ps(a1, w1, c[v]);
      }
    }
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + v * 8, c[v]);
}

struct Copy { std::vector<int8_t> q; std::vector<half> d, m; std::vector<uint8_t> s2, s3; };

template <int L>
void share(const Copy& w, const float* x, float* y, int p0, int p1, int ahead) {
  for (int p = p0; p < p1; p += 2) {
    if constexpr (L == 0)
      call<0>(x, w.q.data() + (size_t)p * K * 16, w.q.data() + (size_t)(p + 1) * K * 16, w.d.data() + (size_t)p * G * 16,
              w.d.data() + (size_t)(p + 1) * G * 16, w.m.data() + (size_t)p * G * 16, w.m.data() + (size_t)(p + 1) * G * 16, nullptr, y + p * 16, ahead);
    else if constexpr (L == 1)
      call<1>(x, w.q.data() + (size_t)p * K * 16, nullptr, w.d.data() + (size_t)p * G * 16, nullptr, w.m.data() + (size_t)p * G * 16, nullptr, nullptr, y + p * 16, ahead);
    else if constexpr (L == 2)
      call<2>(x, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, w.s2.data() + (size_t)(p / 2) * G * 1152, y + p * 16, ahead);
    else
      call<3>(x, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, w.s3.data() + (size_t)(p / 2) * G * 1088, y + p * 16, ahead);
  }
}

int main(int argc, char** argv) {
  if (getenv("AHEAD")) AHEAD = atoi(getenv("AHEAD"));
  const int panels = 3072, copies = 4, rounds = argc > 1 ? atoi(argv[1]) : 30;
  std::vector<Copy> ws(copies);
  srand(1);
  for (auto& w : ws) {
    srand(1);
    w.q.resize((size_t)panels * K * 16); w.d.resize((size_t)panels * G * 16); w.m.resize(w.d.size());
    for (auto& c : w.q) c = rand();
    for (auto& f : w.d) f = 0x1C00 + rand() % 512;
    for (auto& f : w.m) f = 0x8000;  // -0
    w.s2.resize((size_t)panels / 2 * G * 1152); w.s3.resize((size_t)panels / 2 * G * 1088);
    for (int pr = 0; pr < panels / 2; ++pr)
      for (int g = 0; g < G; ++g) {
        uint8_t* b2 = w.s2.data() + ((size_t)pr * G + g) * 1152; uint8_t* b3 = w.s3.data() + ((size_t)pr * G + g) * 1088;
        for (int h = 0; h < 2; ++h) {
          const int p = 2 * pr + h;
          memcpy(b2 + h * 512, w.q.data() + ((size_t)p * K + g * 32) * 16, 512);
          memcpy(b3 + h * 512, w.q.data() + ((size_t)p * K + g * 32) * 16, 512);
          memcpy(b2 + 1024 + h * 32, w.d.data() + ((size_t)p * G + g) * 16, 32);
          memcpy(b3 + 1024 + h * 32, w.d.data() + ((size_t)p * G + g) * 16, 32);
          memcpy(b2 + 1088 + h * 32, w.m.data() + ((size_t)p * G + g) * 16, 32);
        }
      }
  }
  // paired layout for L1, in place of a separate copy: build per copy
  std::vector<Copy> pw(copies);
  for (int c = 0; c < copies; ++c) {
    auto& w = ws[c]; auto& o = pw[c];
    o.q.resize(w.q.size()); o.d.resize(w.d.size()); o.m.resize(w.m.size());
    for (int pr = 0; pr < panels / 2; ++pr)
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < 2; ++h) {
          const int p = 2 * pr + h;
          memcpy(o.q.data() + ((size_t)pr * G * 2 + g * 2 + h) * 512, w.q.data() + ((size_t)p * K + g * 32) * 16, 512);
          memcpy(o.d.data() + ((size_t)pr * G * 2 + g * 2 + h) * 16, w.d.data() + ((size_t)p * G + g) * 16, 32);
          memcpy(o.m.data() + ((size_t)pr * G * 2 + g * 2 + h) * 16, w.m.data() + ((size_t)p * G + g) * 16, 32);
        }
  }
  std::vector<float> x(K), y[4];
  for (auto& f : x) f = 0.1f * (rand() % 10);
  for (auto& v : y) v.assign(panels * 16, 0);
  const char* names[] = {"planar", "paired", "one stream", "one stream, no m"};
  std::vector<double> t[4];
  int turn = 0;
  for (int r = 0; r < rounds; ++r) {
    int order[4] = {0, 1, 2, 3};
    std::random_shuffle(order, order + 4);
    for (int oi = 0; oi < 4; ++oi) {
      const int L = order[oi];
      const Copy& w = L == 1 ? pw[turn % copies] : ws[turn % copies];
      ++turn;
      auto t0 = std::chrono::steady_clock::now();
      auto work = [&](int p0, int p1) {
        switch (L) {
          case 0: share<0>(w, x.data(), y[L].data(), p0, p1, AHEAD); break;
          case 1: share<1>(w, x.data(), y[L].data(), p0, p1, AHEAD); break;
          case 2: share<2>(w, x.data(), y[L].data(), p0, p1, AHEAD); break;
          default: share<3>(w, x.data(), y[L].data(), p0, p1, AHEAD);
        }
      };
      std::thread th(work, panels / 2, panels);
      work(0, panels / 2);
      th.join();
      t[L].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e6);
    }
  }
  for (int L = 1; L < 4; ++L)
    if (memcmp(y[L].data(), y[0].data(), y[0].size() * 4) != 0) printf("layout %d: bits differ\n", L);
  double base = 0;
  for (int L = 0; L < 4; ++L) {
    auto v = t[L]; std::sort(v.begin(), v.end());
    const double med = v[v.size() / 2];
    if (L == 0) base = med;
    const double bytes = L == 3 ? panels / 2.0 * G * 1088 : panels / 2.0 * G * 1152;
    printf("%-18s median %7.0f us  min %7.0f  %5.1f GB/s  speed-up %.2fx\n", names[L], med, v[0], bytes / med / 1e3, base / med);
  }
}

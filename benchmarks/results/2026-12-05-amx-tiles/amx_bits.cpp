// Does a chain of TDPBF16PS over k pairs in order give the fp32 bits of one vdpbf16ps accumulator
// fed the same pairs in order? g++ -O2 -march=native amx_bits.cpp -o amx_bits
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <random>
#include <vector>

constexpr int M = 16, N = 16;

struct alignas(64) Cfg {
  uint8_t palette = 1, start = 0;
  uint8_t pad[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static uint16_t bf(float f) {  // truncation: the generators give bf16-exact floats anyway
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u >> 16;
}

// x [M][K] bf16, w [N][K] bf16 (K even, zero padded). Reference: per row, per pair in order, one vdpbf16ps.
static void ref(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w, int K, std::vector<float>& y) {
  const int pairs = K / 2;
  std::vector<uint16_t> panel(pairs * 32);
  for (int i = 0; i < pairs; ++i)
    for (int j = 0; j < N; ++j) panel[i * 32 + 2 * j] = w[j * K + 2 * i], panel[i * 32 + 2 * j + 1] = w[j * K + 2 * i + 1];
  for (int r = 0; r < M; ++r) {
    __m512 c = _mm512_setzero_ps();
    for (int i = 0; i < pairs; ++i) {
      uint32_t a = x[r * K + 2 * i] | uint32_t(x[r * K + 2 * i + 1]) << 16;
      c = _mm512_dpbf16_ps(c, (__m512bh)_mm512_set1_epi32(int(a)), (__m512bh)_mm512_loadu_si512(&panel[i * 32]));
    }
    _mm512_storeu_ps(&y[r * N], c);
  }
}

// AMX: tiles of `step` pairs (1..16) per TDPBF16PS, chained over K in order. swap: each pair's two elements
// swapped (in both x and w, same products, other order inside the instruction).
static void amx(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w, int K, int step, bool swap,
                std::vector<float>& y) {
  const int pairs = K / 2;
  Cfg cfg;
  cfg.rows[0] = M, cfg.colsb[0] = N * 4;  // C
  cfg.rows[1] = M, cfg.colsb[1] = step * 4;  // A: M rows of step pairs
  cfg.rows[2] = step, cfg.colsb[2] = N * 4;  // B: step pairs x N cols x 2
  _tile_loadconfig(&cfg);
  std::vector<uint16_t> a(M * step * 2), b(step * N * 2);
  std::vector<float> c(M * N, 0.f);
  _tile_loadd(0, c.data(), N * 4);
  for (int i0 = 0; i0 < pairs; i0 += step) {
    // K is a multiple of 2*step here
    for (int r = 0; r < M; ++r)
      for (int i = 0; i < step; ++i)
        for (int e = 0; e < 2; ++e) a[(r * step + i) * 2 + (swap ? 1 - e : e)] = x[r * K + 2 * (i0 + i) + e];
    for (int i = 0; i < step; ++i)
      for (int j = 0; j < N; ++j)
        for (int e = 0; e < 2; ++e) b[(i * N + j) * 2 + (swap ? 1 - e : e)] = w[j * K + 2 * (i0 + i) + e];
    _tile_loadd(1, a.data(), step * 4);
    _tile_loadd(2, b.data(), N * 4);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, y.data(), N * 4);
  _tile_release();
}


// One product per TDPBF16PS: pair (x_k, -0) . (w_k, +0), k = 2i + 1 then 2i (vdpbf16ps's order), one
// instruction each: round(c + round(p + -0)) = round(c + p)
static void amx_single(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w, int K, std::vector<float>& y) {
  Cfg cfg;
  cfg.rows[0] = M, cfg.colsb[0] = N * 4;
  cfg.rows[1] = M, cfg.colsb[1] = 4;
  cfg.rows[2] = 1, cfg.colsb[2] = N * 4;
  _tile_loadconfig(&cfg);
  std::vector<uint16_t> a(M * 2), b(N * 2);
  std::vector<float> c(M * N, 0.f);
  _tile_loadd(0, c.data(), N * 4);
  for (int i = 0; i < K / 2; ++i)
    for (int e = 1; e >= 0; --e) {
      for (int r = 0; r < M; ++r) a[2 * r] = x[r * K + 2 * i + e], a[2 * r + 1] = 0x8000;
      for (int j = 0; j < N; ++j) b[2 * j] = w[j * K + 2 * i + e], b[2 * j + 1] = 0;
      _tile_loadd(1, a.data(), 4);
      _tile_loadd(2, b.data(), N * 4);
      _tile_dpbf16ps(0, 1, 2);
    }
  _tile_stored(0, y.data(), N * 4);
  _tile_release();
}


// TDPBF16PS's numerics (blocks of 16 pairs: an even chain and an odd chain, then c + (even + odd)) with
// vdpbf16ps: each chain one vdpbf16ps per pair with the other element of the input pair zeroed
static __m512 ftz(__m512 v) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(0x1p-126f), _CMP_LT_OQ);
  return _mm512_mask_and_ps(v, tiny, v, _mm512_set1_ps(-0.f));
}
static void emul(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w, int K, std::vector<float>& y) {
  const int pairs = K / 2;
  std::vector<uint16_t> panel(pairs * 32);
  for (int i = 0; i < pairs; ++i)
    for (int j = 0; j < N; ++j) panel[i * 32 + 2 * j] = w[j * K + 2 * i], panel[i * 32 + 2 * j + 1] = w[j * K + 2 * i + 1];
  for (int r = 0; r < M; ++r) {
    __m512 c = _mm512_setzero_ps();
    for (int i0 = 0; i0 < pairs; i0 += 16) {
      __m512 te = _mm512_setzero_ps(), to = _mm512_setzero_ps();
      for (int i = i0; i < std::min(pairs, i0 + 16); ++i) {
        uint32_t a = x[r * K + 2 * i] | uint32_t(x[r * K + 2 * i + 1]) << 16;
        const __m512bh b = (__m512bh)_mm512_loadu_si512(&panel[i * 32]);
        te = _mm512_dpbf16_ps(te, (__m512bh)_mm512_set1_epi32(int(a & 0xffff)), b);
        to = _mm512_dpbf16_ps(to, (__m512bh)_mm512_set1_epi32(int(a & 0xffff0000u)), b);
      }
      c = ftz(_mm512_add_ps(c, ftz(_mm512_add_ps(te, to))));
    }
    _mm512_storeu_ps(&y[r * N], c);
  }
}


// The same numerics with one vdpbf16ps per two products, as now: vdpbf16ps adds its odd element's product
// first, so the even chain's steps k, k + 2 go in one vdpbf16ps as the pair (k + 2, k), and the odd chain's
// k + 1, k + 3 as (k + 3, k + 1)
static void emul2(const std::vector<uint16_t>& x, const std::vector<uint16_t>& w, int K, std::vector<float>& y) {
  const int pairs = K / 2;  // K a multiple of 4 here
  // per 4 k: the even chain's 16 columns x (k + 2, k), then the odd chain's x (k + 3, k + 1)
  std::vector<uint16_t> pe(pairs / 2 * 32), po(pairs / 2 * 32);
  for (int q = 0; q < pairs / 2; ++q)
    for (int j = 0; j < N; ++j) {
      pe[q * 32 + 2 * j] = w[j * K + 4 * q + 2], pe[q * 32 + 2 * j + 1] = w[j * K + 4 * q];
      po[q * 32 + 2 * j] = w[j * K + 4 * q + 3], po[q * 32 + 2 * j + 1] = w[j * K + 4 * q + 1];
    }
  for (int r = 0; r < M; ++r) {
    __m512 c = _mm512_setzero_ps();
    for (int q0 = 0; q0 < pairs / 2; q0 += 8) {
      __m512 te = _mm512_setzero_ps(), to = _mm512_setzero_ps();
      for (int q = q0; q < std::min(pairs / 2, q0 + 8); ++q) {
        const uint16_t* xr = &x[r * K + 4 * q];
        const uint32_t ae = xr[2] | uint32_t(xr[0]) << 16, ao = xr[3] | uint32_t(xr[1]) << 16;
        te = _mm512_dpbf16_ps(te, (__m512bh)_mm512_set1_epi32(int(ae)), (__m512bh)_mm512_loadu_si512(&pe[q * 32]));
        to = _mm512_dpbf16_ps(to, (__m512bh)_mm512_set1_epi32(int(ao)), (__m512bh)_mm512_loadu_si512(&po[q * 32]));
      }
      c = ftz(_mm512_add_ps(c, ftz(_mm512_add_ps(te, to))));
    }
    _mm512_storeu_ps(&y[r * N], c);
  }
}

// Software models of one output's chain, to name what the hardware does: DAZ on bf16 inputs, FTZ on results
static float daz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.f, v) : v; }
// each product exact in fp32 (bf16 x bf16 fits in 16 bits of mantissa); two roundings per pair, order o
static float model_two(float c, float a0, float b0, float a1, float b1, bool odd_first) {
  float p0 = daz(a0) * daz(b0), p1 = daz(a1) * daz(b1);
  if (odd_first) c = daz(c + p1), c = daz(c + p0);
  else c = daz(c + p0), c = daz(c + p1);
  return c;
}

struct Gen {
  std::mt19937_64 g;
  explicit Gen(uint64_t s) : g(s) {}
  float normal() { return std::normal_distribution<float>(0.f, 1.f)(g); }
  int uni(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(g); }
  uint16_t any_finite() {  // any finite bf16, denormals included
    for (;;) {
      uint16_t v = uint16_t(g());
      if (((v >> 7) & 0xff) != 0xff) return v;
    }
  }
  uint16_t exp_range(int lo, int hi) {  // random sign/mantissa, exponent field in [lo, hi]
    return uint16_t((g() & 1) << 15 | uni(lo, hi) << 7 | (g() & 0x7f));
  }
};

static float f(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

static uint32_t bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}

// kind of data
static void fill(Gen& G, int kind, int K, std::vector<uint16_t>& x, std::vector<uint16_t>& w) {
  for (int r = 0; r < M; ++r)
    for (int k = 0; k < K; ++k) {
      uint16_t& a = x[r * K + k];
      switch (kind) {
        case 0: a = bf(G.normal()); break;                     // random normal
        case 1: a = G.any_finite(); break;                     // any finite bits (overflow to inf likely)
        case 2: a = G.exp_range(100, 154); break;              // wide but moderate exponents (products ~2^-54..2^54)
        case 3: a = G.exp_range(0, 8); break;                  // denormal and tiny inputs
        case 4: a = G.exp_range(60, 70); break;                // products near fp32 denormal range (2^-134..)
        default: a = bf(G.normal()); break;
      }
    }
  for (int j = 0; j < N; ++j)
    for (int k = 0; k < K; ++k) {
      uint16_t& b = w[j * K + k];
      switch (kind) {
        case 0: b = bf(G.normal()); break;
        case 1: b = G.any_finite(); break;
        case 2: b = G.exp_range(100, 154); break;
        case 3: b = G.exp_range(120, 134); break;  // x denormal/tiny times ordinary
        case 4: b = G.exp_range(60, 70); break;
        default: b = bf(G.normal()); break;
      }
    }
  if (kind == 5) {  // pairs whose two products cancel exactly or almost: a1*b1 = -(a0*b0) (+ a few ulps)
    for (int r = 0; r < M; ++r)
      for (int k = 0; k < K; k += 2) x[r * K + k + 1] = x[r * K + k] ^ 0x8000 ^ (G.uni(0, 3) == 0 ? G.uni(0, 3) : 0);
    for (int j = 0; j < N; ++j)
      for (int k = 0; k < K; k += 2) w[j * K + k + 1] = w[j * K + k];
  }
  if (kind == 6) {  // catastrophic cancellation against the accumulator: a huge pair then pairs that undo it
    for (int r = 0; r < M; ++r)
      for (int k = 0; k < K; ++k) x[r * K + k] = bf((k % 8 < 2 ? 1e6f : 1.f) * G.normal());
    for (int j = 0; j < N; ++j)
      for (int k = 0; k < K; ++k) w[j * K + k] = bf((k % 8 < 2 ? 1e6f : 1e-3f) * G.normal());
    // the second pair of every 8 k repeats the first with the sign flipped: the accumulator drops from ~1e12 to ~0
    for (int r = 0; r < M; ++r)
      for (int k = 0; k + 3 < K; k += 8) x[r * K + k + 2] = x[r * K + k] ^ 0x8000, x[r * K + k + 3] = x[r * K + k + 1] ^ 0x8000;
    for (int j = 0; j < N; ++j)
      for (int k = 0; k + 3 < K; k += 8) w[j * K + k + 2] = w[j * K + k], w[j * K + k + 3] = w[j * K + k + 1];
  }
  if (kind == 7) {  // big products with different exponents inside a pair: the pair sum's rounding matters
    for (int r = 0; r < M; ++r)
      for (int k = 0; k < K; k += 2) x[r * K + k] = G.exp_range(127, 127), x[r * K + k + 1] = G.exp_range(100, 150);
    for (int j = 0; j < N; ++j)
      for (int k = 0; k < K; k += 2) w[j * K + k] = G.exp_range(127, 150), w[j * K + k + 1] = G.exp_range(110, 127);
  }
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023 /*ARCH_REQ_XCOMP_PERM*/, 18 /*XFEATURE_XTILEDATA*/) != 0) {
    std::perror("arch_prctl");
    return 1;
  }
  const int trials = argc > 1 ? std::atoi(argv[1]) : 20;
  const char* names[] = {"normal", "any-finite", "wide-exp", "denormal-in", "tiny-products", "pair-cancel",
                         "acc-cancel", "pair-exp-spread"};
  const int Ks[] = {2, 4, 6, 8, 16, 30, 32, 34, 62, 64, 96, 128, 254, 256, 576, 1024, 1536, 2048, 4096};
  long long emul2_total = 0, emul_total = 0, single_total = 0, total = 0, diff_amx[17] = {}, diff_swap = 0, diff_model_odd = 0, diff_model_even = 0, nan_outputs = 0,
            denorm_results = 0;
  Gen G(12345);
  std::printf("kind,K,step,outputs,mismatch_amx,mismatch_amx_swapped,mismatch_model_odd_first,mismatch_model_even_first,mismatch_one_product_per_instruction,mismatch_vdpbf16ps_emulation_vs_16pair_tdpbf16ps,mismatch_emulation2\n");
  for (int kind = 0; kind < 8; ++kind)
    for (int K : Ks) {
      long long ke2 = 0, ke = 0, kq = 0, kt = 0, kd = 0, ks = 0, kmo = 0, kme = 0;
      long long kstep[17] = {};
      for (int t = 0; t < trials; ++t) {
        std::vector<uint16_t> x(M * K), w(N * K);
        fill(G, kind, K, x, w);
        std::vector<float> yr(M * N), ya(M * N), ys(M * N), yq(M * N), ye(M * N), ye2(M * N), y16(M * N);
        ref(x, w, K, yr);
        const int steps[] = {1, 2, 16};
        for (int step : steps) {
          if ((K / 2) % step) continue;
          amx(x, w, K, step, false, ya);
          for (int i = 0; i < M * N; ++i)
            if (bits(ya[i]) != bits(yr[i]) && !(std::isnan(ya[i]) && std::isnan(yr[i]))) ++kstep[step];
        }
        const int maxstep = (K / 2) % 16 == 0 ? 16 : ((K / 2) % 2 == 0 ? 2 : 1);
        amx(x, w, K, maxstep, false, ya);
        amx(x, w, K, maxstep, true, ys);
        amx_single(x, w, K, yq);
        emul(x, w, K, ye);
        emul2(x, w, K, ye2);
        amx(x, w, K, (K / 2) % 16 == 0 ? 16 : 1, false, y16);
        for (int r = 0; r < M; ++r)
          for (int j = 0; j < N; ++j) {
            float co = 0.f, ce = 0.f;
            for (int i = 0; i < K / 2; ++i) {
              float a0 = f(x[r * K + 2 * i]), a1 = f(x[r * K + 2 * i + 1]), b0 = f(w[j * K + 2 * i]), b1 = f(w[j * K + 2 * i + 1]);
              co = model_two(co, a0, b0, a1, b1, true);
              ce = model_two(ce, a0, b0, a1, b1, false);
            }
            const int o = r * N + j;
            auto ne = [](float p, float q) { return bits(p) != bits(q) && !(std::isnan(p) && std::isnan(q)); };
            ++kt;
            nan_outputs += std::isnan(yr[o]);
            denorm_results += std::fpclassify(ya[o]) == FP_SUBNORMAL || std::fpclassify(yr[o]) == FP_SUBNORMAL;
            kd += ne(ya[o], yr[o]);
            kq += ne(yq[o], yr[o]);
            ke += ne(ye[o], y16[o]) && (K / 2) % 16 == 0;
            ke2 += ne(ye2[o], y16[o]) && (K / 2) % 16 == 0;
            if (ne(ye[o], y16[o]) && (K / 2) % 16 == 0 && ke <= 3) std::fprintf(stderr, "emul %s K=%d: tdpbf16ps %08x emulation %08x\n", names[kind], K, bits(y16[o]), bits(ye[o]));
            if (ne(yq[o], yr[o]) && kq <= 2) std::fprintf(stderr, "single %s K=%d: vdpbf16ps %08x tdpbf16ps-single %08x\n", names[kind], K, bits(yr[o]), bits(yq[o]));
            ks += ne(ys[o], yr[o]);
            kmo += ne(co, yr[o]);
            kme += ne(ce, ya[o]);
            if (ne(ya[o], yr[o]) && kd <= 2 && K <= 4)
              std::fprintf(stderr, "example %s K=%d out(%d,%d): vdpbf16ps %08x (%a) tdpbf16ps %08x (%a)\n", names[kind], K,
                           r, j, bits(yr[o]), yr[o], bits(ya[o]), ya[o]);
          }
      }
      single_total += kq, emul_total += ke, emul2_total += ke2, total += kt, diff_swap += ks, diff_model_odd += kmo, diff_model_even += kme;
      for (int s = 0; s < 17; ++s) diff_amx[s] += kstep[s];
      std::printf("%s,%d,%d,%lld,%lld,%lld,%lld,%lld,single:%lld,emulation-vs-tdpbf16ps:%lld,emulation2:%lld  (per step 1:%lld 2:%lld 16:%lld)\n", names[kind], K,
                  (K / 2) % 16 == 0 ? 16 : ((K / 2) % 2 == 0 ? 2 : 1), kt, kd, ks, kmo, kme, kq, ke, ke2, kstep[1], kstep[2], kstep[16]);
    }
  std::printf("TOTAL outputs %lld: mismatches amx step1 %lld step2 %lld step16 %lld; swapped %lld; "
              "model(odd first) vs vdpbf16ps %lld; model(even first) vs tdpbf16ps %lld; nan outputs %lld; denormal results %lld; one-product-per-instruction mismatches %lld; vdpbf16ps emulation of 16-pair TDPBF16PS mismatches %lld (one vdpbf16ps per two products: %lld)\n",
              total, diff_amx[1], diff_amx[2], diff_amx[16], diff_swap, diff_model_odd, diff_model_even, nan_outputs,
              denorm_results, single_total, emul_total, emul2_total);
}

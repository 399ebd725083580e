// Prototype (not tercet code): y = x W^T with TDPBF16PS reading pack_bf16_weight's panels in place as B
// tiles; 2 x 2 tiles of C (32 rows x 2 panels) per step; M a multiple of 16, K of 32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstring>

namespace {
struct alignas(64) Cfg { uint8_t palette = 1, start = 0; uint8_t pad[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
bool permitted() { static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0; return ok; }

template <int RB>  // row tiles per step (1 or 2)
void unit(const uint16_t* x, int64_t k, const uint16_t* pa, const uint16_t* pb, int64_t pairs, float* c) {
  _tile_zero(0); _tile_zero(1);
  if (RB == 2) { _tile_zero(2); _tile_zero(3); }
  for (int64_t i0 = 0; i0 < pairs; i0 += 16) {
    _tile_loadd(6, pa + i0 * 32, 64);
    _tile_loadd(7, pb + i0 * 32, 64);
    _tile_loadd(4, x + 2 * i0, k * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (RB == 2) {
      _tile_loadd(5, x + 16 * k + 2 * i0, k * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128);
  if (RB == 2) { _tile_stored(2, c + 16 * 32, 128); _tile_stored(3, c + 16 * 32 + 16, 128); }
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(permitted(), "no AMX permission");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(m % 16 == 0 && k % 32 == 0 && panels % 2 == 0 && n == panels * 16, "prototype shapes only");
  auto y = at::empty({m, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels / 2, 1, [&](int64_t begin, int64_t end) {
    Cfg cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    alignas(64) float c[32 * 32];
    for (int64_t u = begin; u < end; ++u) {
      const uint16_t* pa = w + (2 * u) * pairs * 32;
      const uint16_t* pb = pa + pairs * 32;
      for (int64_t r = 0; r < m; r += 32) {
        const int rows = m - r >= 32 ? 32 : 16;
        if (rows == 32) unit<2>(xp + r * k, k, pa, pb, pairs, c);
        else unit<1>(xp + r * k, k, pa, pb, pairs, c);
        for (int i = 0; i < rows; ++i)
          for (int h = 0; h < 2; ++h)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r + i) * n + u * 32 + h * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + i * 32 + h * 16)));
      }
    }
    _tile_release();
  });
  return y;
}
}  // namespace

TORCH_LIBRARY(amxproto, m) {
  m.def("amx_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.impl("amx_linear", c10::DispatchKey::CPU, TORCH_FN(amx_linear));
}

// The layout of GGUF block codes as pack_block_codes (gemm.cpp, fp32) and pack_bf16_block_codes
// (gemm_bf16.cpp) make it, checked the same way for both kernels: codes [panels, k or k / 2, 16]
// (int8 a code, or two 4-bit codes a byte) or, for the fp32 kernel, [panels, k / 8, 16] int32
// (octet_codes: eight 4-bit codes a lane; its panels, scales and offsets in pairs: gemm.cpp), scales and
// offsets [panels, k / 32, 16] in fp16 or fp32.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace block_codes {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kGroup = 32;  // k per block of codes (GGUF's Q4_1, Q4_0 and Q8_0 blocks)

struct Shape {
  int64_t panels;
  int64_t k;  // from the blocks: the codes may be nibbles
  bool nibbles;
  bool octets;  // int32 lanes of eight 4-bit codes (gemm.cpp's octet_codes)
};

// The shape of a packed weight; refuses one that `packer` did not make.
inline Shape check(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, const char* packer) {
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) > 0 && scales.size(2) == kPanel && scales.is_contiguous() &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                  offsets.sizes() == scales.sizes() && offsets.scalar_type() == scales.scalar_type() &&
                  offsets.is_contiguous(), "scales and offsets must come from ", packer);
  const int64_t panels = scales.size(0), k = scales.size(1) * kGroup;
  const bool nibbles = codes.dim() == 3 && codes.size(1) * 2 == k;
  const bool octets = codes.dim() == 3 && codes.size(1) * 8 == k && codes.scalar_type() == at::kInt;
  TORCH_CHECK(codes.dim() == 3 && codes.size(0) == panels && codes.size(2) == kPanel && codes.is_contiguous() &&
                  ((codes.size(1) == k && codes.scalar_type() == at::kChar) ||
                   (nibbles && (codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte)) || octets),
              "codes must come from ", packer);
  return {panels, k, nibbles, octets};
}

// P consecutive panels of packed codes from the first on: each one's codes, scales and offsets (a panel's
// strides: `code_bytes`, and `groups` blocks of kPanel scales). Panels past `count` repeat the first
// (computed, not stored): the kernels' register blocks keep their width at the end of a weight.
template <int P, typename S>
struct Panels {
  const uint8_t* q[P];
  const S* d[P];
  const S* m[P];

  Panels(const uint8_t* codes, const S* scales, const S* offsets, int64_t code_bytes, int64_t groups, int64_t count) {
    for (int p = 0; p < P; ++p) {
      const int64_t at = p < count ? p : 0;
      q[p] = codes + at * code_bytes;
      d[p] = scales + at * groups * kPanel, m[p] = offsets + at * groups * kPanel;
    }
  }
};

}  // namespace block_codes

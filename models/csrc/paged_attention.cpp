// Decode attention straight from the paged KV cache, on CPU.
//
// One query token per row attends to its own context through its page
// table: keys and values are read in place, once, with no gathered copy of
// the context (the torch path copies every layer's context per step).
// Work is split over (row, kv head) pairs; a pair's result is computed by
// the same code in the same order whatever else is in the batch, so a
// row's output does not depend on the batch.
//
// q [B, H, D], k_cache / v_cache [S, KVH, D], page_table [B, P] int32,
// context_lens [B] int32 -> out [B, H, D]. The H / KVH query heads of a
// group read their kv head together; scores, softmax and sums are fp32.
// With AVX-512 or AVX2 (vec.h) and D = 64, 128 or 256 a vector path runs,
// else a portable one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

struct Shape {
  int64_t heads, kv_heads, dim, max_pages, page_size;
  float scale;
};

inline int64_t slot_of(const int32_t* pages, int64_t t, int64_t page_size) {
  return static_cast<int64_t>(pages[t / page_size]) * page_size + t % page_size;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// The portable path: any head size, any instruction set.
template <typename T>
void attend_pair(const T* q, const T* k_cache, const T* v_cache, const int32_t* pages, int64_t len, T* out,
                 const Shape& s, int64_t h, std::vector<float>& scores) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim, stride = s.kv_heads * dim;
  std::vector<float> query(group * dim), acc(group * dim, 0.f), total(group, 0.f);
  for (int64_t i = 0; i < group * dim; ++i) query[i] = to_float(q[i]) * s.scale;
  scores.resize(group * len);
  for (int64_t t = 0; t < len; ++t) {
    const T* k = k_cache + slot_of(pages, t, s.page_size) * stride + h * dim;
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += query[g * dim + d] * to_float(k[d]);
      scores[g * len + t] = dot;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * len;
    const float top = *std::max_element(row, row + len);
    for (int64_t t = 0; t < len; ++t) {
      row[t] = std::exp(row[t] - top);
      total[g] += row[t];
    }
  }
  for (int64_t t = 0; t < len; ++t) {
    const T* v = v_cache + slot_of(pages, t, s.page_size) * stride + h * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t];
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * to_float(v[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<T>(acc[g * dim + d] / total[g]);
}

template <typename T>
using PairFn = void (*)(const T*, const T*, const T*, const int32_t*, int64_t, T*, const Shape&, int64_t,
                        std::vector<float>&);

#if TERCET_VEC
constexpr int kAhead = 16;  // keys prefetched ahead: the hardware misses the per-head stride
constexpr int L = vec::kLanes;

template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(bytes + off, _MM_HINT_T0);
}
// kv head h of token t's cache slot as C vectors of L floats; prefetches the slot kAhead on
template <typename T, int C>
inline void load_head(const T* cache, const int32_t* pages, int64_t t, int64_t len, const Shape& s, int64_t h,
                      vec::vf (&out)[C]) {
  const int64_t stride = s.kv_heads * C * L;
  const T* x = cache + slot_of(pages, t, s.page_size) * stride + h * C * L;
  if (t + kAhead < len) prefetch(cache + slot_of(pages, t + kAhead, s.page_size) * stride + h * C * L, C * L);
  for (int c = 0; c < C; ++c) out[c] = vec::load(x + c * L);
}

constexpr int kMaxGroup = 16;   // query heads per kv head

template <typename T, int C>
void attend_pair_vec(const T* q, const T* k_cache, const T* v_cache, const int32_t* pages, int64_t len,
                     T* out, const Shape& s, int64_t h, std::vector<float>& scores) {
  using namespace vec;
  const int64_t group = s.heads / s.kv_heads;
  const int64_t padded = (len + L - 1) / L * L;
  scores.resize(group * padded);
  vf query[kMaxGroup][C];
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) query[g][c] = mul(load(q + g * C * L + c * L), set1(s.scale));
  for (int64_t t = 0; t < len; ++t) {
    vf key[C];
    load_head<T, C>(k_cache, pages, t, len, s, h, key);
    for (int64_t g = 0; g < group; ++g) {
      vf dot = mul(query[g][0], key[0]);
      for (int c = 1; c < C; ++c) dot = fmadd(query[g][c], key[c], dot);
      scores[g * padded + t] = reduce_add(dot);
    }
  }
  float total[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * padded;
    std::fill(row + len, row + padded, -INFINITY);
    vf top = set1(-INFINITY);
    for (int64_t t = 0; t < padded; t += L) top = max(top, load(row + t));
    const vf m = set1(reduce_max(top));
    vf sum = zero();
    for (int64_t t = 0; t < padded; t += L) {
      const vf e = vec::exp(sub(load(row + t), m));
      store(row + t, e);
      sum = add(sum, e);
    }
    total[g] = reduce_add(sum);
  }
  vf acc[kMaxGroup][C];
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = zero();
  for (int64_t t = 0; t < len; ++t) {
    vf value[C];
    load_head<T, C>(v_cache, pages, t, len, s, h, value);
    for (int64_t g = 0; g < group; ++g) {
      const vf p = set1(scores[g * padded + t]);
      for (int c = 0; c < C; ++c) acc[g][c] = fmadd(p, value[c], acc[g][c]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const vf inv = set1(1.f / total[g]);
    for (int c = 0; c < C; ++c) store(out + g * C * L + c * L, mul(acc[g][c], inv));
  }
}

template <typename T>
PairFn<T> vector_path(int64_t dim, int64_t group) {
  if (group > kMaxGroup) return nullptr;
  switch (dim) {
    case 64: return attend_pair_vec<T, 64 / L>;
    case 128: return attend_pair_vec<T, 128 / L>;
    case 256: return attend_pair_vec<T, 256 / L>;
    default: return nullptr;
  }
}
#else
template <typename T>
PairFn<T> vector_path(int64_t, int64_t) { return nullptr; }
#endif

template <typename T>
void decode_rows(const T* q, const T* k_cache, const T* v_cache, const int32_t* page_table,
                 const int32_t* context_lens, T* out, int64_t batch, const Shape& s) {
  const int64_t group = s.heads / s.kv_heads;
  PairFn<T> pair = vector_path<T>(s.dim, group);
  if (pair == nullptr) pair = attend_pair<T>;
  at::parallel_for(0, batch * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / s.kv_heads, h = item % s.kv_heads;
      const int64_t offset = (b * s.heads + h * group) * s.dim;
      pair(q + offset, k_cache, v_cache, page_table + b * s.max_pages, context_lens[b], out + offset, s, h, scores);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& page_table, const at::Tensor& context_lens,
                                  int64_t page_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "q must be [B, H, D] and the caches [S, KVH, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "page_table and context_lens must be int32");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == q.size(0) && context_lens.numel() == q.size(0),
              "one page-table row and one length per query row");
  TORCH_CHECK(page_size >= 1, "page_size must be >= 1");
  const Shape s{q.size(1), k_cache.size(1), q.size(2), page_table.size(1), page_size, static_cast<float>(scale)};
  TORCH_CHECK(k_cache.size(2) == s.dim && s.kv_heads > 0 && s.heads % s.kv_heads == 0,
              "head sizes must match and the query heads be a multiple of the kv heads");
  const auto q_in = q.contiguous();
  const auto k_in = k_cache.contiguous();
  const auto v_in = v_cache.contiguous();
  const auto table = page_table.contiguous();
  const auto lens = context_lens.contiguous();
  const int32_t* len_of = lens.data_ptr<int32_t>();
  const int32_t* page_of = table.data_ptr<int32_t>();
  const int64_t num_pages = k_cache.size(0) / page_size;
  for (int64_t b = 0; b < q.size(0); ++b) {  // every page read must lie in the cache
    TORCH_CHECK(len_of[b] >= 1 && len_of[b] <= s.max_pages * page_size, "context length out of range");
    for (int64_t p = 0; p < (len_of[b] + page_size - 1) / page_size; ++p) {
      const int32_t page = page_of[b * s.max_pages + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "page ", page, " out of range");
    }
  }
  auto out = at::empty_like(q_in);
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    decode_rows<scalar_t>(q_in.data_ptr<scalar_t>(), k_in.data_ptr<scalar_t>(), v_in.data_ptr<scalar_t>(),
                          table.data_ptr<int32_t>(), len_of, out.data_ptr<scalar_t>(), q.size(0), s);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tercet, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
        "Tensor context_lens, int page_size, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}

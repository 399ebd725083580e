// Attention straight from the paged KV cache, on CPU: decode rows and prefill rows alike.
//
// Each query row attends to the first `lens[row]` keys of its sequence through the
// sequence's page table: keys and values are read in place, once, with no gathered copy
// of the context. A row's keys go in splits at fixed absolute positions (kSplit keys), each
// split reduced on its own and the splits folded in order, by the same code whatever the
// row is: a decode token, a token of a prefill chunk (its own K/V stored first), after a
// cached prefix or not. So a row's output depends only on its query, its position and its
// sequence's K/V -- not on the batch, the chunking, the prefix cache or the threads.
//
// q [T, H, D], k_cache / v_cache [S, KVH, D], page_table [B, P] int32 (one row per
// sequence), seq_of_row [T] int32, lens [T] int32 -> out [T, H, D]. The H / KVH query
// heads of a group read their kv head together; scores, softmax and sums are fp32. With
// AVX-512 or AVX2 (vec.h) and D = 64, 128 or 256 a vector path runs, else a portable one.
//
// Two options of some families' layers, both off at 0 (then not one instruction differs):
// `window` > 0 keeps a row to its last `window` keys (a sliding-window layer: keys
// [len - window, len)), the first split cut at that start -- still a function of the
// row's position alone; `softcap` > 0 caps each score s as softcap * tanh(s / softcap)
// (Gemma 2's attention logits) before the softmax.

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
  int64_t window;  // 0: every key
  float softcap;   // 0: no cap
};

inline float capped(float score, const Shape& s) {
  return s.softcap > 0.f ? s.softcap * std::tanh(score / s.softcap) : score;
}

// The first key a row of `len` keys attends
inline int64_t first_key(int64_t len, const Shape& s) {
  return s.window > 0 ? std::max<int64_t>(0, len - s.window) : 0;
}

inline int64_t slot_of(const int32_t* pages, int64_t t, int64_t page_size) {
  return static_cast<int64_t>(pages[t / page_size]) * page_size + t % page_size;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Keys per split: a query attends its keys in splits at fixed absolute positions
// [j * kSplit, (j + 1) * kSplit), each split reduced on its own, then the splits folded in
// order j = 0, 1, ... So a query's result depends only on its position and its sequence's
// K/V: not on whether it is a decode row or a row of a prefill chunk, how the chunk was cut,
// whether its prefix came from the cache, or which thread computed which split.
constexpr int64_t kSplit = 256;

// One split's partial result for the `group` query heads of a kv head: acc [group][dim]
// (the exp-weighted values, not yet divided), then max [group], then sum [group].
inline int64_t partial_size(int64_t group, int64_t dim) { return group * (dim + 2); }

// The portable split: any head size, any instruction set.
template <typename T>
void split_scalar(const T* q, const T* k_cache, const T* v_cache, const int32_t* pages, int64_t begin,
                  int64_t end, const Shape& s, int64_t h, float* scores, float* part) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim, stride = s.kv_heads * dim, n = end - begin;
  float* acc = part;
  float* top = part + group * dim;
  float* total = top + group;
  for (int64_t t = 0; t < n; ++t) {
    const T* k = k_cache + slot_of(pages, begin + t, s.page_size) * stride + h * dim;
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += to_float(q[g * dim + d]) * s.scale * to_float(k[d]);
      scores[g * kSplit + t] = capped(dot, s);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * kSplit;
    top[g] = *std::max_element(row, row + n);
    total[g] = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      row[t] = std::exp(row[t] - top[g]);
      total[g] += row[t];
    }
    std::fill(acc + g * dim, acc + (g + 1) * dim, 0.f);
  }
  for (int64_t t = 0; t < n; ++t) {
    const T* v = v_cache + slot_of(pages, begin + t, s.page_size) * stride + h * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * kSplit + t];
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * to_float(v[d]);
    }
  }
}

template <typename T>
using SplitFn = void (*)(const T*, const T*, const T*, const int32_t*, int64_t, int64_t, const Shape&, int64_t,
                         float*, float*);

#if TERCET_VEC
constexpr int kAhead = 16;  // keys prefetched ahead: the hardware misses the per-head stride
constexpr int L = vec::kLanes;

template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(bytes + off, _MM_HINT_T0);
}
// The cache slots of keys [begin, end) through the page table, counted without a division per key
inline void slots_of(const int32_t* pages, int64_t begin, int64_t end, int64_t page_size, int64_t* slots) {
  int64_t page = begin / page_size, offset = begin % page_size;
  for (int64_t t = 0; t < end - begin; ++t) {
    slots[t] = static_cast<int64_t>(pages[page]) * page_size + offset;
    if (++offset == page_size) offset = 0, ++page;
  }
}

// kv head h of the i-th key's slot as C vectors of L floats; prefetches the slot kAhead on (before `n`)
template <typename T, int C>
inline void load_head(const T* cache, const int64_t* slots, int64_t i, int64_t n, const Shape& s, int64_t h,
                      vec::vf (&out)[C]) {
  const int64_t stride = s.kv_heads * C * L;
  const T* x = cache + slots[i] * stride + h * C * L;
  if (i + kAhead < n) prefetch(cache + slots[i + kAhead] * stride + h * C * L, C * L);
  for (int c = 0; c < C; ++c) out[c] = vec::load(x + c * L);
}

constexpr int kMaxGroup = 16;   // query heads per kv head

// One split [begin, end) of keys for the query heads of kv head h: a score per key (one
// vector of products over d, then its lanes added), the split's max, exp and sum (lane j
// adding the keys at positions = j mod L: kSplit is a multiple of L), and the weighted
// values in key order.
template <typename T, int C>
void split_vec(const T* q, const T* k_cache, const T* v_cache, const int32_t* pages, int64_t begin, int64_t end,
               const Shape& s, int64_t h, float* scores, float* part) {
  using namespace vec;
  const int64_t group = s.heads / s.kv_heads, dim = C * L, n = end - begin;
  const int64_t padded = (n + L - 1) / L * L;
  int64_t slots[kSplit];
  slots_of(pages, begin, end, s.page_size, slots);
  vf query[kMaxGroup][C];
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) query[g][c] = mul(load(q + g * dim + c * L), set1(s.scale));
  for (int64_t i = 0; i < n; ++i) {
    vf key[C];
    load_head<T, C>(k_cache, slots, i, n, s, h, key);
    for (int64_t g = 0; g < group; ++g) {
      vf dot = mul(query[g][0], key[0]);
      for (int c = 1; c < C; ++c) dot = fmadd(query[g][c], key[c], dot);
      scores[g * kSplit + i] = capped(reduce_add(dot), s);
    }
  }
  float* top = part + group * dim;
  float* total = top + group;
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * kSplit;
    std::fill(row + n, row + padded, -INFINITY);
    vf best = set1(-INFINITY);
    for (int64_t t = 0; t < padded; t += L) best = max(best, load(row + t));
    top[g] = reduce_max(best);
    const vf m = set1(top[g]);
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
  for (int64_t i = 0; i < n; ++i) {
    vf value[C];
    load_head<T, C>(v_cache, slots, i, n, s, h, value);
    for (int64_t g = 0; g < group; ++g) {
      const vf p = set1(scores[g * kSplit + i]);
      for (int c = 0; c < C; ++c) acc[g][c] = fmadd(p, value[c], acc[g][c]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int c = 0; c < C; ++c) store(part + g * dim + c * L, acc[g][c]);
}

template <typename T>
SplitFn<T> vector_path(int64_t dim, int64_t group) {
  if (group > kMaxGroup) return nullptr;
  switch (dim) {
    case 64: return split_vec<T, 64 / L>;
    case 128: return split_vec<T, 128 / L>;
    case 256: return split_vec<T, 256 / L>;
    default: return nullptr;
  }
}
#else
template <typename T>
SplitFn<T> vector_path(int64_t, int64_t) { return nullptr; }
#endif

// The splits of one (row, kv head) folded in order: out = sum_j w_j acc_j / sum_j w_j sum_j,
// w_j = exp(max_j - max). With one split w_0 is exactly 1.
template <typename T>
void fold(const float* parts, int64_t splits, int64_t group, int64_t dim, T* out) {
  const int64_t size = partial_size(group, dim);
  std::vector<float> acc(static_cast<size_t>(dim));
  for (int64_t g = 0; g < group; ++g) {
    float top = -INFINITY;
    for (int64_t j = 0; j < splits; ++j) top = std::max(top, parts[j * size + group * dim + g]);
    float total = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < splits; ++j) {
      const float* part = parts + j * size;
      const float w = std::exp(part[group * dim + g] - top);
      total += part[group * dim + group + g] * w;
      for (int64_t d = 0; d < dim; ++d) acc[d] += w * part[g * dim + d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<T>(acc[d] * inv);
  }
}

inline int64_t splits_of(int64_t len) { return (len + kSplit - 1) / kSplit; }

// Every row: its query heads against its sequence's first `lens[row]` keys, through the
// sequence's page table. Work goes to threads by (row, kv head), or, when those are too few
// to keep the threads busy (a few long decode rows), by (row, kv head, split): the same
// splits and the same fold either way.
template <typename T>
void attend_rows(const T* q, const T* k_cache, const T* v_cache, const int32_t* page_table, const int32_t* seq_of,
                 const int32_t* lens, T* out, int64_t rows, const Shape& s) {
  const int64_t group = s.heads / s.kv_heads, size = partial_size(group, s.dim);
  SplitFn<T> split = vector_path<T>(s.dim, group);
  if (split == nullptr) split = split_scalar<T>;
  const auto query = [&](int64_t row, int64_t h) { return q + (row * s.heads + h * group) * s.dim; };
  const auto pages = [&](int64_t row) { return page_table + static_cast<int64_t>(seq_of[row]) * s.max_pages; };
  const int64_t items = rows * s.kv_heads;
  int64_t most = 0;
  for (int64_t r = 0; r < rows; ++r) most = std::max<int64_t>(most, splits_of(lens[r]));
  if (most <= 1 || items >= 2 * at::get_num_threads()) {
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(static_cast<size_t>(group * kSplit)), parts;
      for (int64_t item = begin; item < end; ++item) {
        // kv head-major: a thread's consecutive items share a head, so its keys stay in L2 across the
        // rows of a prefill chunk (row-major items cycle through every head's keys)
        const int64_t h = item / rows, row = item % rows, len = lens[row], n = splits_of(len);
        const int64_t start = first_key(len, s), j0 = start / kSplit;
        parts.resize(static_cast<size_t>(n * size));
        for (int64_t j = j0; j < n; ++j)
          split(query(row, h), k_cache, v_cache, pages(row), std::max(start, j * kSplit),
                std::min(len, (j + 1) * kSplit), s, h, scores.data(), parts.data() + j * size);
        fold<T>(parts.data() + j0 * size, n - j0, group, s.dim, out + (row * s.heads + h * group) * s.dim);
      }
    });
    return;
  }
  std::vector<float> parts(static_cast<size_t>(items * most * size));
  at::parallel_for(0, items * most, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group * kSplit));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t item = task / most, j = task % most, row = item / s.kv_heads, h = item % s.kv_heads;
      const int64_t len = lens[row], start = first_key(len, s);
      if (j * kSplit >= len || (j + 1) * kSplit <= start) continue;
      split(query(row, h), k_cache, v_cache, pages(row), std::max(start, j * kSplit), std::min(len, (j + 1) * kSplit),
            s, h, scores.data(), parts.data() + task * size);
    }
  });
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / s.kv_heads, h = item % s.kv_heads, j0 = first_key(lens[row], s) / kSplit;
      fold<T>(parts.data() + (item * most + j0) * size, splits_of(lens[row]) - j0, group, s.dim,
              out + (row * s.heads + h * group) * s.dim);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& page_table, const at::Tensor& seq_of_row, const at::Tensor& lens,
                           int64_t page_size, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "q must be [T, H, D] and the caches [S, KVH, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && seq_of_row.scalar_type() == at::kInt &&
                  lens.scalar_type() == at::kInt, "page_table, seq_of_row and lens must be int32");
  TORCH_CHECK(page_table.dim() == 2 && seq_of_row.numel() == q.size(0) && lens.numel() == q.size(0),
              "a page-table row per sequence, a sequence and a length per query row");
  TORCH_CHECK(page_size >= 1, "page_size must be >= 1");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: off)");
  const Shape s{q.size(1), k_cache.size(1), q.size(2), page_table.size(1), page_size, static_cast<float>(scale),
                window, static_cast<float>(softcap)};
  TORCH_CHECK(k_cache.size(2) == s.dim && s.kv_heads > 0 && s.heads % s.kv_heads == 0,
              "head sizes must match and the query heads be a multiple of the kv heads");
  const auto q_in = q.contiguous();
  const auto k_in = k_cache.contiguous();
  const auto v_in = v_cache.contiguous();
  const auto table = page_table.contiguous();
  const auto seqs = seq_of_row.contiguous();
  const auto len = lens.contiguous();
  const int32_t* len_of = len.data_ptr<int32_t>();
  const int32_t* seq_of = seqs.data_ptr<int32_t>();
  const int32_t* page_of = table.data_ptr<int32_t>();
  const int64_t num_pages = k_cache.size(0) / page_size, num_seqs = page_table.size(0);
  std::vector<int64_t> longest(static_cast<size_t>(num_seqs), 0);
  for (int64_t r = 0; r < q.size(0); ++r) {
    TORCH_CHECK(seq_of[r] >= 0 && seq_of[r] < num_seqs, "sequence ", seq_of[r], " out of range");
    TORCH_CHECK(len_of[r] >= 1 && len_of[r] <= s.max_pages * page_size, "context length out of range");
    longest[seq_of[r]] = std::max<int64_t>(longest[seq_of[r]], len_of[r]);
  }
  for (int64_t b = 0; b < num_seqs; ++b) {  // every page read must lie in the cache
    for (int64_t p = 0; p < (longest[b] + page_size - 1) / page_size; ++p) {
      const int32_t page = page_of[b * s.max_pages + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "page ", page, " out of range");
    }
  }
  auto out = at::empty_like(q_in);
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    attend_rows<scalar_t>(q_in.data_ptr<scalar_t>(), k_in.data_ptr<scalar_t>(), v_in.data_ptr<scalar_t>(), page_of,
                          seq_of, len_of, out.data_ptr<scalar_t>(), q.size(0), s);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(tercet, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seq_of_row, "
        "Tensor lens, int page_size, float scale, int window=0, float softcap=0.) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
}

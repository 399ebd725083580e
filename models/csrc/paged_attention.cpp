// Attention straight from the paged KV cache, on CPU: decode rows and prefill rows alike.
//
// Each query row attends to the first `lens[row]` keys of its sequence through the
// sequence's page table: no gathered copy of the context, the keys (then the values) read L
// at a time (16 with AVX-512) into a small float buffer that every row of a prefill chunk of
// that sequence uses while it is in L1. A row's keys go in splits at fixed absolute
// positions (kSplit keys), each split reduced on its own and the splits folded in order, by
// the same code whatever the row is: a decode token, a token of a prefill chunk (its own K/V
// stored first), after a cached prefix or not. So a row's output depends only on its query,
// its position and its sequence's K/V -- not on the batch, the chunking, the prefix cache or
// the threads.
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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "share.h"
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

// The portable split: any head size, any instruction set. One row's `n` keys and values, as floats.
inline void split_scalar(const float* q, const float* keys, const float* values, int64_t n, const Shape& s,
                         float* scores, float* part) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim;
  float* acc = part;
  float* top = part + group * dim;
  float* total = top + group;
  for (int64_t t = 0; t < n; ++t) {
    const float* k = keys + t * dim;
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += q[g * dim + d] * k[d];  // q: times the scale already
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
    const float* v = values + t * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * kSplit + t];
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * v[d];
    }
  }
}

// One row's share of a split: its query heads (group x dim floats, times the scale), its keys
// [first, end) of the split, and where its partial result goes
struct RowSpan {
  const float* q;
  int64_t first, end;
  float* part;
};

// One layer's cache as the splits read it: kv head h of key t at (slot of t) * kv_heads * dim + h * dim
template <typename T>
struct Cache {
  const T* k;
  const T* v;
  const int32_t* pages;  // the sequence's row of the page table
};

// A thread's buffers, kept from call to call (grown, never cleared: every float is written before it is read)
struct Buffer {
  std::unique_ptr<float[]> data;
  int64_t size = 0;
  float* at_least(int64_t n) {
    if (n > size) data.reset(new float[static_cast<size_t>(n)]), size = n;
    return data.get();
  }
};
struct Scratch {
  Buffer keys, values, scores, query, parts;
  std::vector<RowSpan> spans;
};
inline Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Scores kept per (row, query head) while a split is attended: 16 floats of slack before and after
// a row's kSplit, for the blocks of keys that start before its first key or end past its last
inline int64_t score_stride() { return kSplit + 2 * 16; }

// Rows [count] of one split of kv heads [h, h + nh) (spans [nh][count]: head h + i's are rows + i * count),
// every row's keys among [lo, hi): the portable path reads a head's keys and values once as floats (exact),
// then each row alone.
template <typename T>
void split_rows_scalar(const RowSpan* rows, int64_t count, int64_t nh, const Cache<T>& cache, int64_t h, int64_t lo,
                       int64_t hi, const Shape& s, Scratch& scratch) {
  const int64_t dim = s.dim, stride = s.kv_heads * dim;
  float* keys = scratch.keys.at_least(kSplit * dim);
  float* values = scratch.values.at_least(kSplit * dim);
  float* scores = scratch.scores.at_least(s.heads / s.kv_heads * kSplit);
  for (int64_t i = 0; i < nh; ++i) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t at = slot_of(cache.pages, t, s.page_size) * stride + (h + i) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        keys[(t - lo) * dim + d] = to_float(cache.k[at + d]);
        values[(t - lo) * dim + d] = to_float(cache.v[at + d]);
      }
    }
    for (int64_t r = 0; r < count; ++r) {
      const RowSpan& row = rows[i * count + r];
      const int64_t skip = (row.first - lo) * dim;
      split_scalar(row.q, keys + skip, values + skip, row.end - row.first, s, scores, row.part);
    }
  }
}

template <typename T>
using SplitFn = void (*)(const RowSpan*, int64_t, int64_t, const Cache<T>&, int64_t, int64_t, int64_t, const Shape&,
                         Scratch&);

#if TERCET_VEC
constexpr int L = vec::kLanes;

template <typename T, bool L2 = false>  // into L1, or (L2) into L2
inline void prefetch(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) {
    if constexpr (L2) _mm_prefetch(bytes + off, _MM_HINT_T1);
    else _mm_prefetch(bytes + off, _MM_HINT_T0);
  }
}
// The cache slots of keys [begin, end) through the page table, counted without a division per key
inline void slots_of(const int32_t* pages, int64_t begin, int64_t end, int64_t page_size, int64_t* slots) {
  int64_t page = begin / page_size, offset = begin % page_size;
  for (int64_t t = 0; t < end - begin; ++t) {
    slots[t] = static_cast<int64_t>(pages[page]) * page_size + offset;
    if (++offset == page_size) offset = 0, ++page;
  }
}

// m keys' (or values') head h as floats into block [L][C * L] (exact), from their slots
template <typename T, int C>
inline void stage(const T* cache, const int64_t* slots, int64_t m, const Shape& s, int64_t h,
                  float (&block)[L][C * L]) {
  const int64_t stride = s.kv_heads * C * L;
  for (int64_t i = 0; i < m; ++i) {
    const T* x = cache + slots[i] * stride + h * C * L;
    for (int c = 0; c < C; ++c) vec::store(block[i] + c * L, vec::load(x + c * L));
  }
}

// m keys' (or values') head h asked for into L1 (or L2)
template <typename T, int C, bool L2 = false>
inline void ask_for(const T* cache, const int64_t* slots, int64_t m, const Shape& s, int64_t h) {
  for (int64_t i = 0; i < m; ++i) prefetch<T, L2>(cache + (slots[i] * s.kv_heads + h) * C * L, C * L);
}
// Besides the next block, the block this many on into L2 (the same phase, keys or values): the next block's ask
// alone (into L1 then) came one block, ~130 cycles of work, ahead of ~300 of memory latency. One row, 2048 keys
// from memory, a call: one thread 428 -> 306 us, two 224-238 -> 177 (2 blocks on: 316 / 262; 8: 336 / 197); decode steps
// alternated: 1 row at 1800-2050 keys 1.18x, at 128-378 1.08x, 8 sequences 1.10x, prefill of 512 even (Zen 3 EPYC)
constexpr int64_t kFar = 4;
// The next block's ask into L2 as well with AVX-512: into L1 it left L1's few misses in flight bounding the stream
// (Zen 4 EPYC, decode steps alternated in one process: one row at 120-720 keys 1.03-1.06x, at 300-800 1.05x, at
// 1000-1300 1.10x, 8 rows 1.07x, 32 rows 1.06x; a prefill of 1024 even; without the next block's ask 0.98x). The
// AVX2 build measured even there, and its L1 ask was tuned on a Zen 3, so it keeps it.
constexpr bool kNextIntoL2 = L == 16;

constexpr int kMaxGroup = 16;  // query heads per kv head
// heads whose sums weigh_values keeps in registers at once (C vectors each, in 32 or 16 registers):
// enough chains of fmadds to hide their latency
template <int C>
constexpr int kHeadsAtOnce = std::max(1, std::min(6, (L == 16 ? 24 : 12) / C));

// acc[h] += the m values (values[i]: key i's) weighted by head h's weights, key after key, for H heads at
// once (their weights score_stride() apart, their sums C * L apart)
template <int C, int H>
inline void weigh_values(const float* weights, const float* const* values, int64_t m, float* part) {
  using namespace vec;
  vf acc[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = load(part + h * C * L + c * L);
  for (int64_t i = 0; i < m; ++i) {
    for (int h = 0; h < H; ++h) {
      const vf p = set1(weights[h * score_stride() + i]);
      for (int c = 0; c < C; ++c) acc[h][c] = fmadd(p, load(values[i] + c * L), acc[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) store(part + h * C * L + c * L, acc[h][c]);
}

// AVX2: the same sums for H heads at once, W of their C vectors at a time, each value's W vectors loaded once for
// the H heads (H * W sums, W values and a weight within 15 of the 16 registers): weigh_values at one head
// loaded every value again for each head, and its C chains of fmadds (one a key) stood at the FMA's latency.
// Each (head, vector) keeps its own chain in key order: weigh_values' bits. SmolLM2 (3 heads a kv head, 64
// dims), one row, alternated in one process (Zen 3 EPYC): the cache hot, one thread, 1.07-1.09x at 256-2048 keys;
// 30 layers' caches from memory, two threads, 1.01-1.06x. Other shapes (heads / kv heads / dims), hot, 512 keys:
// 24/8/128 1.10x, 12/2/128 1.12x, 14/2/64 1.06x, 32/8/64 1.09x, 8/4/256 1.20x.
template <int C, int H, int W>
inline void weigh_slice(const float* weights, const float* const* values, int64_t m, float* part, int c0) {
  using namespace vec;
  vf acc[H][W];
  for (int h = 0; h < H; ++h)
    for (int w = 0; w < W; ++w) acc[h][w] = load(part + h * C * L + (c0 + w) * L);
  for (int64_t i = 0; i < m; ++i) {
    vf v[W];
    for (int w = 0; w < W; ++w) v[w] = load(values[i] + (c0 + w) * L);
    for (int h = 0; h < H; ++h) {
      const vf p = set1(weights[h * score_stride() + i]);
      for (int w = 0; w < W; ++w) acc[h][w] = fmadd(p, v[w], acc[h][w]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int w = 0; w < W; ++w) store(part + h * C * L + (c0 + w) * L, acc[h][w]);
}
// A head's C vectors in slices of W (3 heads: 3, 2 heads: 4); a last slice of 1 (3 chains, at the FMA's latency) is
// taken with the one before it as two of (W + 1) / 2 (C = 16: 3, 3, 3, 3, 2, 2)
template <int C, int H>
inline void weigh_sliced(const float* weights, const float* const* values, int64_t m, float* part) {
  constexpr int W = std::min(C, 14 / (H + 1)), R = C % W, Full = R == 1 && C > W ? C / W - 1 : C / W;
  int c0 = 0;
  for (int i = 0; i < Full; ++i, c0 += W) weigh_slice<C, H, W>(weights, values, m, part, c0);
  if constexpr (R == 1 && C > W) {
    weigh_slice<C, H, (W + 1) / 2>(weights, values, m, part, c0);
    weigh_slice<C, H, W + 1 - (W + 1) / 2>(weights, values, m, part, c0 + (W + 1) / 2);
  } else if constexpr (R != 0) {
    weigh_slice<C, H, R>(weights, values, m, part, c0);
  }
}

// One split of kv heads [h, h + nh) for rows [count] of a sequence (spans [nh][count]: head h + i's are
// rows + i * count), every row's keys among [lo, hi), taken a block of L keys at a time: the block's
// keys read once as floats into L1 (exact; an fp32 cache is read in place, a copy being the same floats),
// a head at a time, then by every row; likewise its values.
// With all of a key's heads in one call (nh = kv_heads) a thread reads each slot whole, in order: the
// cache's lines as one stream, where a pass per head read every third 128 bytes. Per row and query head,
// as if the row were alone: a score per key (a vector of products over d, its lanes added in
// reduce_add's tree: reduce_lanes does L keys' at once, each with the same additions), the row's max,
// exp and sum over its n keys (lane j adding the keys at positions = j mod L: kSplit is a multiple of
// L), and the weighted values in key order. A key's score, a lane's sum and a value's chain of fmadds do
// not depend on how the keys were blocked, which heads or rows came along.
template <typename T, int C>
void split_vec(const RowSpan* rows, int64_t count, int64_t nh, const Cache<T>& cache, int64_t h, int64_t lo,
               int64_t hi, const Shape& s, Scratch& scratch) {
  using namespace vec;
  static_assert(L <= 16, "score_stride's slack");
  const int64_t group = s.heads / s.kv_heads, dim = C * L, stride = score_stride();
  float* scores = scratch.scores.at_least(nh * count * group * stride);
  // span k's (head i = k / count, row r = k % count) query head g's scores: the row's key `first + u` at u
  // (slack before 0 and after the row's keys)
  const auto scores_of = [&](int64_t k, int64_t g) { return scores + (k * group + g) * stride + L; };
  int64_t slots[kSplit];
  slots_of(cache.pages, lo, hi, s.page_size, slots);
  alignas(64) float block[L][C * L];
  const float* row_of[L];  // key j of the block: its floats (in block, or in a float cache itself)
  // The split's blocks in the order they are read: the keys' [0, blocks), then the values' [blocks, 2 blocks).
  // While a block's head h + i is staged, the next block's is asked for (the values' first after the keys' last;
  // asking 2 or 3 blocks ahead into L1 measured slower on a Zen 3 EPYC) and the one kFar on into L2 (kNextIntoL2).
  const int64_t blocks = (hi - lo + L - 1) / L;
  const auto staged = [&](bool values, int64_t t0, int64_t i) {  // head h + i's keys (or values) [t0, t0 + m)
    const int64_t m = std::min<int64_t>(L, hi - t0);              // at row_of; m
    const int64_t next = (values ? blocks : 0) + (t0 - lo) / L + 1;
    if (next < 2 * blocks) {
      const int64_t first = (next % blocks) * L;
      ask_for<T, C, kNextIntoL2>(next < blocks ? cache.k : cache.v, slots + first,
                                 std::min<int64_t>(L, hi - lo - first), s, h + i);
    }
    if (kFar > 0) {  // into L2 further ahead, within the same phase
      const int64_t far = (t0 - lo) / L + kFar;
      if (far < blocks)
        ask_for<T, C, true>(values ? cache.v : cache.k, slots + far * L, std::min<int64_t>(L, hi - lo - far * L), s, h + i);
    }
    const T* from = values ? cache.v : cache.k;
    if constexpr (std::is_same_v<T, float>) {  // read where they are (a copy would be the same floats)
      for (int64_t j = 0; j < m; ++j) row_of[j] = from + (slots[t0 - lo + j] * s.kv_heads + h + i) * C * L;
    } else {
      stage<T, C>(from, slots + (t0 - lo), m, s, h + i, block);
      for (int64_t j = 0; j < m; ++j) row_of[j] = block[j];
    }
    return m;
  };
  for (int64_t t0 = lo; t0 < hi; t0 += L) {
    for (int64_t i = 0; i < nh; ++i) {
      const int64_t m = staged(false, t0, i);
      const auto dot = [&](const vf (&q_g)[C], int64_t j) {
        vf d = mul(q_g[0], load(row_of[j]));
        for (int c = 1; c < C; ++c) d = fmadd(q_g[c], load(row_of[j] + c * L), d);
        return d;
      };
      for (int64_t k = i * count; k < (i + 1) * count; ++k) {
        const RowSpan& row = rows[k];
        if (t0 + L <= row.first || t0 >= row.end) continue;  // none of the row's keys
        for (int64_t g = 0; g < group; ++g) {
          vf q_g[C];
          for (int c = 0; c < C; ++c) q_g[c] = load(row.q + g * dim + c * L);
          vf dots[L];
          if (m == L) {
#pragma GCC unroll 16
            for (int j = 0; j < L; ++j) dots[j] = dot(q_g, j);
          } else {  // past the split's keys: zeros (past the row's keys, scores are set to -inf below)
            for (int j = 0; j < L; ++j) dots[j] = j < m ? dot(q_g, j) : zero();
          }
          store(scores_of(k, g) + (t0 - row.first), reduce_lanes(dots));
        }
      }
    }
  }
  for (int64_t k = 0; k < nh * count; ++k) {
    const int64_t n = rows[k].end - rows[k].first, padded = (n + L - 1) / L * L;
    float* top = rows[k].part + group * dim;
    float* total = top + group;
    for (int64_t g = 0; g < group; ++g) {
      float* row = scores_of(k, g);
      if (s.softcap > 0.f)
        for (int64_t t = 0; t < n; ++t) row[t] = capped(row[t], s);
      std::fill(row + n, row + padded, -INFINITY);
      vf best = set1(-INFINITY);
      for (int64_t t = 0; t < padded; t += L) best = max(best, load(row + t));
      top[g] = reduce_max(best);
      const vf mx = set1(top[g]);
      vf sum = zero();
      for (int64_t t = 0; t < padded; t += L) {
        const vf e = vec::exp(sub(load(row + t), mx));
        store(row + t, e);
        sum = add(sum, e);
      }
      total[g] = reduce_add(sum);
      for (int c = 0; c < C; ++c) store(rows[k].part + g * dim + c * L, zero());
    }
  }
  for (int64_t t0 = lo; t0 < hi; t0 += L) {
    for (int64_t i = 0; i < nh; ++i) {
      const int64_t m = staged(true, t0, i);
      for (int64_t k = i * count; k < (i + 1) * count; ++k) {
        const RowSpan& row = rows[k];
        const int64_t a = std::max(t0, row.first), b = std::min(t0 + m, row.end);
        if (a >= b) continue;
        for (int64_t g = 0; g < group;) {  // the heads' sums in registers over the block, a few heads at a time
          const float* weights = scores_of(k, g) + (a - row.first);
          const float* const* from = row_of + (a - t0);
          float* sums = row.part + g * dim;
          if constexpr (L == 8) {
            if (group - g > 1) {  // (AVX2: heads in threes, or a last pair)
              const int64_t heads = std::min<int64_t>(group - g, 3);
              if (heads == 3) weigh_sliced<C, 3>(weights, from, b - a, sums);
              else weigh_sliced<C, 2>(weights, from, b - a, sums);
              g += heads;
              continue;
            }
          }
          const int64_t heads = std::min<int64_t>(group - g, kHeadsAtOnce<C>);
          switch (heads) {
            case 1: weigh_values<C, 1>(weights, from, b - a, sums); break;
            case 2: weigh_values<C, 2>(weights, from, b - a, sums); break;
            case 3: weigh_values<C, 3>(weights, from, b - a, sums); break;
            case 4: weigh_values<C, 4>(weights, from, b - a, sums); break;
            case 5: weigh_values<C, 5>(weights, from, b - a, sums); break;
            default: weigh_values<C, 6>(weights, from, b - a, sums); break;
          }
          g += heads;
        }
      }
    }
  }
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

// Rows of one sequence next to each other (a prefill chunk's) go through each split together: its
// keys and values staged once for up to kBlockRows rows.
constexpr int64_t kBlockRows = 16;
// Up to this many keys read in all (times the kv heads) a call runs on one thread: a parallel region's start
// and the second thread's share cost more there (SmolLM2's 3 kv heads, one row, 2 threads on a Zen 3 EPYC,
// a call: 16 keys 13.1 -> 7.0 us, 64 keys 22.7 -> 12.2, 256 keys 49.6 -> 33.9; decode steps of 1 and 5 rows
// 1.02x, alternated). Which thread attends a split does not change its bits.
constexpr int64_t kSerialWork = 1024;
// (row, kv head) folds a thread takes at least: a fold is a few hundred floats
constexpr int64_t kFoldGrain = 64;

// Every row: its query heads against its sequence's first `lens[row]` keys, through the
// sequence's page table. Work goes to threads by (block of rows, kv head), the costliest first and
// each thread taking the next when it is done; or, when those are too few to keep the threads busy
// (a few long decode rows), by (row, kv head, split): the same splits and the same fold either way.
template <typename T>
void attend_rows(const T* q, const T* k_cache, const T* v_cache, const int32_t* page_table, const int32_t* seq_of,
                 const int32_t* lens, T* out, int64_t rows, const Shape& s) {
  const int64_t group = s.heads / s.kv_heads, dim = s.dim, size = partial_size(group, dim);
  SplitFn<T> split = vector_path<T>(dim, group);
  if (split == nullptr) split = split_rows_scalar<T>;
  const auto cache_of = [&](int64_t row) {
    return Cache<T>{k_cache, v_cache, page_table + static_cast<int64_t>(seq_of[row]) * s.max_pages};
  };
  // a row's query heads of kv head h, as floats times the scale (what the split multiplies by)
  const auto scaled = [&](int64_t row, int64_t h, float* to) {
    const T* from = q + (row * s.heads + h * group) * dim;
    for (int64_t i = 0; i < group * dim; ++i) to[i] = to_float(from[i]) * s.scale;
  };
  // keys [first, end) of split j for a row of `len` keys
  const auto range = [&](int64_t len, int64_t j) {
    return std::pair<int64_t, int64_t>{std::max(first_key(len, s), j * kSplit), std::min(len, (j + 1) * kSplit)};
  };
  int64_t most = 0;
  for (int64_t r = 0; r < rows; ++r) most = std::max<int64_t>(most, splits_of(lens[r]));
  std::vector<int64_t> blocks{0};  // row where each block starts, then rows
  for (int64_t r = 1; r < rows; ++r)
    if (seq_of[r] != seq_of[r - 1] || r - blocks.back() == kBlockRows) blocks.push_back(r);
  blocks.push_back(rows);
  const int64_t num_blocks = static_cast<int64_t>(blocks.size()) - 1;
  int64_t work = 0;  // keys read, times the kv heads
  for (int64_t r = 0; r < rows; ++r) work += (lens[r] - first_key(lens[r], s)) * s.kv_heads;
  const tercet::Team* team = tercet::Team::current();  // (a decode step's, share.h: its threads)
  const int64_t threads = work <= kSerialWork ? 1 : team != nullptr ? team->threads() : at::get_num_threads();
  if (most <= 1 || rows * s.kv_heads >= 2 * threads) {
    // An item is a block and all its kv heads, where there are blocks enough to share out (a key's heads
    // lie side by side in the cache: one thread then reads its slots whole, in order; by head, the
    // memory traffic of a 64-row decode step was 11 % slower), else a block and one kv head
    const int64_t heads_per_item = num_blocks >= 4 * threads ? s.kv_heads : 1;
    const int64_t items = num_blocks * (s.kv_heads / heads_per_item);
    std::vector<int64_t> order(static_cast<size_t>(items)), cost(static_cast<size_t>(num_blocks), 0);
    for (int64_t b = 0; b < num_blocks; ++b)
      for (int64_t r = blocks[b]; r < blocks[b + 1]; ++r) cost[b] += lens[r] - first_key(lens[r], s);
    for (int64_t i = 0; i < items; ++i) order[i] = i;
    const int64_t per_block = items / num_blocks;
    // costliest first; a block's items next to each other among equals
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return cost[a / per_block] > cost[b / per_block]; });
    std::atomic<int64_t> next{0};
    tercet::parallel(threads, 1, [&](int64_t, int64_t) {
      Scratch& scratch = thread_scratch();
      // an item's rows' scaled queries and partial results, head after head: [heads_per_item][block's rows]
      float* query = scratch.query.at_least(heads_per_item * kBlockRows * group * dim);
      float* parts = scratch.parts.at_least(heads_per_item * kBlockRows * most * size);
      std::vector<RowSpan>& spans = scratch.spans;
      spans.resize(std::max(spans.size(), static_cast<size_t>(heads_per_item * kBlockRows)));
      for (int64_t i = next++; i < items; i = next++) {
        const int64_t b = order[i] / per_block, r0 = blocks[b], r1 = blocks[b + 1], n = r1 - r0;
        const int64_t h0 = heads_per_item == 1 ? order[i] % s.kv_heads : 0, nh = heads_per_item;
        const auto slot = [&](int64_t hh, int64_t r) { return hh * n + (r - r0); };  // (head, row)'s buffers
        int64_t j0 = most, j1 = 0;  // the splits the block's rows read, whatever the head
        for (int64_t r = r0; r < r1; ++r)
          j0 = std::min(j0, first_key(lens[r], s) / kSplit), j1 = std::max(j1, splits_of(lens[r]));
        for (int64_t hh = 0; hh < nh; ++hh)
          for (int64_t r = r0; r < r1; ++r) scaled(r, h0 + hh, query + slot(hh, r) * group * dim);
        for (int64_t j = j0; j < j1; ++j) {
          int64_t lo = (j + 1) * kSplit, hi = j * kSplit, count = 0;  // the keys the block's rows read in split j
          int64_t reading[kBlockRows];
          for (int64_t r = r0; r < r1; ++r) {
            const auto [first, end] = range(lens[r], j);
            if (first >= end) continue;
            lo = std::min(lo, first), hi = std::max(hi, end);
            reading[count++] = r;
          }
          for (int64_t hh = 0; hh < nh; ++hh)
            for (int64_t c = 0; c < count; ++c) {
              const int64_t r = reading[c];
              const auto [first, end] = range(lens[r], j);
              spans[hh * count + c] = {query + slot(hh, r) * group * dim, first, end,
                                       parts + (slot(hh, r) * most + j) * size};
            }
          if (count > 0) split(spans.data(), count, nh, cache_of(r0), h0, lo, hi, s, scratch);
        }
        for (int64_t hh = 0; hh < nh; ++hh)
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t first = first_key(lens[r], s) / kSplit;
            fold<T>(parts + (slot(hh, r) * most + first) * size, splits_of(lens[r]) - first, group, dim,
                    out + (r * s.heads + (h0 + hh) * group) * dim);
          }
      }
    });
    return;
  }
  const int64_t tasks = rows * s.kv_heads * most;
  std::vector<float> parts(static_cast<size_t>(tasks * size));
  // the tasks the threads take in turn, the most keys first (a row's last split is short: static halves of
  // one row's 3 kv heads x 2 splits gave one thread 586 keys and the other 404)
  std::vector<int64_t> order, keys(static_cast<size_t>(tasks));
  for (int64_t task = 0; task < tasks; ++task) {
    const auto [first, last] = range(lens[task / most / s.kv_heads], task % most);
    keys[task] = last - first;
    if (first < last) order.push_back(task);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys[a] > keys[b]; });
  const int64_t count = static_cast<int64_t>(order.size());
  std::atomic<int64_t> next{0};
  tercet::parallel(std::min(threads, count), 1, [&](int64_t, int64_t) {
    Scratch& scratch = thread_scratch();
    float* query = scratch.query.at_least(group * dim);
    for (int64_t i = next++; i < count; i = next++) {
      const int64_t task = order[i], item = task / most, j = task % most;
      const int64_t row = item / s.kv_heads, h = item % s.kv_heads;
      const auto [first, last] = range(lens[row], j);
      scaled(row, h, query);
      const RowSpan span{query, first, last, parts.data() + task * size};
      split(&span, 1, 1, cache_of(row), h, first, last, s, scratch);
    }
  });
  tercet::parallel(rows * s.kv_heads, kFoldGrain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / s.kv_heads, h = item % s.kv_heads, j0 = first_key(lens[row], s) / kSplit;
      fold<T>(parts.data() + (item * most + j0) * size, splits_of(lens[row]) - j0, group, dim,
              out + (row * s.heads + h * group) * dim);
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

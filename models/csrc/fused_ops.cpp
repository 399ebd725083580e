// Fused elementwise steps of a decoder layer, on CPU (vector paths from vec.h: AVX-512 or AVX2): one pass over the
// rows where eager torch takes 5-10 ops (each a dispatch and a trip
// through memory). Each keeps the roundings of the eager ops it replaces
// (model-dtype results of fp32 math), so results match them closely.
//
//   add_rms_norm_(x, delta, weight, eps) -> h:  x += delta (in place); h = weight * rms_norm(x)
//   silu_mul(gate_up) -> silu(gate) * up, gate_up = [gate | up] per row
//   rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads) -> (q, k):
//       rotates q and k (rotate-half), writes k and v into the cache rows `slots`
//   argmax_logsumexp(logits) -> (first index of each row's max, its fp32 logsumexp: NaN where the row holds a NaN),
//       rows of fp32, bf16 or fp16
//
// Rows are independent: a row's result does not depend on the batch.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>


#include <cmath>
#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "share.h"
#include "vec.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }  // round to nearest even, as torch

// model dtype round trip: what an eager op's model-dtype result holds
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }

constexpr int64_t kGrain = 1 << 15;  // elements per thread before a second one helps

template <typename F>
void over_rows(int64_t rows, int64_t width, const F& f) {
  tercet::parallel(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(width, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) f(r);
  });
}

#if TERCET_VEC
constexpr int L = vec::kLanes;

// one head of rope, D = L * C with C even: rotated[c] = -x[c + C/2] for c < C/2, else x[c - C/2]
template <typename T, int C>
inline void rope_head_vec(const T* x, const T* cos, const T* sin, T* out) {
  vec::vf v[C];
  for (int c = 0; c < C; ++c) v[c] = vec::load(x + L * c);
  const vec::vf zero = vec::zero();
  for (int c = 0; c < C; ++c) {
    const vec::vf rotated = c < C / 2 ? vec::sub(zero, v[c + C / 2]) : v[c - C / 2];
    const vec::vf a = vec::round_to<T>(vec::mul(v[c], vec::load(cos + L * c)));
    const vec::vf b = vec::round_to<T>(vec::mul(rotated, vec::load(sin + L * c)));
    vec::store(out + L * c, vec::add(a, b));
  }
}
#endif

template <typename T>
void add_rms_norm_rows(T* x, const T* delta, const T* weight, T* h, int64_t rows, int64_t n, float eps) {
  over_rows(rows, n, [&](int64_t r) {
    T* xr = x + r * n;
    const T* dr = delta + r * n;
    T* hr = h + r * n;
#if TERCET_VEC
    if (n % L == 0) {
      vec::vf sum = vec::zero();
      for (int64_t i = 0; i < n; i += L) {
        const vec::vf v = vec::round_to<T>(vec::add(vec::load(xr + i), vec::load(dr + i)));
        vec::store(xr + i, v);
        sum = vec::fmadd(v, v, sum);
      }
      const vec::vf inv = vec::set1(1.f / std::sqrt(vec::reduce_add(sum) / static_cast<float>(n) + eps));
      for (int64_t i = 0; i < n; i += L) {
        vec::store(hr + i, vec::mul(vec::load(weight + i), vec::round_to<T>(vec::mul(vec::load(xr + i), inv))));
      }
      return;
    }
#endif
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      const float v = round_to<T>(to_float(xr[i]) + to_float(dr[i]));
      xr[i] = from_float<T>(v);
      sum += v * v;
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) {
      hr[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(xr[i]) * inv));
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  over_rows(rows, n, [&](int64_t r) {
    const T* g = gate_up + r * 2 * n;
    const T* u = g + n;
    T* o = out + r * n;
#if TERCET_VEC
    if (n % L == 0) {
      const vec::vf one = vec::set1(1.f);
      for (int64_t i = 0; i < n; i += L) {
        const vec::vf a = vec::load(g + i);
        const vec::vf silu = vec::div(a, vec::add(one, vec::exp(vec::sub(vec::zero(), a))));
        vec::store(o + i, vec::mul(vec::round_to<T>(silu), vec::load(u + i)));
      }
      return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) {
      const float a = to_float(g[i]);
      o[i] = from_float<T>(round_to<T>(a / (1.f + std::exp(-a))) * to_float(u[i]));
    }
  });
}

template <typename T>
void rope_store_rows(const T* qkv, const T* cos, const T* sin, T* k_cache, T* v_cache, const int64_t* slots,
                     T* q_out, T* k_out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
  over_rows(rows, width, [&](int64_t r) {
    const T* row = qkv + r * width;
    const T* c = cos + r * dim;
    const T* s = sin + r * dim;
    const int64_t slot = slots[r];
    for (int64_t head = 0; head < heads + kv_heads; ++head) {
      const T* x = row + head * dim;
      T* o = head < heads ? q_out + (r * heads + head) * dim : k_out + (r * kv_heads + head - heads) * dim;
#if TERCET_VEC
      if (dim == 64 || dim == 128) {
        dim == 64 ? rope_head_vec<T, 64 / L>(x, c, s, o) : rope_head_vec<T, 128 / L>(x, c, s, o);
        if (head >= heads) std::copy(o, o + dim, k_cache + (slot * kv_heads + head - heads) * dim);
        continue;
      }
#endif
      for (int64_t i = 0; i < dim; ++i) {
        const float rotated = i < half ? -to_float(x[i + half]) : to_float(x[i - half]);
        o[i] = from_float<T>(round_to<T>(to_float(x[i]) * to_float(c[i])) + round_to<T>(rotated * to_float(s[i])));
      }
      if (head >= heads) std::copy(o, o + dim, k_cache + (slot * kv_heads + head - heads) * dim);
    }
    const T* v = row + (heads + kv_heads) * dim;
    T* vo = v_cache + slot * kv_heads * dim;
    for (int64_t i = 0; i < kv_heads * dim; ++i) vo[i] = v[i];
  });
}

template <typename F>
void dispatch(const at::Tensor& t, const char* name, const F& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": float32, bfloat16 or float16, not ", t.scalar_type());
  }
}

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous CPU tensor");
}

// per row of logits (fp32, or bf16 / fp16 read as the floats they are): the first index of its maximum, and
// log(sum(exp(x))) (max-shifted)
template <typename T>
void row_argmax_lse(const T* x, int64_t* index, float* lse, int64_t rows, int64_t n) {
  tercet::parallel(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * n;
      float top = -INFINITY;
      int64_t at = 0;
      int64_t i = 0;
      bool nan = false;  // (the max skips a NaN, and the exp below need not give one back)
#if TERCET_VEC
      if (n >= L) {
        vec::vf best = vec::set1(-INFINITY);
        vec::vi where = vec::lane_index(), lane = vec::lane_index();
        vec::vm seen = vec::unordered(vec::zero());
        for (; i + L <= n; i += L) {
          const vec::vf v = vec::load(row + i);
          const vec::vm more = vec::greater(v, best);  // strictly: a lane keeps its first maximum
          best = vec::select(more, best, v);
          where = vec::select(more, where, lane);
          lane = vec::add_int(lane, L);
          seen = vec::either(seen, vec::unordered(v));
        }
        nan = vec::any(seen);
        float lane_best[L];
        int32_t lane_at[L];
        vec::store(lane_best, best);
        vec::store(lane_at, where);
        for (int j = 0; j < L; ++j) {  // the first of the lanes' first maxima
          if (lane_best[j] > top || (lane_best[j] == top && lane_at[j] < at)) top = lane_best[j], at = lane_at[j];
        }
        if (top == -INFINITY) at = 0;
      }
#endif
      for (; i < n; ++i) {
        const float v = to_float(row[i]);
        if (v > top) top = v, at = i;
        nan = nan || std::isnan(v);
      }
      index[r] = at;
      float sum = 0.f;
      i = 0;
#if TERCET_VEC
      const vec::vf m = vec::set1(top);
      vec::vf lanes = vec::zero();
      for (; i + L <= n; i += L) lanes = vec::add(lanes, vec::exp(vec::sub(vec::load(row + i), m)));
      sum = vec::reduce_add(lanes);
#endif
      for (; i < n; ++i) sum += std::exp(to_float(row[i]) - top);
      lse[r] = nan ? NAN : top + std::log(sum);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [B, V]");
  auto index = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  auto lse = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  dispatch(logits, "argmax_logsumexp", [&](auto tag) {
    using T = decltype(tag);
    row_argmax_lse<T>(logits.template data_ptr<T>(), index.data_ptr<int64_t>(), lse.data_ptr<float>(),
                      logits.size(0), logits.size(1));
  });
  return {index, lse};
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  check_cpu(delta, "delta");
  check_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && delta.sizes() == x.sizes() && weight.numel() == x.size(1), "x, delta [T, N], weight [N]");
  TORCH_CHECK(delta.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "one dtype");
  auto h = at::empty_like(x);
  dispatch(x, "add_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_rows<T>(x.template data_ptr<T>(), delta.template data_ptr<T>(), weight.template data_ptr<T>(), h.template data_ptr<T>(), x.size(0),
                         x.size(1), static_cast<float>(eps));
  });
  return h;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2 * N]");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch(gate_up, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(gate_up.template data_ptr<T>(), out.template data_ptr<T>(), gate_up.size(0), out.size(1));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slots, int64_t heads, int64_t kv_heads) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&qkv, &cos, &sin, &k_cache, &v_cache, &slots}) check_cpu(*t, "rope_store's tensors");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == kv_heads && v_cache.sizes() == k_cache.sizes(),
              "caches must be [S, kv_heads, D]");
  const int64_t rows = qkv.size(0), dim = k_cache.size(2);
  TORCH_CHECK(dim % 2 == 0 && qkv.numel() == rows * (heads + 2 * kv_heads) * dim, "qkv must be [T, heads + 2 kv_heads, D]");
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim, "cos and sin must be [T, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == rows, "one int64 slot per row");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "rope_store's tensors must share a dtype");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slot[r] >= 0 && slot[r] < k_cache.size(0), "slot out of range");
  auto q = at::empty({rows, heads, dim}, qkv.options());
  auto k = at::empty({rows, kv_heads, dim}, qkv.options());
  dispatch(qkv, "rope_store", [&](auto tag) {
    using T = decltype(tag);
    rope_store_rows<T>(qkv.template data_ptr<T>(), cos.template data_ptr<T>(), sin.template data_ptr<T>(), k_cache.template data_ptr<T>(),
                       v_cache.template data_ptr<T>(), slot, q.template data_ptr<T>(), k.template data_ptr<T>(), rows, heads, kv_heads, dim);
  });
  return {q, k};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tercet, m) {
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_logsumexp(Tensor logits) -> (Tensor, Tensor)");
  m.impl("argmax_logsumexp", c10::DispatchKey::CPU, TORCH_FN(argmax_logsumexp));
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "int heads, int kv_heads) -> (Tensor, Tensor)");
  m.impl("add_rms_norm_", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm_));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("rope_store", c10::DispatchKey::CPU, TORCH_FN(rope_store));
}

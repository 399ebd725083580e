// A Llama-layout decoder's layers in one call: what layers.CausalLM._fused_forward does from Python,
// the same ops in the same order with the same arguments (so the same bits), called from here.
//
// Why: at one row a layer is ~10 kernel calls of a few microseconds of work each; from Python each
// call costs ~5 us of interpreter, argument parsing and dispatch, ~1.5-2 ms a token on a 30-layer
// model, a fifth of a decode step. Here each costs a dispatcher lookup already made (the typed
// handles below) and the kernel's own allocation.
//
// In the int8 mode steps of up to 16 rows (`set_team`) run inside one parallel region, a team (share.h):
// the products' chunks go to its threads without a region each, and while the main thread runs the small ops
// a helper reads the next products' weights into the caches (a one-row step is bound by reading them).
//
// The projections are held as the Python classes keep them (models/projections.py), one `kind` each:
//   0 fp32 panels (packed_linear), 1 fp32 block codes (block_linear),
//   2 bf16 panels (bf16_linear), 3 bf16 block codes (bf16_block_linear), with their bf16 panels
//   beside them for products of more than `code_rows` rows (-1: every product from the codes),
//   4 block codes with int8 activations (i8_block_linear, gemm_i8.cpp: the opt-in int8 mode).
// Four a layer in this order: qkv, o, gate_up, down.
//
//   Decoder(heads, kv_heads, head_dim, eps, scale)
//   .add_layer(post_norm, after_norm, window)   after_norm: the next layer's input norm, or the final norm
//   .add_projection(kind, n, code_rows, tensors, bias?)
//   .set_team(rows, read_ahead)   steps of up to `rows` rows as one team (0: none; default 16 where a projection
//                                 is of kind 4, else 0), the helper reading `read_ahead` bytes ahead (default 2 MB)
//   decoder_forward(decoder, x, h, cos, sin, k_cache, v_cache, slots, page_table, row_seq, row_lens, page_size) -> h
//     x: the residual stream [T, hidden] (updated in place), h: the first layer's normed input;
//     returns the hidden states after the final norm. k_cache / v_cache: every layer's [L, S, KVH, D].

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "share.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

enum Kind : int64_t { kPanels = 0, kCodes = 1, kBf16Panels = 2, kBf16Codes = 3, kInt8Codes = 4 };

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The kernels' own C++ signatures (the typed handles must match them exactly)
using Linear = Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&);
using CodeLinear = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, const OptTensor&);
using AddRmsNorm = Tensor(Tensor&, const Tensor&, const Tensor&, double);
using SiluMul = Tensor(const Tensor&);
using RopeStore = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&,
                                             const Tensor&, int64_t, int64_t);
using PagedAttention = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              int64_t, double, int64_t, double);

struct Ops {
  c10::TypedOperatorHandle<Linear> packed_linear = op<Linear>("tercet::packed_linear");
  c10::TypedOperatorHandle<CodeLinear> block_linear = op<CodeLinear>("tercet::block_linear");
  c10::TypedOperatorHandle<Linear> bf16_linear = op<Linear>("tercet::bf16_linear");
  c10::TypedOperatorHandle<CodeLinear> bf16_block_linear = op<CodeLinear>("tercet::bf16_block_linear");
  c10::TypedOperatorHandle<Linear> bf16_linear_silu = op<Linear>("tercet::bf16_linear_silu");
  c10::TypedOperatorHandle<CodeLinear> bf16_block_linear_silu = op<CodeLinear>("tercet::bf16_block_linear_silu");
  c10::TypedOperatorHandle<CodeLinear> i8_block_linear = op<CodeLinear>("tercet::i8_block_linear");
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm = op<AddRmsNorm>("tercet::add_rms_norm_");
  c10::TypedOperatorHandle<SiluMul> silu_mul = op<SiluMul>("tercet::silu_mul");
  c10::TypedOperatorHandle<RopeStore> rope_store = op<RopeStore>("tercet::rope_store");
  c10::TypedOperatorHandle<PagedAttention> paged_attention = op<PagedAttention>("tercet::paged_attention");
};

const Ops& ops() {
  static const Ops handles;  // (every op of the library is registered once it is loaded)
  return handles;
}

struct Projection {
  int64_t kind, n, code_rows;
  std::vector<Tensor> t;  // panels | codes, scales, offsets [, bf16 panels]
  OptTensor bias;

  Tensor operator()(const Tensor& x) const {
    const Ops& o = ops();
    switch (kind) {
      case kPanels: return o.packed_linear.call(x, t[0], n, bias);
      case kCodes: return o.block_linear.call(x, t[0], t[1], t[2], n, bias);
      case kBf16Panels: return o.bf16_linear.call(x, t[0], n, bias);
      case kInt8Codes: return o.i8_block_linear.call(x, t[0], t[1], t[2], n, bias);
      default:  // kBf16Codes (checked in add_projection)
        if (code_rows >= 0 && x.size(0) > code_rows) return o.bf16_linear.call(x, t[3], n, bias);
        return o.bf16_block_linear.call(x, t[0], t[1], t[2], n, bias);
    }
  }

  // silu_mul(this(x)) for gate_up ([gate | up] per row): in bf16 with whole panels of each, one op that
  // multiplies both halves' panels of the same columns together and never stores gate_up (the same bits)
  Tensor silu(const Tensor& x) const {
    const Ops& o = ops();
    if ((kind == kBf16Panels || kind == kBf16Codes) && n % 32 == 0) {
      if (kind == kBf16Panels) return o.bf16_linear_silu.call(x, t[0], n, bias);
      if (code_rows >= 0 && x.size(0) > code_rows) return o.bf16_linear_silu.call(x, t[3], n, bias);
      return o.bf16_block_linear_silu.call(x, t[0], t[1], t[2], n, bias);
    }
    return o.silu_mul.call((*this)(x));
  }
};

struct Layer {
  Tensor post_norm, after_norm;
  int64_t window;
};

class Decoder : public torch::CustomClassHolder {
 public:
  Decoder(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && head_dim > 0 && heads % kv_heads == 0, "Decoder: bad head counts");
  }

  void add_layer(Tensor post_norm, Tensor after_norm, int64_t window) {
    TORCH_CHECK(projections_.size() == 4 * layers_.size(), "Decoder: a layer's four projections come after it");
    layers_.push_back({std::move(post_norm), std::move(after_norm), window});
  }

  void add_projection(int64_t kind, int64_t n, int64_t code_rows, std::vector<Tensor> tensors, OptTensor bias) {
    const size_t want = kind == kPanels || kind == kBf16Panels ? 1
                        : kind == kCodes || kind == kInt8Codes ? 3
                        : code_rows >= 0 ? 4 : 3;
    TORCH_CHECK(kind >= kPanels && kind <= kInt8Codes && tensors.size() == want,
                "Decoder: projection kind ", kind, " with ", tensors.size(), " tensors");
    TORCH_CHECK(!layers_.empty() && projections_.size() < 4 * layers_.size(), "Decoder: a projection without its layer");
    const auto bytes_of = [&](size_t first, size_t end) {
      std::vector<tercet::Team::Bytes> bytes;
      for (size_t j = first; j < end; ++j)
        bytes.push_back({static_cast<const uint8_t*>(tensors[j].data_ptr()), tensors[j].numel() * tensors[j].element_size()});
      return bytes;
    };
    const size_t codes = std::min<size_t>(3, tensors.size());  // (a kind 3's bf16 panels beside are the fourth)
    weights_.push_back(bytes_of(0, codes));
    wide_weights_.push_back(tensors.size() > 3 ? bytes_of(3, 4) : bytes_of(0, codes));
    if (kind == kBf16Codes && code_rows >= 0) code_rows_ = std::min(code_rows_, code_rows);
    int8_ = int8_ || kind == kInt8Codes;
    projections_.push_back({kind, n, code_rows, std::move(tensors), std::move(bias)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // the rows up to which a step runs as a team (set_team's, or the default for the projections held)
  int64_t team_rows() const { return team_rows_ >= 0 ? team_rows_ : int8_ ? kTeamRows : 0; }

  // steps of up to `rows` rows as a team (0: never), its helpers reading `read_ahead` bytes ahead
  void set_team(int64_t rows, int64_t read_ahead) {
    TORCH_CHECK(rows >= 0 && read_ahead >= 0, "Decoder.set_team: rows and read_ahead must be >= 0");
    team_rows_ = rows, read_ahead_ = read_ahead;
  }

  Tensor forward(Tensor x, Tensor h, const Tensor& cos, const Tensor& sin, const Tensor& k_cache,
                 const Tensor& v_cache, const Tensor& slots, const Tensor& page_table, const Tensor& row_seq,
                 const Tensor& row_lens, int64_t page_size) const {
    TORCH_CHECK(projections_.size() == 4 * layers_.size() && !layers_.empty(), "Decoder: incomplete");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == num_layers() && v_cache.sizes() == k_cache.sizes(),
                "Decoder: the caches must be [layers, rows, kv_heads, head_dim]");
    const Ops& o = ops();
    const int64_t rows = x.size(0), q_size = heads_ * head_dim_;
    const auto layers = [&](tercet::Team* team) {
      const auto at = [&](size_t product) {
        if (team != nullptr) team->at_product(static_cast<int64_t>(product));
      };
      for (size_t i = 0; i < layers_.size(); ++i) {
        const Layer& layer = layers_[i];
        const Projection* p = &projections_[4 * i];
        Tensor k_layer = k_cache.select(0, static_cast<int64_t>(i)), v_layer = v_cache.select(0, static_cast<int64_t>(i));
        at(4 * i);
        const Tensor qkv = p[0](h);
        auto [q, k] = o.rope_store.call(qkv, cos, sin, k_layer, v_layer, slots, heads_, kv_heads_);
        const Tensor attn = o.paged_attention.call(q, k_layer, v_layer, page_table, row_seq, row_lens, page_size,
                                                   scale_, layer.window, 0.0);
        at(4 * i + 1);
        const Tensor o_out = p[1](attn.reshape({rows, q_size}));
        h = o.add_rms_norm.call(x, o_out, layer.post_norm, eps_);
        at(4 * i + 2);
        const Tensor act = p[2].silu(h);
        at(4 * i + 3);
        const Tensor down = p[3](act);
        h = o.add_rms_norm.call(x, down, layer.after_norm, eps_);
      }
    };
    const int64_t threads = at::get_num_threads();
    if (rows <= team_rows() && threads > 1 && !at::in_parallel_region()) {
      tercet::Team team(rows <= code_rows_ ? &weights_ : &wide_weights_, read_ahead_);
      team.run(threads, [&] { layers(&team); });
    } else {
      layers(nullptr);
    }
    return h;
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
  std::vector<Projection> projections_;
  // what each product reads (for the team's read-ahead): up to code_rows_ rows its codes, past them a kind 3's
  // bf16 panels beside (a model's projections share one code_rows)
  tercet::Team::Products weights_, wide_weights_;
  int64_t code_rows_ = std::numeric_limits<int64_t>::max();
  // Up to this many rows a step runs as one team (share.h): a product's region costs more than its work there,
  // and reading the weights is what bounds the step; its helper reads this many bytes ahead of the products.
  // By default only a decoder with int8 products (kind 4) has one: there steps of 1-16 rows measured 1.05-1.11x;
  // the exact kernels at one row are bound by their instructions, and the AVX2 fp32 one measured 0.90-0.94x
  // with the read-ahead (docs/cpu-performance.md). team_rows_ -1: that default; set_team sets it.
  static constexpr int64_t kTeamRows = 16;
  int64_t team_rows_ = -1, read_ahead_ = int64_t{2} << 20;
  bool int8_ = false;  // a projection of kind 4
};

Tensor decoder_forward(const c10::intrusive_ptr<Decoder>& decoder, Tensor x, Tensor h, const Tensor& cos,
                       const Tensor& sin, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                       const Tensor& page_table, const Tensor& row_seq, const Tensor& row_lens, int64_t page_size) {
  return decoder->forward(std::move(x), std::move(h), cos, sin, k_cache, v_cache, slots, page_table, row_seq,
                          row_lens, page_size);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tercet, m) {
  m.class_<Decoder>("Decoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &Decoder::add_layer)
      .def("add_projection", &Decoder::add_projection)
      .def("num_layers", &Decoder::num_layers)
      .def("set_team", &Decoder::set_team)
      .def("team_rows", &Decoder::team_rows);
  // an op, not a method: torch.ops calls release the GIL while they run (the server's event loop goes on)
  m.def("decoder_forward(__torch__.torch.classes.tercet.Decoder decoder, Tensor(a!) x, Tensor h, Tensor cos, "
        "Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor page_table, Tensor row_seq, "
        "Tensor row_lens, int page_size) -> Tensor");
  m.impl("decoder_forward", c10::DispatchKey::CPU, TORCH_FN(decoder_forward));
}

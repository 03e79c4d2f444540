// One decode step through every decoder layer in a single call from Python.
//
// At batch 1 a layer's arithmetic takes ~0.2 ms on this class of CPU, and its ~40 PyTorch calls
// from Python (norms, projections, splits, views, rotary, cache writes, attention, residuals) cost
// as much again: half of a token's time was interpreter and dispatch. The stack is handed each
// layer's weights and KV cache views once, then chains the same kernels the Python layers call,
// in the same order on the same values, so a decode step gives identical numbers either way
// (tests/test_decode_stack.py). Steps that carry prompt tokens keep the Python layers, where
// the per-call cost is spread over many tokens.
#include <torch/custom_class.h>

#include <vector>

#include "ops.h"

namespace tokenmill {
namespace {

// How a projection's weight is held (tokenmill.kernels' Int4Panels / Int8Panels, or float).
enum Kind : int64_t { kFloat = 0, kInt4 = 1, kInt8 = 2, kInt4Dot = 3, kInt8Dot = 4 };
// The MLP's activation: SiLU (Llama, Qwen2), GeLU, GeLU with the tanh approximation (Gemma).
enum Act : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2 };

struct Projection {
  int64_t kind = kFloat, n = 0, bits = 16, float_min_rows = 0;
  at::Tensor q, s, m;         // kFloat: q is the (N, K) float weight
  at::Tensor bias, perm, fw;  // optional: bias (N,), input order (K,) of act-order GPTQ, float copy

  // As tokenmill.layers.linear.Linear.forward.
  at::Tensor operator()(const at::Tensor& x) const {
    if (fw.defined() && x.size(0) > float_min_rows) return at::linear(x, fw, bias);
    if (kind == kFloat) return at::linear(x, q, bias);
    const at::Tensor xi = perm.defined() ? x.index_select(1, perm) : x;
    at::Tensor y;
    switch (kind) {
      case kInt4: y = int4_linear(xi, q, s, m, n); break;
      case kInt8: y = int8_linear(xi, q, s, n); break;
#ifdef TOKENMILL_DOT
      case kInt4Dot: y = int4_linear_dot(xi, q, s, m, n, bits); break;
      case kInt8Dot: y = int8_linear_dot(xi, q, s, n, bits); break;
#endif
      default: TORCH_CHECK(false, "unknown projection kind ", kind);
    }
    return bias.defined() ? y + bias : y;
  }
};

struct Layer {
  at::Tensor in_norm, post_norm, k_cache, v_cache;
  std::vector<Projection> proj;  // qkv, o, gate_up, down
};

// Writes each token's K and V rows (Hkv*D floats at row stride ld) into its cache slot, converted
// to the cache's dtype as Tensor.to does (round to nearest even).
template <typename T>
void store_rows(const float* k, const float* v, int64_t ldk, int64_t ldv, const int64_t* slots, int64_t B,
                int64_t row, int64_t num_slots, T* kc, T* vc) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t slot = slots[b];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "cache slot out of range");
    for (int64_t i = 0; i < row; ++i) {
      kc[slot * row + i] = static_cast<T>(k[b * ldk + i]);
      vc[slot * row + i] = static_cast<T>(v[b * ldv + i]);
    }
  }
}

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              int64_t act, double scale)
      : hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), inter_(intermediate), act_(act), eps_(eps), scale_(scale) {
    TORCH_CHECK(act >= kSilu && act <= kGeluTanh, "unknown activation ", act);
    TORCH_CHECK(head_dim % 2 == 0 && num_heads % num_kv_heads == 0, "bad head shapes");
  }

  // Norm weights are the factors the norm multiplies by (Gemma's 1 + w already added).
  void add_layer(at::Tensor in_norm, at::Tensor post_norm, at::Tensor k_cache, at::Tensor v_cache) {
    check_caches(k_cache, v_cache);
    TORCH_CHECK(k_cache.size(2) == hkv_ && k_cache.size(3) == d_, "caches must have ", hkv_, " heads of ", d_);
    layers_.push_back(Layer{in_norm.contiguous(), post_norm.contiguous(), k_cache, v_cache, {}});
  }

  // Appends the last layer's next projection, in the order qkv, o, gate_up, down.
  void add_projection(int64_t kind, at::Tensor q, c10::optional<at::Tensor> s, c10::optional<at::Tensor> m,
                      c10::optional<at::Tensor> bias, c10::optional<at::Tensor> perm, c10::optional<at::Tensor> fw,
                      int64_t n, int64_t bits, int64_t float_min_rows) {
    TORCH_CHECK(!layers_.empty() && layers_.back().proj.size() < 4, "add_layer first; four projections per layer");
#ifndef TOKENMILL_DOT
    TORCH_CHECK(kind != kInt4Dot && kind != kInt8Dot, "the kernels were built without the dot layout");
#endif
    TORCH_CHECK(kind >= kFloat && kind <= kInt8Dot, "unknown projection kind ", kind);
    const int64_t i = static_cast<int64_t>(layers_.back().proj.size());
    const int64_t want[4] = {(hq_ + 2 * hkv_) * d_, hidden(), 2 * inter_, hidden()};
    TORCH_CHECK(i == 0 || n == want[i], "projection ", i, " has ", n, " outputs, expected ", want[i]);
    Projection p{kind, n, bits, float_min_rows, q, s.value_or(at::Tensor()), m.value_or(at::Tensor()),
                 bias.value_or(at::Tensor()), perm.value_or(at::Tensor()), fw.value_or(at::Tensor())};
    layers_.back().proj.push_back(std::move(p));
  }

  // h (B, hidden): one token per sequence; cos/sin (B, D/2) of its position; slots (B,) where its
  // K/V go; block_tables (B, W) and context_lens (B,) as paged_decode_attention takes them.
  // Returns the hidden states after the last layer (before the final norm).
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor block_tables,
                     at::Tensor context_lens) {
    TORCH_CHECK(!layers_.empty() && layers_.back().proj.size() == 4, "the stack is incomplete");
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "h must be float (B, hidden)");
    h = h.clone();  // the residual stream, updated in place
    const int64_t B = h.size(0), qkv_n = (hq_ + 2 * hkv_) * d_, row = hkv_ * d_;
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B,
                "one int64 cache slot per sequence");
    for (const Layer& L : layers_) {
      const at::Tensor qkv = L.proj[0](rms_norm(h, L.in_norm, eps_));                       // (B, (Hq+2Hkv) D)
      const at::Tensor qk = rotary(qkv.narrow(1, 0, (hq_ + hkv_) * d_).view({B, hq_ + hkv_, d_}), cos, sin);
      const int64_t num_slots = L.k_cache.size(0) * L.k_cache.size(1);
      const float *kp = qk.data_ptr<float>() + hq_ * d_, *vp = qkv.data_ptr<float>() + (hq_ + hkv_) * d_;
      if (L.k_cache.scalar_type() == at::kHalf)
        store_rows(kp, vp, (hq_ + hkv_) * d_, qkv_n, slots.data_ptr<int64_t>(), B, row, num_slots,
                   L.k_cache.data_ptr<at::Half>(), L.v_cache.data_ptr<at::Half>());
      else
        store_rows(kp, vp, (hq_ + hkv_) * d_, qkv_n, slots.data_ptr<int64_t>(), B, row, num_slots,
                   L.k_cache.data_ptr<float>(), L.v_cache.data_ptr<float>());
      const at::Tensor o = paged_decode_attention(qk.narrow(1, 0, hq_), L.k_cache, L.v_cache,
                                                  block_tables, context_lens, scale_);
      add_into(h, L.proj[1](o.view({B, hq_ * d_})));
      const at::Tensor gu = L.proj[2](rms_norm(h, L.post_norm, eps_));                      // (B, 2 I)
      add_into(h, L.proj[3](activation(gu)));
    }
    return h;
  }

 private:
  int64_t hidden() const { return layers_.back().in_norm.numel(); }

  // gu (B, 2I) = [gate | up] -> act(gate) * up, as MLP.forward computes it
  at::Tensor activation(const at::Tensor& gu) const {
    if (act_ == kSilu) return silu_mul(gu);
    const at::Tensor gate = gu.narrow(1, 0, inter_), up = gu.narrow(1, inter_, inter_);
    return (act_ == kGelu ? at::gelu(gate) : at::gelu(gate, "tanh")) * up;
  }

  // h += y, elementwise: the same float additions as h + y, without a dispatcher round trip
  static void add_into(at::Tensor& h, const at::Tensor& y) {
    TORCH_CHECK(y.sizes() == h.sizes() && y.is_contiguous(), "residual shape mismatch");
    float* hp = h.data_ptr<float>();
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0, n = h.numel(); i < n; ++i) hp[i] += yp[i];
  }

  int64_t hq_, hkv_, d_, inter_, act_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

}  // namespace
}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<tokenmill::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, int64_t, double>())
      .def("add_layer", &tokenmill::DecodeStack::add_layer)
      .def("add_projection", &tokenmill::DecodeStack::add_projection)
      .def("forward", &tokenmill::DecodeStack::forward);
}

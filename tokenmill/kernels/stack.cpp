// One decode step through every decoder layer in a single call from Python.
//
// At batch 1 a small layer's ~40 PyTorch calls from Python (norms, projections, splits, views,
// rotary, cache writes, attention, residuals) cost as much as its arithmetic: half of a token's
// time was interpreter and dispatch (benchmarks/profile_decode.py). The stack is handed each
// layer's weights and KV cache views once, then chains the same kernels the Python layers call,
// in the same order on the same values, so a decode step gives identical numbers either way
// (tests/test_decode_stack.py). Steps that carry prompt tokens keep the Python layers, where
// the per-call cost is spread over many tokens.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <string>
#include <vector>

#include "amx.h"
#include "attention.h"
#include "ops.h"
#include "shm.h"

namespace tokenmill {
namespace {

// How a projection's weight is held (tokenmill.kernels' Int4Panels / Int8Panels / Q4KPanels /
// Q6KPanels / LutPanels / Q23KPanels, or float), or kStack: parts of different kinds stacked by output rows (a RowStack).
enum Kind : int64_t { kFloat = 0, kInt4 = 1, kInt8 = 2, kInt4Dot = 3, kInt8Dot = 4, kQ4K = 5, kQ6K = 6, kStack = 7, kLut = 8, kQ23K = 9 };
// The MLP's activation: SiLU (Llama, Qwen2), GeLU, GeLU with the tanh approximation (Gemma).
enum Act : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2 };

// From how many rows a product runs on AMX tiles, as kernels.panels.amx_rows: `rows`, at least
// `small_rows` for a product of fewer than `small_weights` weights; rows 0: never.
struct AmxRows {
  int64_t rows = 0, small_rows = 0, small_weights = 0;
  bool keep_8bit = false;  // products with 8-bit activations stay on the integer kernels (panels.AMX)
  int64_t operator()(int64_t n, int64_t k) const {
    return rows && n * k < small_weights ? std::max(rows, small_rows) : rows;
  }
};

struct Projection {
  int64_t kind = kFloat, n = 0, bits = 16, float_min_rows = 0, segment = 0;
  at::Tensor q, s, m;         // kFloat: q is the (N, K) float weight; kQ4K: q, sm, dd; kQ6K: ql, qh, sc (+ e: d); kQ23K: q2, sc, d (+ e: Q3_K's third bits)
                              // e of kInt4Dot / kQ4K: the fifth bits of 5-bit weights (Q5_0/Q5_1, Q5_K)
  at::Tensor bias, perm, fw;  // optional: bias (N,), input order (K,) of act-order GPTQ, float copy
  at::Tensor e;
  std::vector<Projection> parts;  // kStack

  // As tokenmill.layers.linear.Linear._matmul; `partial`: a row-parallel rank's share, float64 from
  // the int kernels, the bias left to the caller; from `amx` rows on AMX tiles.
  at::Tensor operator()(const at::Tensor& x, bool partial = false, const AmxRows& amx = AmxRows()) const {
    const at::Tensor& b = partial ? at::Tensor() : bias;
    if (fw.defined() && x.size(0) > float_min_rows) return at::linear(x, fw, b);
    if (kind == kFloat) return at::linear(x, q, b);
    if (kind == kStack) {
      std::vector<at::Tensor> ys;
      for (const Projection& p : parts) ys.push_back(p(x, partial, amx));
      const at::Tensor y = at::cat(ys, 1);
      return b.defined() ? y + b : y;
    }
    const at::Tensor xi = perm.defined() ? x.index_select(1, perm) : x;
    at::Tensor y;
#ifdef TOKENMILL_BF16MM
    const auto opt = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
    const int64_t from = amx(n, x.size(1));
    if (from && !partial && !(bits == 8 && amx.keep_8bit) && x.size(0) >= from && (kind == kInt4Dot || kind == kInt8Dot || kind == kQ4K ||
                                                          kind == kQ6K || kind == kLut || kind == kQ23K)) {
      y = amx_linear(xi, kind, q, opt(s), opt(m), opt(e), n);  // q, s, m, e hold panels.stack_args()' four
      return b.defined() ? y + b : y;
    }
#endif
    switch (kind) {
      case kInt4: y = int4_linear(xi, q, s, m, n); break;
      case kInt8: y = int8_linear(xi, q, s, n); break;
#ifdef TOKENMILL_DOT
      case kInt4Dot: y = int4_linear_dot(xi, q, s, m.defined() ? c10::optional<at::Tensor>(m) : c10::nullopt, n, bits, segment, partial, e); break;
      case kInt8Dot: y = int8_linear_dot(xi, q, s, n, bits, segment, partial); break;
      case kQ4K: y = q4k_linear_dot(xi, q, s, m, n, bits, segment, partial, e); break;
      case kQ6K: y = q6k_linear_dot(xi, q, s, m, e, n, bits, segment, partial); break;
      case kQ23K: y = q23k_linear_dot(xi, q, s, m, e.defined() ? c10::optional<at::Tensor>(e) : c10::nullopt, n, bits, segment, partial); break;
      case kLut: y = lut_linear_dot(xi, q, s, m.defined() ? c10::optional<at::Tensor>(m) : c10::nullopt, n, bits, segment, partial); break;
#endif
      default: TORCH_CHECK(false, "unknown projection kind ", kind);
    }
    return b.defined() ? y + b : y;
  }
};

// One projection's LoRA adapter slots (layers/lora.py's LoRABank, the same tensors: slots filled
// from Python show here at once).
struct LoraSlots {
  at::Tensor a, b, ranks;
  std::vector<int64_t> offsets;
  // y += each row's delta, rows under slots (-1: none)
  void add(at::Tensor& y, const at::Tensor& x, const at::Tensor& slots) const {
    if (a.defined()) lora_add_(y, x, a, b, ranks, slots, offsets);
  }
};

struct Layer {
  at::Tensor in_norm, post_norm, k_cache, v_cache;
  int64_t window = 0, rope = 0;  // sliding window (0: global); which rotary table (1: the local one)
  at::Tensor q_norm, k_norm;     // optional per-head norms of q and k (Qwen3, Gemma 3)
  at::Tensor attn_out_norm, mlp_out_norm;  // optional norms of the attention and MLP outputs (Gemma 2/3)
  std::vector<Projection> proj;  // qkv, o, gate_up, down (a MoE layer: qkv, o)
  // mixture of experts (tokenmill/models/moe.py): float router (E, hidden), k experts per token,
  // experts' projections gate_up, down, ... in expert order, then the shared expert's two
  int64_t num_experts = 0, top_k = 0;
  bool norm_topk = false;
  at::Tensor router, shared_gate;  // shared_gate: (1, hidden) when there is a shared expert
  std::vector<Projection> expert_proj;
  at::Tensor q_smooth, k_smooth;  // optional key smoothing of an int8 cache: (Hq, D), (Hkv, D) (models/kv_smoothing.py)
  LoraSlots lora[4];              // adapters of qkv, o, gate_up, down, where set

  size_t expert_projections() const { return 2 * num_experts + (shared_gate.defined() ? 2 : 0); }
  bool complete() const { return num_experts ? proj.size() == 2 && expert_proj.size() == expert_projections() : proj.size() == 4; }
};

// Sums t over the ranks of a tensor-parallel group, in place, through the dispatcher's c10d
// functional ops (the group found by the name torch.distributed registered it under), so the
// kernels need no link to c10d. As TPGroup.all_reduce does from Python.
void all_reduce_(at::Tensor& t, const std::string& group) {
  // called boxed: the group argument's declared type changed across PyTorch releases (str, then Any)
  static const c10::OperatorHandle reduce =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_reduce_", "");
  static const c10::OperatorHandle wait = c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  std::vector<c10::IValue> stack{t, std::string("sum"), group};
  reduce.callBoxed(&stack);
  stack = {t};
  wait.callBoxed(&stack);
}

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              int64_t act, double scale)
      : hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), inter_(intermediate), act_(act), eps_(eps), scale_(scale) {
    TORCH_CHECK(act >= kSilu && act <= kGeluTanh, "unknown activation ", act);
    TORCH_CHECK(head_dim % 2 == 0 && num_heads % num_kv_heads == 0, "bad head shapes");
  }

  // Norm weights are the factors the norm multiplies by (Gemma's 1 + w already added). post_norm is
  // the norm before the MLP; attn_out_norm / mlp_out_norm, where given, normalise the attention and
  // MLP outputs before they join the residual stream.
  void add_layer(at::Tensor in_norm, at::Tensor post_norm, at::Tensor k_cache, at::Tensor v_cache, int64_t window,
                 int64_t rope, c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
                 c10::optional<at::Tensor> attn_out_norm, c10::optional<at::Tensor> mlp_out_norm) {
    check_caches(k_cache, v_cache);
    TORCH_CHECK(k_cache.size(2) == hkv_ && cache_head_dim(k_cache) == d_, "caches must have ", hkv_, " heads of ", d_);
    TORCH_CHECK(window >= 0 && (rope == 0 || rope == 1), "bad window or rotary index");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    TORCH_CHECK(attn_out_norm.has_value() == mlp_out_norm.has_value(), "output norms come together");
    auto opt = [](const c10::optional<at::Tensor>& t) { return t ? t->contiguous() : at::Tensor(); };
    layers_.push_back(Layer{in_norm.contiguous(), post_norm.contiguous(), k_cache, v_cache, window, rope,
                            opt(q_norm), opt(k_norm), opt(attn_out_norm), opt(mlp_out_norm), {}});
  }

  // Makes the last layer's MLP a mixture of experts (after its qkv and o projections): the experts'
  // projections follow, gate_up and down of each in expert order, then the shared expert's.
  void set_moe(at::Tensor router, int64_t top_k, bool norm_topk, c10::optional<at::Tensor> shared_gate) {
    TORCH_CHECK(!layers_.empty() && layers_.back().proj.size() == 2 && !layers_.back().num_experts,
                "set_moe after a layer's qkv and o projections");
    TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kFloat && router.size(1) == hidden() && top_k >= 1 &&
                top_k <= router.size(0), "router must be float (E, hidden), 1 <= top_k <= E");
    Layer& L = layers_.back();
    L.num_experts = router.size(0), L.top_k = top_k, L.norm_topk = norm_topk, L.router = router.contiguous();
    if (shared_gate) L.shared_gate = shared_gate->contiguous();
  }

  // Key smoothing of the last layer's int8 cache: its K rows stored divided by k_smooth (Hkv, D), its
  // queries multiplied by q_smooth (Hq, D) before attention (models/kv_smoothing.py).
  void set_key_smoothing(at::Tensor q_smooth, at::Tensor k_smooth) {
    TORCH_CHECK(!layers_.empty(), "add_layer first");
    TORCH_CHECK(q_smooth.scalar_type() == at::kFloat && k_smooth.scalar_type() == at::kFloat &&
                q_smooth.numel() == hq_ * d_ && k_smooth.numel() == hkv_ * d_, "smoothing must be float (Hq, D), (Hkv, D)");
    layers_.back().q_smooth = q_smooth.contiguous().view({hq_, d_});
    layers_.back().k_smooth = k_smooth.contiguous();
  }

  // One rank of a tensor-parallel group: the o and down projections hold a slice of their inputs,
  // and their partial outputs are summed across the group before joining the residual stream.
  // `shm`: the ranks share this host's memory (the fast path); else the group's c10d all-reduce.
  // Which products go to AMX tiles (the amx variant), as Linear does in the Python layers
  // (kernels.panels.amx_rows); rows 0 keeps every one on the integer kernels.
  void set_amx_rows(int64_t rows, int64_t small_rows, int64_t small_weights, bool keep_8bit) {
#ifndef TOKENMILL_BF16MM
    TORCH_CHECK(rows == 0, "bfloat16 products need the amx or avx512bf16 kernel variant");
#endif
    amx_rows_ = AmxRows{rows, small_rows, small_weights, keep_8bit};
  }

  void set_tensor_parallel(c10::optional<c10::intrusive_ptr<ShmAllReduce>> shm, std::string group) {
    tp_shm_ = shm ? *shm : nullptr;
    tp_group_ = std::move(group);
  }

  // LoRA slots of layer `layer`'s projection `proj` (0 qkv, 1 o, 2 gate_up, 3 down): A (S, K, P R),
  // B (S, R, N), ranks (S, P), part bounds `offsets` (kernels/lora.cpp). Used by steps given lora_slots.
  void set_lora(int64_t layer, int64_t proj, at::Tensor a, at::Tensor b, at::Tensor ranks, std::vector<int64_t> offsets) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && proj >= 0 && proj < 4, "no projection ", proj,
                " in layer ", layer);
    TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && ranks.is_contiguous(), "LoRA slots must be contiguous");
    layers_[layer].lora[proj] = LoraSlots{a, b, ranks, std::move(offsets)};
  }

  // Appends the last layer's next projection, in the order qkv, o, gate_up, down (or the experts').
  void add_projection(int64_t kind, at::Tensor q, c10::optional<at::Tensor> s, c10::optional<at::Tensor> m,
                      c10::optional<at::Tensor> bias, c10::optional<at::Tensor> perm, c10::optional<at::Tensor> fw,
                      int64_t n, int64_t bits, int64_t float_min_rows, int64_t segment, c10::optional<at::Tensor> e) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().complete(), "add_layer first; the layer has all its projections");
    Layer& last = layers_.back();
    if (last.num_experts && last.proj.size() == 2) {  // an expert's gate_up (2 x its width) or down
      const bool down = last.expert_proj.size() % 2 == 1;
      TORCH_CHECK(down ? n == hidden() : n % 2 == 0, "expert projection has ", n, " outputs");
      last.expert_proj.push_back(Projection{kind, n, bits, float_min_rows, segment, q, s.value_or(at::Tensor()),
                                            m.value_or(at::Tensor()), bias.value_or(at::Tensor()),
                                            perm.value_or(at::Tensor()), fw.value_or(at::Tensor()),
                                            e.value_or(at::Tensor())});
      return;
    }
#ifndef TOKENMILL_DOT
    TORCH_CHECK(kind != kInt4Dot && kind != kInt8Dot && kind != kQ4K && kind != kQ6K && kind != kLut && kind != kQ23K,
                "the kernels were built without the dot layout");
#endif
    TORCH_CHECK(kind >= kFloat && kind <= kQ23K, "unknown projection kind ", kind);
    const int64_t i = static_cast<int64_t>(layers_.back().proj.size());
    const int64_t want[4] = {(hq_ + 2 * hkv_) * d_, hidden(), 2 * inter_, hidden()};
    TORCH_CHECK(i == 0 || n == want[i], "projection ", i, " has ", n, " outputs, expected ", want[i]);
    Projection p{kind, n, bits, float_min_rows, segment, q, s.value_or(at::Tensor()), m.value_or(at::Tensor()),
                 bias.value_or(at::Tensor()), perm.value_or(at::Tensor()), fw.value_or(at::Tensor()),
                 e.value_or(at::Tensor())};
    layers_.back().proj.push_back(std::move(p));
  }

  // Appends a part (rows after the previous parts') to the last projection, a kStack.
  void add_part(int64_t kind, at::Tensor q, c10::optional<at::Tensor> s, c10::optional<at::Tensor> m,
                c10::optional<at::Tensor> e, int64_t n, int64_t bits, int64_t segment) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().proj.empty() && layers_.back().proj.back().kind == kStack,
                "add_part follows an add_projection of kind ", static_cast<int64_t>(kStack));
    TORCH_CHECK((kind >= kInt4Dot && kind <= kQ6K) || kind == kLut || kind == kQ23K, "a stacked part is a dot-layout weight, got kind ", kind);
    Projection part{kind, n, bits, 0, segment, q, s.value_or(at::Tensor()), m.value_or(at::Tensor())};
    part.e = e.value_or(at::Tensor());
    layers_.back().proj.back().parts.push_back(std::move(part));
  }

  // h (B, hidden): one token per sequence; cos/sin (B, R/2) of its position (cos_local/sin_local:
  // the local layers' rotary, where it differs); slots (B,) where its K/V go; block_tables (B, W)
  // and context_lens (B,) as paged_decode_attention takes them.
  // Returns the hidden states after the last layer (before the final norm).
  // lora_slots (B,) int64: each sequence's adapter slot (-1: the base), where some sequence runs under one.
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor block_tables,
                     at::Tensor context_lens, c10::optional<at::Tensor> cos_local, c10::optional<at::Tensor> sin_local,
                     c10::optional<at::Tensor> lora_slots) {
    TORCH_CHECK(!layers_.empty() && layers_.back().complete(), "the stack is incomplete");
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(), "h must be float (B, hidden)");
    h = h.clone();  // the residual stream, updated in place
    const int64_t B = h.size(0), qkv_n = (hq_ + 2 * hkv_) * d_;
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == B,
                "one int64 cache slot per sequence");
    const at::Tensor ls = lora_slots ? *lora_slots : at::Tensor();
    TORCH_CHECK(!ls.defined() || (ls.scalar_type() == at::kLong && ls.numel() == B && ls.is_contiguous()),
                "one int64 adapter slot per sequence");
    for (const Layer& L : layers_) {
      const at::Tensor xn = rms_norm(h, L.in_norm, eps_);
      at::Tensor qkv = L.proj[0](xn, false, amx_rows_);                                                     // (B, (Hq+2Hkv) D)
      if (ls.defined()) L.lora[0].add(qkv, xn, ls);
      if (L.q_norm.defined()) {
        at::Tensor qh = qkv.narrow(1, 0, hq_ * d_).view({B, hq_, d_}), kh = qkv.narrow(1, hq_ * d_, hkv_ * d_).view({B, hkv_, d_});
        head_rms_norm_(qh, L.q_norm, eps_);
        head_rms_norm_(kh, L.k_norm, eps_);
      }
      const bool local = L.rope == 1;
      TORCH_CHECK(!local || (cos_local && sin_local), "a local-rotary layer needs cos_local/sin_local");
      const at::Tensor qk = rotary(qkv.narrow(1, 0, (hq_ + hkv_) * d_).view({B, hq_ + hkv_, d_}),
                                   local ? *cos_local : cos, local ? *sin_local : sin);
      const int64_t num_slots = L.k_cache.size(0) * L.k_cache.size(1);
      const float *kp = qk.data_ptr<float>() + hq_ * d_, *vp = qkv.data_ptr<float>() + (hq_ + hkv_) * d_;
      at::Tensor kc = L.k_cache, vc = L.v_cache;
      with_kv_type(kc, [&](auto tag) {  // in the cache's format (attention.h)
        using T = decltype(tag);
        store_kv_rows(kp, vp, (hq_ + hkv_) * d_, qkv_n, slots.data_ptr<int64_t>(), B, KvBlocks<T>(kc), num_slots,
                      kv_data_mut<T>(kc), kv_data_mut<T>(vc), L.k_smooth.defined() ? L.k_smooth.data_ptr<float>() : nullptr);
      });
      if (L.q_smooth.defined()) qk.narrow(1, 0, hq_).mul_(L.q_smooth);  // as the Python layer's q * q_smooth
      const at::Tensor o = paged_decode_attention(qk.narrow(1, 0, hq_), L.k_cache, L.v_cache,
                                                  block_tables, context_lens, scale_, L.window);
      at::Tensor a = row_parallel(L.proj[1], o.view({B, hq_ * d_}));
      if (ls.defined()) L.lora[1].add(a, o.view({B, hq_ * d_}), ls);
      add_into(h, L.attn_out_norm.defined() ? rms_norm(a, L.attn_out_norm, eps_) : a);
      if (L.num_experts) {
        add_into(h, experts(L, rms_norm(h, L.post_norm, eps_)));
        continue;
      }
      const at::Tensor xm = rms_norm(h, L.post_norm, eps_);
      at::Tensor gu = L.proj[2](xm, false, amx_rows_);                                                      // (B, 2 I)
      if (ls.defined()) L.lora[2].add(gu, xm, ls);
      const at::Tensor act = activation(gu);
      at::Tensor m = row_parallel(L.proj[3], act);
      if (ls.defined()) L.lora[3].add(m, act, ls);
      add_into(h, L.mlp_out_norm.defined() ? rms_norm(m, L.mlp_out_norm, eps_) : m);
    }
    return h;
  }

 private:
  int64_t hidden() const { return layers_.back().in_norm.numel(); }

  // A row-parallel projection (o, down): under tensor parallelism the rank's partial output (float64
  // from the int kernels) summed over the ranks, then rounded to float32, as Linear.forward does.
  at::Tensor row_parallel(const Projection& p, const at::Tensor& x) const {
    if (!tp_shm_ && tp_group_.empty()) return p(x, false, amx_rows_);
    at::Tensor t = p(x, /*partial=*/true);
    if (tp_shm_)
      tp_shm_->all_reduce_(t);
    else
      all_reduce_(t, tp_group_);
    return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
  }

  // As SparseMoE.forward: softmax router, top k, optional renormalisation; (token, slot) pairs
  // grouped by expert; each chosen expert runs once on its tokens, scaled and added in expert order;
  // then the sigmoid-gated shared expert.
  at::Tensor experts(const Layer& L, const at::Tensor& x) const {
    const at::Tensor probs = at::softmax(at::linear(x, L.router), -1, at::kFloat);
    auto [w, idx] = at::topk(probs, L.top_k, -1);
    if (L.norm_topk) w = w / w.sum(-1, true);
    const at::Tensor flat = idx.reshape(-1);
    const at::Tensor order = at::argsort(flat, /*stable=*/true, -1, /*descending=*/false);
    const at::Tensor counts = at::bincount(flat, {}, L.num_experts);
    const at::Tensor token_of = order.div(L.top_k, "floor"), slot_w = w.reshape(-1).index_select(0, order);
    const int64_t* cp = counts.data_ptr<int64_t>();
    at::Tensor out = at::zeros_like(x);
    for (int64_t e = 0, start = 0; e < L.num_experts; ++e) {
      const int64_t n = cp[e];
      if (!n) continue;
      const at::Tensor rows = token_of.narrow(0, start, n);
      const at::Tensor y = L.expert_proj[2 * e + 1](activation(L.expert_proj[2 * e](x.index_select(0, rows), false, amx_rows_)),
                                                    false, amx_rows_);
      out.index_add_(0, rows, y * slot_w.narrow(0, start, n).unsqueeze(1));
      start += n;
    }
    if (L.shared_gate.defined()) {
      const size_t i = 2 * L.num_experts;
      out = out + at::sigmoid(at::linear(x, L.shared_gate)) *
                      L.expert_proj[i + 1](activation(L.expert_proj[i](x, false, amx_rows_)), false, amx_rows_);
    }
    return out;
  }

  // gu (B, 2I) = [gate | up] -> act(gate) * up, as MLP.forward computes it
  at::Tensor activation(const at::Tensor& gu) const {
    if (act_ == kSilu) return silu_mul(gu);
    const int64_t inter = gu.size(1) / 2;
    const at::Tensor gate = gu.narrow(1, 0, inter), up = gu.narrow(1, inter, inter);
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
  AmxRows amx_rows_;  // which products run on AMX tiles
  double eps_, scale_;
  std::vector<Layer> layers_;
  std::string tp_group_;  // empty (and no tp_shm_): one process holds the whole model
  c10::intrusive_ptr<ShmAllReduce> tp_shm_;
};

}  // namespace
}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  // first: DecodeStack.set_tensor_parallel names this type, which must be registered by then
  m.class_<tokenmill::ShmAllReduce>("ShmAllReduce")
      .def(torch::init<std::string, int64_t, int64_t, int64_t, int64_t, double>())
      .def("all_reduce_", &tokenmill::ShmAllReduce::all_reduce_)
      .def("send", &tokenmill::ShmAllReduce::send)
      .def("receive", &tokenmill::ShmAllReduce::receive)
      .def("abort", &tokenmill::ShmAllReduce::abort)
      .def_static("bytes_needed", &tokenmill::ShmAllReduce::bytes_needed);
  m.class_<tokenmill::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, int64_t, double>())
      .def("add_layer", &tokenmill::DecodeStack::add_layer)
      .def("add_projection", &tokenmill::DecodeStack::add_projection)
      .def("add_part", &tokenmill::DecodeStack::add_part)
      .def("set_moe", &tokenmill::DecodeStack::set_moe)
      .def("set_key_smoothing", &tokenmill::DecodeStack::set_key_smoothing)
      .def("set_tensor_parallel", &tokenmill::DecodeStack::set_tensor_parallel)
      .def("set_amx_rows", &tokenmill::DecodeStack::set_amx_rows)
      .def("set_lora", &tokenmill::DecodeStack::set_lora)
      .def("forward", &tokenmill::DecodeStack::forward);
}

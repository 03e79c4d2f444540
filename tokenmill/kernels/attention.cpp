// Paged decode attention over tokenmill's KV cache (one query token per sequence), K/V read from
// their blocks in place (no gather into a padded batch, no widened copy of the context), float32,
// float16, int8 or fp8 cache (attention.h); prefill over a cached context is context_attention.cpp's.
// And the writing of K/V rows into the cache, in its format (store_kv).
#include <type_traits>
#include <vector>

#include "attention.h"
#include "decode_avx2.h"
#include "decode_avx512.h"

namespace tokenmill {
namespace {

// One query token per sequence over its paged context, read in place: no gather, no padding.
// Work item = (sequence, KV head); the query heads sharing that KV head are processed together
// so every K/V row is loaded once for all of them. Online softmax, 16 tokens at a time:
//
//   s[g, t] = q_g . k_t * scale        (t over up to 16 tokens of a block: one vector per head)
//   m_g' = max(m_g, max_t s[g, t]);  acc_g, l_g *= e^(m_g - m_g');  p = e^(s - m_g')
//   acc_g += sum_t p[g, t] v_t;  l_g += sum_t p[g, t]          ...  out_g = acc_g / l_g
//
//   q (B, Hq, D) float32   k_cache, v_cache (num_blocks, block_size, Hkv, D) float32 or float16
//   block_tables (B, W) int64, context_lens (B,) int64   ->  out (B, Hq, D)

template <typename T>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, int64_t window,
                      at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2), W = block_tables.size(1);
  const KvBlocks<T> L(k_cache);
  const int64_t G = Hq / Hkv, row = L.row;
  const float* qp = q.data_ptr<float>();
  const T *kp = kv_data<T>(k_cache), *vp = kv_data<T>(v_cache);
  const int64_t *tp = block_tables.data_ptr<int64_t>(), *lp = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float acc[kMaxGroup * kMaxHeadDim];
    alignas(64) float s[kMaxGroup][kLanes];
    float mx[kMaxGroup], l[kMaxGroup];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv, len = lp[b];
      TORCH_CHECK(len >= 1 && len <= W * bs, "context length out of range");
      const float* qh = qp + b * q.stride(0) + h * G * D;  // rows may be strided (a view into qkv)
      std::fill(acc, acc + G * D, 0.f);
      std::fill(mx, mx + G, neg_inf);
      std::fill(l, l + G, 0.f);
      for (int64_t pos = window_start(len, window); pos < len; pos += std::min(bs - pos % bs, kLanes)) {
        const int64_t j = pos / bs, off = pos % bs, n = std::min({bs - off, kLanes, len - pos});
        const int64_t blk = tp[b * W + j];
        TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id out of range");
        const T *kb = kp + L.at(blk, off, h), *vb = vp + L.at(blk, off, h);
        const int64_t sat = L.scale_at(blk, off, h);  // int8: the rows' scales, L.step apart
        for (int64_t g = 0; g < G; ++g)
          for (int64_t t = n; t < kLanes; ++t) s[g][t] = neg_inf;
        for (int64_t t = 0; t < n; ++t) {
          const T* kt = kb + t * row;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qh + g * D;
            v16f d0 = load(qg) * load_kv(kt);
            for (int64_t d = kLanes; d < D; d += kLanes) d0 += load(qg + d) * load_kv(kt + d);
            s[g][t] = hsum(d0) * scale;
            if constexpr (kv_scaled<T>) s[g][t] *= kv_scale(kp + sat + t * L.step);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const v16f sg = load(s[g]);
          float bmax = sg[0];
          for (int64_t t = 1; t < n; ++t) bmax = std::max(bmax, sg[t]);
          const float nm = std::max(mx[g], bmax);
          float* ag = acc + g * D;
          if (nm > mx[g]) {
            const float alpha = std::exp(mx[g] - nm);  // 0 on the first block
            l[g] *= alpha;
            for (int64_t d = 0; d < D; d += kLanes) store(ag + d, load(ag + d) * splat(alpha), kLanes);
            mx[g] = nm;
          }
          const v16f p = exp16(sg - nm);  // lanes past n: e^-inf = 0
          l[g] += hsum(p);
          for (int64_t d = 0; d < D; d += kLanes) {
            v16f a = load(ag + d);
            for (int64_t t = 0; t < n; ++t) {
              float pt = p[t];
              if constexpr (kv_scaled<T>) pt *= kv_scale(vp + sat + t * L.step);
              a += splat(pt) * load_kv(vb + t * row + d);
            }
            store(ag + d, a, kLanes);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        float* o = op + (b * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; d += kLanes) store(o + d, load(acc + g * D + d) * inv, kLanes);
      }
    }
  });
}

#if defined(__AVX512F__)
// The grouped kernel for groups of up to 8 query heads per KV head; false: use the generic one.
template <typename T>
bool decode_attention_fast(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, float scale,
                           int64_t window, at::Tensor& out) {
  switch (q.size(1) / k_cache.size(2)) {
#define TOKENMILL_GROUP(g) \
  case g: avx512::decode_attention_group<T, g>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out); return true;
    TOKENMILL_GROUP(1) TOKENMILL_GROUP(2) TOKENMILL_GROUP(3) TOKENMILL_GROUP(4)
    TOKENMILL_GROUP(5) TOKENMILL_GROUP(6) TOKENMILL_GROUP(7) TOKENMILL_GROUP(8)
#undef TOKENMILL_GROUP
    default: return false;
  }
}
#elif defined(__AVX2__)
template <typename T>
bool decode_attention_fast(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, float scale,
                           int64_t window, at::Tensor& out) {
  avx2::decode_attention_split<T>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out);
  return true;
}
#else
template <typename T>
bool decode_attention_fast(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, float, int64_t, at::Tensor&) {
  return false;
}
#endif

}  // namespace

void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == kv &&
              (kv == at::kFloat || kv == at::kHalf || kv == at::kChar || kv == at::kFloat8_e5m2) &&
              k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be float32, float16, int8 or float8_e5m2 (num_blocks, block_size, Hkv, D)");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window) {
  check_caches(k_cache, v_cache);
  check_heads(q, k_cache);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && context_lens.is_contiguous(), "tables and lengths must be int64");
  const int64_t B = q.size(0);
  TORCH_CHECK(block_tables.size(0) == B && context_lens.numel() == B, "one block table and length per sequence");
  at::Tensor out = at::empty(q.sizes(), q.options());
  const float sc = static_cast<float>(scale);
  with_kv_type(k_cache, [&](auto tag) {
    using T = decltype(tag);
    if (!decode_attention_fast<T>(q, k_cache, v_cache, block_tables, context_lens, sc, window, out))
      decode_attention<T>(q, k_cache, v_cache, block_tables, context_lens, sc, window, out);
  });
  return out;
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
              const c10::optional<at::Tensor>& k_smooth) {
  check_caches(k_cache, v_cache);
  const int64_t D = cache_head_dim(k_cache), Hkv = k_cache.size(2), B = slots.numel();
  if (k_smooth)
    TORCH_CHECK(k_smooth->scalar_type() == at::kFloat && k_smooth->is_contiguous() && k_smooth->numel() == Hkv * D,
                "k_smooth must be float (Hkv, D)");
  for (const at::Tensor* x : {&k, &v})
    TORCH_CHECK(x->dim() == 3 && x->scalar_type() == at::kFloat && x->size(0) == B && x->size(1) == Hkv &&
                x->size(2) == D && x->stride(2) == 1 && x->stride(1) == D,
                "k and v must be float (T, Hkv, D) with each token's heads contiguous, one slot per token");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  with_kv_type(k_cache, [&](auto tag) {
    using T = decltype(tag);
    store_kv_rows(k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), v.stride(0), slots.data_ptr<int64_t>(), B,
                  KvBlocks<T>(k_cache), num_slots, kv_data_mut<T>(k_cache), kv_data_mut<T>(v_cache),
                  k_smooth ? k_smooth->data_ptr<float>() : nullptr);
  });
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0) -> Tensor");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor? k_smooth=None) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_decode_attention", &tokenmill::paged_decode_attention);
  m.impl("store_kv", &tokenmill::store_kv);
}

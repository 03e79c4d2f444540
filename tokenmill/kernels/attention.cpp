// Paged decode attention over tokenmill's KV cache: one query token per sequence, K/V read from
// their blocks in place (no gather into a padded batch), float32 or float16 cache.
#include "ops.h"

namespace tokenmill {
namespace {

inline float hsum(v16f v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

// e^x for 16 lanes: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial (relative error
// ~2e-7, as good as expf for softmax); x below -87 gives 0.
inline v16f exp16(v16f x) {
  const v16f lo = v16f{} - 87.f;
  x = x < lo ? lo : x;  // lane-wise select
  const v16f t = x * 1.44269504f;
  v16f n = __builtin_convertvector(__builtin_convertvector(t + (t < 0 ? v16f{} - 0.5f : v16f{} + 0.5f),
                                                           v16si), v16f);  // round to nearest
  const v16f r = x - n * 0.693145752f - n * 1.42860677e-6f;  // ln2 in two parts
  v16f p = v16f{} + 1.3981999e-3f;
  p = p * r + 8.3334519e-3f;
  p = p * r + 4.1665795e-2f;
  p = p * r + 1.6666666e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const v16si bits = (__builtin_convertvector(n, v16si) + 127) << 23;
  v16f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// 16 cache elements -> 16 floats: float32 as is, float16 widened (F16C on x86).
inline v16f load_kv(const float* p) { return load(p); }
inline v16f load_kv(const at::Half* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  v16f v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

constexpr int64_t kMaxGroup = 16, kMaxHeadDim = 256;

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
                      const at::Tensor& block_tables, const at::Tensor& context_lens, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2), W = block_tables.size(1);
  const int64_t G = Hq / Hkv, row = Hkv * D;
  const float* qp = q.data_ptr<float>();
  const T *kp = k_cache.data_ptr<T>(), *vp = v_cache.data_ptr<T>();
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
      const float* qh = qp + (b * Hq + h * G) * D;
      std::fill(acc, acc + G * D, 0.f);
      std::fill(mx, mx + G, neg_inf);
      std::fill(l, l + G, 0.f);
      for (int64_t pos = 0; pos < len; pos += std::min(bs, kLanes)) {  // 16-token chunks of blocks
        const int64_t j = pos / bs, off = pos % bs, n = std::min({bs - off, kLanes, len - pos});
        const int64_t blk = tp[b * W + j];
        TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id out of range");
        const T* kb = kp + (blk * bs + off) * row + h * D;
        const T* vb = vp + (blk * bs + off) * row + h * D;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t t = n; t < kLanes; ++t) s[g][t] = neg_inf;
        for (int64_t t = 0; t < n; ++t) {
          const T* kt = kb + t * row;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qh + g * D;
            v16f d0 = load(qg) * load_kv(kt);
            for (int64_t d = kLanes; d < D; d += kLanes) d0 += load(qg + d) * load_kv(kt + d);
            s[g][t] = hsum(d0) * scale;
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
            for (int64_t d = 0; d < D; d += kLanes) store(ag + d, load(ag + d) * alpha, kLanes);
            mx[g] = nm;
          }
          const v16f p = exp16(sg - nm);  // lanes past n: e^-inf = 0
          l[g] += hsum(p);
          for (int64_t d = 0; d < D; d += kLanes) {
            v16f a = load(ag + d);
            for (int64_t t = 0; t < n; ++t) a += p[t] * load_kv(vb + t * row + d);
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

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be float (B, Hq, D)");
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == kv &&
              (kv == at::kFloat || kv == at::kHalf) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be float32 or float16 (num_blocks, block_size, Hkv, D)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && context_lens.is_contiguous(), "tables and lengths must be int64");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % kLanes == 0 && D <= kMaxHeadDim, "head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "unsupported head grouping");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.numel() == B, "one block table and length per sequence");
  at::Tensor out = at::empty_like(q);
  if (kv == at::kFloat)
    decode_attention<float>(q, k_cache, v_cache, block_tables, context_lens, static_cast<float>(scale), out);
  else
    decode_attention<at::Half>(q, k_cache, v_cache, block_tables, context_lens, static_cast<float>(scale), out);
  return out;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("paged_decode_attention", &tokenmill::paged_decode_attention); }

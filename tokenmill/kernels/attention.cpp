// Paged decode attention over tokenmill's KV cache (one query token per sequence), K/V read from
// their blocks in place (no gather into a padded batch, no widened copy of the context), float32,
// float16, int8 or fp8 cache (attention.h); prefill over a cached context is context_attention.cpp's.
// And the writing of K/V rows into the cache, in its format (store_kv).
#include <type_traits>
#include <vector>

#include "attention.h"
#include "decode_avx2.h"

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
// The work items of the AVX-512 grouped decode kernel below: (sequence b, KV head h), the G query heads
// sharing h together. Owns the shapes, the checks and where a position's K/V row lies.
template <typename T>
struct DecodeItems {
  const float* q;
  const T *k, *v;
  const int64_t *tables, *lens;
  float* out;
  KvBlocks<T> L;
  int64_t B, Hq, D, Hkv, num_blocks, bs, W, q_stride, row, lines, window;

  DecodeItems(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
              const at::Tensor& context_lens, int64_t window_, at::Tensor& out_)
      : q(q_.data_ptr<float>()), k(kv_data<T>(k_cache)), v(kv_data<T>(v_cache)),
        tables(block_tables.data_ptr<int64_t>()), lens(context_lens.data_ptr<int64_t>()), out(out_.data_ptr<float>()),
        L(k_cache),
        B(q_.size(0)), Hq(q_.size(1)), D(q_.size(2)), Hkv(k_cache.size(2)), num_blocks(k_cache.size(0)),
        bs(k_cache.size(1)), W(block_tables.size(1)), q_stride(q_.stride(0)), row(L.row),
        lines((D * static_cast<int64_t>(sizeof(T)) + 63) / 64), window(window_) {}

  int64_t len(int64_t b) const {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * bs, "context length out of range");
    return lens[b];
  }
  int64_t first(int64_t len) const { return window_start(len, window); }
  // the first of the item's G query rows (rows may be strided: a view into qkv)
  const float* query(int64_t b, int64_t h, int G) const { return q + b * q_stride + h * G * D; }
  float* output(int64_t b, int64_t h, int G) const { return out + (b * Hq + h * G) * D; }
  int64_t block(int64_t b, int64_t pos) const {
    const int64_t blk = tables[b * W + pos / bs];
    TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id out of range");
    return blk;
  }
  // where position pos's K (and V) row for head h starts in the caches; its scale (int8)
  int64_t offset(int64_t b, int64_t h, int64_t pos) const { return L.at(block(b, pos), pos % bs, h); }
  int64_t scale_offset(int64_t b, int64_t h, int64_t pos) const { return L.scale_at(block(b, pos), pos % bs, h); }
  // int8: the scales of n rows from the one at `off` (they follow the block's values: lines of their own)
  void prefetch_scales(int64_t off, int64_t n) const {
    const char *kn = reinterpret_cast<const char*>(k + off), *vn = reinterpret_cast<const char*>(v + off);
    for (int64_t c = 0; c < (n - 1) * L.step + 4; c += 64) _mm_prefetch(kn + c, _MM_HINT_T0), _mm_prefetch(vn + c, _MM_HINT_T0);
    _mm_prefetch(kn + (n - 1) * L.step, _MM_HINT_T0), _mm_prefetch(vn + (n - 1) * L.step, _MM_HINT_T0);
  }
  void prefetch(int64_t off) const {
    const char *kn = reinterpret_cast<const char*>(k + off), *vn = reinterpret_cast<const char*>(v + off);
    for (int64_t c = 0; c < lines; ++c) _mm_prefetch(kn + 64 * c, _MM_HINT_T0), _mm_prefetch(vn + 64 * c, _MM_HINT_T0);
  }
};

// 16 vectors -> one: lane t = the sum of v[t]'s lanes (float32, or int32 lanes cast to floats when
// kInt). A transpose-and-add tree (45 shuffles and adds) instead of 16 horizontal sums (~8 each).
template <bool kInt = false>
inline __m512 reduce16(const __m512* v) {
  const auto add = [](__m512 a, __m512 b) {
    if constexpr (kInt) return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
    else return _mm512_add_ps(a, b);
  };
  __m512 s2[8], s4[4], s8[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i A, v2i+1 A, v2i B, v2i+1 B]
    s2[i] = add(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v4i .. v4i+3
    const __m512d a = _mm512_castps_pd(s2[2 * i]), b = _mm512_castps_pd(s2[2 * i + 1]);
    s4[i] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: [s4[2i] l0+l1, l2+l3, s4[2i+1] l0+l1, l2+l3]
    s8[i] = add(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return add(_mm512_shuffle_f32x4(s8[0], s8[1], _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_f32x4(s8[0], s8[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The int8 cache's keys against a query rounded to int16 (a scale per head: |q| / 32767 keeps 15
// bits, far finer than the keys' 8): 32 products per instruction (VPDPWSSD, or VPMADDWD and an add
// without VNNI) where the float path widens every 16 bytes to floats first. Sums are exact in int32
// (|sum| <= 127 * 32767 * 256 < 2^31). Returns the head's scale, 0 for a zero query.
inline float round_query16(const float* q, int64_t D, int16_t* out) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += kLanes) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(q + d)));
  const float mx = _mm512_reduce_max_ps(m);
  const __m512 inv = _mm512_set1_ps(mx > 0.f ? 32767.f / mx : 0.f);
  for (int64_t d = 0; d < D; d += kLanes)
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + d),
                       _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + d), inv))));
  return mx / 32767.f;
}
inline __m512i dot16(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// acc[g] += sum_t p[g][t] v_t over n int8 value rows (row t at v + t * row; p with the rows' scales in),
// in integers as the keys are: each head's weights rounded to int16 per chunk (15 bits of the
// chunk's largest weight), two tokens' bytes interleaved so that one VPDPWSSD adds both tokens'
// products for 16 lanes; the chunk's int32 sums go back to floats once. acc keeps each 32 lanes of
// a head in the order the interleave leaves them (d 0-7, 16-23, then 8-15, 24-31): the caller
// reorders them once, at the output.
template <int G>
inline void add_int8_values(const KvInt8* v, int64_t row, int64_t n, int64_t D, float (*p)[kLanes], float* acc) {
  int32_t w[G][kLanes / 2];  // the token pairs' two int16 weights
  float ws[G];
  for (int g = 0; g < G; ++g) {
    const __m512 pg = _mm512_load_ps(p[g]);  // lanes past n: 0
    const float mx = _mm512_reduce_max_ps(pg);
    ws[g] = mx / 32767.f;
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(pg, _mm512_set1_ps(mx > 0.f ? 32767.f / mx : 0.f)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w[g]), _mm512_cvtsepi32_epi16(r));
  }
  const auto* vb = reinterpret_cast<const int8_t*>(v);
  for (int64_t c = 0; c < D; c += 32) {
    __m512i lo[G], hi[G];
    for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm512_setzero_si512();
    for (int64_t t = 0; t < n; t += 2) {  // an odd last token pairs with itself under a zero weight
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + t * row + c));
      const __m256i b = t + 1 < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + (t + 1) * row + c)) : a;
      const __m512i l = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, b)), h = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, b));
      for (int g = 0; g < G; ++g) {
        const __m512i wt = _mm512_set1_epi32(w[g][t / 2]);
        lo[g] = dot16(lo[g], l, wt), hi[g] = dot16(hi[g], h, wt);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* a = acc + g * D + c;
      const __m512 s = _mm512_set1_ps(ws[g]);
      _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[g]), s, _mm512_load_ps(a)));
      _mm512_store_ps(a + kLanes, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[g]), s, _mm512_load_ps(a + kLanes)));
    }
  }
}

// decode_attention for AVX-512 and a group of G query heads per KV head (G a compile-time
// constant so that the group's accumulators stay in registers). Per 16-token chunk each K and V
// vector is widened once for all G heads; the G x 16 scores come out of one reduce16 per head;
// the next chunk's rows are prefetched (blocks are scattered, the hardware prefetcher stops at
// each block's end).
template <typename T, int G>
void decode_attention_group(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, float scale,
                            int64_t window, at::Tensor& out) {
  const DecodeItems<T> it(q, k_cache, v_cache, block_tables, context_lens, window, out);
  const int64_t D = it.D, C = D / kLanes, bs = it.bs, row = it.row;
  const bool int_keys = std::is_same_v<T, KvInt8> && D % 32 == 0;  // round_query16's path
  const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  at::parallel_for(0, it.B * it.Hkv, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float acc[G * kMaxHeadDim];
    alignas(64) float p[G][kLanes];
    alignas(64) int16_t q16[G * kMaxHeadDim];
    alignas(64) float sk[kLanes];
    float qs[G];
    __m512 part[G][kLanes];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / it.Hkv, h = item % it.Hkv, len = it.len(b);
      const float* qh = it.query(b, h, G);
      if (int_keys)
        for (int g = 0; g < G; ++g) qs[g] = round_query16(qh + g * D, D, q16 + g * D) * scale;
      std::fill(acc, acc + G * D, 0.f);
      float mx[G], l[G];
      for (int g = 0; g < G; ++g) mx[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f;
      int64_t at = it.offset(b, h, it.first(len)), next_at = 0;
      for (int64_t pos = it.first(len); pos < len; pos += std::min(bs - pos % bs, kLanes), at = next_at) {  // 16-token chunks
        const int64_t n = std::min({bs - pos % bs, kLanes, len - pos}), next = pos + n;
        const T *kb = it.k + at, *vb = it.v + at;
        const int64_t sat = kv_scaled<T> ? it.scale_offset(b, h, pos) : 0;
        if (next < len) {  // the next chunk's rows
          next_at = it.offset(b, h, next);
          const int64_t nn = std::min({bs - next % bs, kLanes, len - next});
          for (int64_t t = 0; t < nn; ++t) it.prefetch(next_at + t * row);
          if constexpr (kv_scaled<T>) it.prefetch_scales(it.scale_offset(b, h, next), nn);
        }
        for (int64_t t = 0; t < kLanes; ++t) {
          if (t >= n) {
            for (int g = 0; g < G; ++g) part[g][t] = _mm512_setzero_ps();
            sk[t] = 0.f;
            continue;
          }
          if constexpr (std::is_same_v<T, KvInt8>) {
            if (int_keys) {
              __m512i d[G];
              for (int g = 0; g < G; ++g) d[g] = _mm512_setzero_si512();
              for (int64_t c = 0; c < D; c += 32) {
                const __m512i k = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kb + t * row + c)));
                for (int g = 0; g < G; ++g) d[g] = dot16(d[g], _mm512_load_si512(q16 + g * D + c), k);
              }
              for (int g = 0; g < G; ++g) part[g][t] = _mm512_castsi512_ps(d[g]);
              sk[t] = kv_scale(it.k + sat + t * it.L.step);
              continue;
            }
          }
          __m512 d[G];
          for (int g = 0; g < G; ++g) d[g] = _mm512_setzero_ps();
          for (int64_t c = 0; c < C; ++c) {
            const __m512 k = __m512(load_kv(kb + t * row + c * kLanes));
            for (int g = 0; g < G; ++g) d[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + g * D + c * kLanes), k, d[g]);
          }
          if constexpr (kv_scaled<T>) {  // the row's scale, once per token (sums are linear in it)
            const __m512 sk = _mm512_set1_ps(kv_scale(it.k + sat + t * it.L.step));
            for (int g = 0; g < G; ++g) d[g] = _mm512_mul_ps(d[g], sk);
          }
          for (int g = 0; g < G; ++g) part[g][t] = d[g];
        }
        const __mmask16 vis = _mm512_cmp_ps_mask(lane, _mm512_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
        for (int g = 0; g < G; ++g) {
          const __m512 sg = int_keys ? _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(reduce16<true>(part[g]))),
                                                     _mm512_mul_ps(_mm512_load_ps(sk), _mm512_set1_ps(qs[g])))
                                     : _mm512_mul_ps(reduce16(part[g]), _mm512_set1_ps(scale));
          const float bmax = _mm512_mask_reduce_max_ps(vis, sg), nm = std::max(mx[g], bmax);
          if (nm > mx[g]) {
            const float alpha = std::exp(mx[g] - nm);  // 0 on the first chunk
            l[g] *= alpha;
            const __m512 a = _mm512_set1_ps(alpha);
            for (int64_t c = 0; c < C; ++c)
              _mm512_store_ps(acc + g * D + c * kLanes, _mm512_mul_ps(_mm512_load_ps(acc + g * D + c * kLanes), a));
            mx[g] = nm;
          }
          const __m512 e = _mm512_maskz_mov_ps(vis, __m512(exp16(v16f(_mm512_sub_ps(sg, _mm512_set1_ps(nm))))));
          l[g] += _mm512_reduce_add_ps(e);
          _mm512_store_ps(p[g], e);
        }
        if constexpr (kv_scaled<T>)  // int8: the V rows' scales ride on the probabilities
          for (int64_t t = 0; t < n; ++t) {
            const float sv = kv_scale(it.v + sat + t * it.L.step);
            for (int g = 0; g < G; ++g) p[g][t] *= sv;
          }
        if constexpr (std::is_same_v<T, KvInt8>) {
          if (int_keys) {
            add_int8_values<G>(vb, row, n, D, p, acc);
            continue;
          }
        }
        for (int64_t c = 0; c < C; ++c) {
          __m512 a[G];
          for (int g = 0; g < G; ++g) a[g] = _mm512_load_ps(acc + g * D + c * kLanes);
          for (int64_t t = 0; t < n; ++t) {
            const __m512 v = __m512(load_kv(vb + t * row + c * kLanes));
            for (int g = 0; g < G; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][t]), v, a[g]);
          }
          for (int g = 0; g < G; ++g) _mm512_store_ps(acc + g * D + c * kLanes, a[g]);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512 inv = _mm512_set1_ps(1.f / l[g]);
        float* o = it.output(b, h, G) + g * D;
        if (int_keys) {  // add_int8_values's lane order back to the head's
          for (int64_t c = 0; c < D; c += 32) {
            const __m512 lo = _mm512_load_ps(acc + g * D + c), hi = _mm512_load_ps(acc + g * D + c + kLanes);
            _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0)), inv));
            _mm512_storeu_ps(o + c + kLanes, _mm512_mul_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2)), inv));
          }
          continue;
        }
        for (int64_t c = 0; c < C; ++c)
          _mm512_storeu_ps(o + c * kLanes, _mm512_mul_ps(_mm512_load_ps(acc + g * D + c * kLanes), inv));
      }
    }
  });
}

#endif

#if defined(__AVX512F__)
// The grouped kernel for groups of up to 8 query heads per KV head; false: use the generic one.
template <typename T>
bool decode_attention_fast(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens, float scale,
                           int64_t window, at::Tensor& out) {
  switch (q.size(1) / k_cache.size(2)) {
#define TOKENMILL_GROUP(g) \
  case g: decode_attention_group<T, g>(q, k_cache, v_cache, block_tables, context_lens, scale, window, out); return true;
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

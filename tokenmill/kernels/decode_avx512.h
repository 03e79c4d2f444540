// AVX-512 decode attention (attention.cpp's decode_attention_fast on the AVX-512 variants): a work
// item per (sequence, KV head), the G query heads sharing the KV head in registers together; the
// int8 cache in integer dot products. The AVX2 variants' kernel is decode_avx2.h's.
#pragma once

#if defined(__AVX512F__)
#include <type_traits>

#include "attention.h"

namespace tokenmill {
namespace avx512 {
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

}  // namespace avx512
}  // namespace tokenmill
#endif

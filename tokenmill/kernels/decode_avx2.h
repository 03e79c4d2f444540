// AVX2 decode attention (attention.cpp's decode_attention_fast on the avx2 and avxvnni variants):
// split over the context, every KV head per work item, merged in a fixed order.
#pragma once

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <vector>

#include "attention.h"

namespace tokenmill {
namespace avx2 {
// AVX2 decode attention, split over the context. A work item is (sequence, run of up to kSplit
// positions) and takes every KV head: a block's rows hold all heads side by side, so the item reads
// each block front to back instead of a third of every row per head, and a long context spreads
// over the threads at batch 1 too. Per head the item computes all its scores (no online rescaling),
// one softmax, then P.V, and leaves (max, sum, unnormalised output) for the merge when the sequence
// has several items. The fp16 rows are widened in registers as the tiles read them (a widened copy
// per chunk cost more than it saved), and the next chunk's rows are prefetched into L2 while one is
// computed (blocks are scattered; into L1, the prefetches stalled on the fill buffers).
// Splits sit at fixed positions (multiples of kSplit), so a sequence's result does not depend on the
// batch, the thread count or which heads a tensor-parallel rank holds (tests/test_tensor_parallel.py
// compares logprobs bit for bit).
// Register tiles: scores for 3 heads x 4 tokens (12 FMA chains over D), P.V for 3 heads x 16 outputs.
constexpr int64_t kSplit = 128, kDecodeChunk = 16;  // positions per item; per chunk (within one block)

// 4 vectors -> 4 lanes: lane i = the sum of a[i]'s lanes
inline __m128 reduce4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// s[g][t] = scale * q_g . k_t for GT heads and TT (4 or 1) tokens; k rows (cache dtype) at stride ld,
// each 8-element piece widened once for the GT heads
template <int GT, int TT, typename T>
void score_tile(const float* q, int64_t D, const T* k, int64_t ld, float scale, const T* ks, int64_t kstep, float* s,
                int64_t lds) {
  __m256 acc[GT][TT];
  for (int g = 0; g < GT; ++g)
    for (int t = 0; t < TT; ++t) acc[g][t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8)
    for (int t = 0; t < TT; ++t) {
      const __m256 kv = load_kv8(k + t * ld + c);
      for (int g = 0; g < GT; ++g) acc[g][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c), kv, acc[g][t]);
    }
  if constexpr (TT == 4) {
    __m128 sc = _mm_set1_ps(scale);
    if constexpr (kv_scaled<T>)  // int8: the 4 rows' scales (ks: the first's, kstep apart)
      sc = _mm_mul_ps(sc, _mm_setr_ps(kv_scale(ks), kv_scale(ks + kstep), kv_scale(ks + 2 * kstep), kv_scale(ks + 3 * kstep)));
    for (int g = 0; g < GT; ++g) _mm_storeu_ps(s + g * lds, _mm_mul_ps(reduce4(acc[g]), sc));
  } else {
    const float sc = kv_scaled<T> ? scale * kv_scale(ks) : scale;
    for (int g = 0; g < GT; ++g) s[g * lds] = hsum8(acc[g][0]) * sc;
  }
}

template <int GT, typename T>
void score_heads(const float* q, int64_t D, const T* k, int64_t ld, int64_t m, float scale, const T* ks, int64_t kstep,
                 float* s, int64_t lds) {
  int64_t t = 0;
  for (; t + 4 <= m; t += 4) score_tile<GT, 4>(q, D, k + t * ld, ld, scale, ks + t * kstep, kstep, s + t, lds);
  for (; t < m; ++t) score_tile<GT, 1>(q, D, k + t * ld, ld, scale, ks + t * kstep, kstep, s + t, lds);
}

// o[g][0 .. 16) += sum_t p[g][t] v_t[0 .. 16) for GT heads, n tokens (v rows, cache dtype, at stride ld)
template <int GT, typename T>
void pv_tile(const float* p, int64_t ldp, const T* v, int64_t ld, int64_t n, float* o, int64_t D) {
  __m256 acc[GT][2];
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < 2; ++j) acc[g][j] = _mm256_loadu_ps(o + g * D + 8 * j);
  for (int64_t t = 0; t < n; ++t) {
    __m256 pg[GT];
    for (int g = 0; g < GT; ++g) pg[g] = _mm256_broadcast_ss(p + g * ldp + t);
    for (int j = 0; j < 2; ++j) {
      const __m256 vv = load_kv8(v + t * ld + 8 * j);
      for (int g = 0; g < GT; ++g) acc[g][j] = _mm256_fmadd_ps(pg[g], vv, acc[g][j]);
    }
  }
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(o + g * D + 8 * j, acc[g][j]);
}

template <int GT, typename T>
void pv_heads(const float* p, int64_t ldp, const T* v, int64_t ld, int64_t n, float* o, int64_t D) {
  for (int64_t c = 0; c < D; c += 16) pv_tile<GT, T>(p, ldp, v + c, ld, n, o + c, D);  // D: a multiple of 16
}

template <typename T>
void decode_attention_split(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, float scale,
                            int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2), W = block_tables.size(1);
  const KvBlocks<T> L(k_cache);
  const int64_t G = Hq / Hkv, row = L.row, q_stride = q.stride(0);
  const float* qp = q.data_ptr<float>();
  const T *kp = kv_data<T>(k_cache), *vp = kv_data<T>(v_cache);
  const int64_t *tp = block_tables.data_ptr<int64_t>(), *lp = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // items: every sequence's runs of positions [first, len) cut at multiples of kSplit
  std::vector<int64_t> item0(B + 1, 0);  // sequence b's items: [item0[b], item0[b + 1])
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lp[b];
    TORCH_CHECK(len >= 1 && len <= W * bs, "context length out of range");
    item0[b + 1] = item0[b] + (len - 1) / kSplit - window_start(len, window) / kSplit + 1;
  }
  const int64_t items = item0[B];
  // per item and query head: max, sum, unnormalised output (read by the merge below)
  std::vector<float> parts(items > B ? items * Hq * (D + 2) : 0);
  const int nt = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    const int64_t lds = kSplit + 8;
    std::vector<float> s(Hq * lds), o(Hq * D), mx(Hq), sum(Hq);
    for (int64_t tid = t0; tid < t1; ++tid) {
      int64_t b = 0;
      for (int64_t item = tid; item < items; item += nt) {  // interleaved: a long sequence's runs spread
        while (item >= item0[b + 1]) ++b;
        const int64_t len = lp[b], first = window_start(len, window);
        const int64_t p0 = std::max(first, (first / kSplit + item - item0[b]) * kSplit);
        const int64_t p1 = std::min(len, (p0 / kSplit + 1) * kSplit), n = p1 - p0;
        const float* qb = qp + b * q_stride;
        // chunks: positions [pos, pos + m) within one block
        auto block_of = [&](int64_t pos) {
          const int64_t blk = tp[b * W + pos / bs];
          TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id out of range");
          return blk;
        };
        auto chunk_at = [&](const T* cache, int64_t pos) { return cache + L.at(block_of(pos), pos % bs, 0); };
        // int8: head h's scale of the chunk's token t at [h * L.hstep + t * L.step]
        auto scales_at = [&](const T* cache, int64_t pos) { return cache + L.scale_at(block_of(pos), pos % bs, 0); };
        auto chunk_len = [&](int64_t pos) { return std::min({bs - pos % bs, kDecodeChunk, p1 - pos}); };
        auto for_chunks = [&](const T* cache, auto&& body) {
          const T* src = chunk_at(cache, p0);
          for (int64_t pos = p0; pos < p1;) {
            const int64_t m = chunk_len(pos), next = pos + m;
            const T* after = next < p1 ? chunk_at(cache, next) : nullptr;
            if (after) {  // the next chunk's rows, into L2, while this one is computed
              const char* a = reinterpret_cast<const char*>(after);
              const int64_t bytes = chunk_len(next) * row * static_cast<int64_t>(sizeof(T));
              for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(a + c, _MM_HINT_T1);
              if constexpr (kv_scaled<T>) {  // and their scales (int8), after the block's values: a run per head
                const T* sc = scales_at(cache, next);
                const int64_t last = (chunk_len(next) - 1) * L.step;
                for (int64_t h = 0; h < Hkv; ++h)
                  _mm_prefetch(reinterpret_cast<const char*>(sc + h * L.hstep), _MM_HINT_T1),
                      _mm_prefetch(reinterpret_cast<const char*>(sc + h * L.hstep + last), _MM_HINT_T1);
              }
            }
            body(src, pos - p0, pos, m);
            pos = next, src = after;
          }
        };
        for_chunks(kp, [&](const T* kc, int64_t at, int64_t pos, int64_t m) {
          const T* ks = kv_scaled<T> ? scales_at(kp, pos) : kc;  // int8: head h's scales from ks + L.hstep h
          for (int64_t h = 0; h < Hkv; ++h)
            for (int64_t g = 0; g < G;) {
              const float* qg = qb + (h * G + g) * D;
              float* sg = s.data() + (h * G + g) * lds + at;
              const T *kr = kc + h * D, *kh = ks + h * L.hstep;
              if (G - g >= 3) score_heads<3>(qg, D, kr, row, m, scale, kh, L.step, sg, lds), g += 3;
              else if (G - g == 2) score_heads<2>(qg, D, kr, row, m, scale, kh, L.step, sg, lds), g += 2;
              else score_heads<1>(qg, D, kr, row, m, scale, kh, L.step, sg, lds), g += 1;
            }
        });
        float* stats = parts.empty() ? nullptr : parts.data() + item * Hq * (D + 2);
        for (int64_t hq = 0; hq < Hq; ++hq) {  // softmax over the item's scores, in place
          float* sh = s.data() + hq * lds;
          __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
          int64_t i = 0;
          for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(sh + i));
          float m1 = hmax8(m8);
          for (int64_t j = i; j < n; ++j) m1 = std::max(m1, sh[j]);
          __m256 l8 = _mm256_setzero_ps();
          const __m256 mv = _mm256_set1_ps(m1), lane = _mm256_set_ps(7, 6, 5, 4, 3, 2, 1, 0);
          for (i = 0; i < n; i += 8) {  // lanes past n: 0 (their scores are stale)
            const __m256 vis = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n - i)), _CMP_LT_OQ);
            const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + i), mv)), vis);
            l8 = _mm256_add_ps(l8, e);
            _mm256_storeu_ps(sh + i, e);
          }
          mx[hq] = m1, sum[hq] = hsum8(l8);
        }
        std::fill(o.begin(), o.end(), 0.f);
        for_chunks(vp, [&](const T* vc, int64_t at, int64_t pos, int64_t m) {
          if constexpr (kv_scaled<T>) {  // int8: each token's V scale on its probabilities (summed above already)
            const T* vs = scales_at(vp, pos);
            for (int64_t h = 0; h < Hkv; ++h) {
              alignas(32) float sv[kDecodeChunk];
              for (int64_t t = 0; t < m; ++t) sv[t] = kv_scale(vs + h * L.hstep + t * L.step);
              for (int64_t hq = h * G; hq < (h + 1) * G; ++hq) {
                float* ph = s.data() + hq * lds + at;  // past m: the next chunk's
                int64_t t = 0;
                for (; t + 8 <= m; t += 8) _mm256_storeu_ps(ph + t, _mm256_mul_ps(_mm256_loadu_ps(ph + t), _mm256_load_ps(sv + t)));
                for (; t < m; ++t) ph[t] *= sv[t];
              }
            }
          }
          for (int64_t h = 0; h < Hkv; ++h)
            for (int64_t g = 0; g < G;) {
              const int64_t hq = h * G + g;
              const float* ph = s.data() + hq * lds + at;
              const T* vr = vc + h * D;
              if (G - g >= 3) pv_heads<3>(ph, lds, vr, row, m, o.data() + hq * D, D), g += 3;
              else if (G - g == 2) pv_heads<2>(ph, lds, vr, row, m, o.data() + hq * D, D), g += 2;
              else pv_heads<1>(ph, lds, vr, row, m, o.data() + hq * D, D), g += 1;
            }
        });
        const bool alone = item0[b + 1] - item0[b] == 1;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* oh = o.data() + hq * D;
          if (alone) {
            const __m256 inv = _mm256_set1_ps(1.f / sum[hq]);
            float* dst = op + (b * Hq + hq) * D;
            for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_loadu_ps(oh + c), inv));
          } else {
            float* st = stats + hq * (D + 2);
            st[0] = mx[hq], st[1] = sum[hq];
            std::memcpy(st + 2, oh, sizeof(float) * D);
          }
        }
      }
    }
  });
  if (parts.empty()) return;
  // merge a sequence's items: out = sum_i e^(m_i - M) o_i / sum_i e^(m_i - M) l_i, in item order
  at::parallel_for(0, B * Hq, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / Hq, hq = r % Hq;
      if (item0[b + 1] - item0[b] == 1) continue;
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t i = item0[b]; i < item0[b + 1]; ++i) M = std::max(M, parts[(i * Hq + hq) * (D + 2)]);
      float* dst = op + r * D;
      std::fill(dst, dst + D, 0.f);
      float l = 0.f;
      for (int64_t i = item0[b]; i < item0[b + 1]; ++i) {
        const float* st = parts.data() + (i * Hq + hq) * (D + 2);
        const float w = std::exp(st[0] - M);
        l += w * st[1];
        const __m256 wv = _mm256_set1_ps(w);
        for (int64_t c = 0; c < D; c += 8)
          _mm256_storeu_ps(dst + c, _mm256_fmadd_ps(wv, _mm256_loadu_ps(st + 2 + c), _mm256_loadu_ps(dst + c)));
      }
      const __m256 inv = _mm256_set1_ps(1.f / l);
      for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_loadu_ps(dst + c), inv));
    }
  });
}

}  // namespace avx2
}  // namespace tokenmill
#endif

// What the decode and the context attention kernels share (attention.cpp, context_attention.cpp).
#pragma once

#include "ops.h"

namespace tokenmill {

// 16 cache elements -> 16 floats: float32 as is, float16 widened (F16C on x86).
inline v16f load_kv(const float* p) { return load(p); }
inline v16f load_kv(const at::Half* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__)
  return join(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
#else
  v16f v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 cache elements -> 8 floats (the AVX2 paths' half vectors).
inline __m256 load_kv8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_kv8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

#if defined(__AVX512F__)
// r[i][j] -> r[j][i] for a 16 x 16 block of 32-bit elements in registers (64 shuffles): the context
// kernel's key transpose, and the AMX one's (bfloat16 pairs as 32-bit words).
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of single elements
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks: pairs
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 8; i += 4)  // 128-bit lanes, across rows 4 apart
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[2 * i + j], r[2 * i + j + 4], 0x88);
      t[i + j + 8] = _mm512_shuffle_f32x4(r[2 * i + j], r[2 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 4; ++j) {  // 128-bit lanes, across rows 8 apart
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 4], 0x88);
    r[j + 4] = _mm512_shuffle_f32x4(t[j + 8], t[j + 12], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 4], 0xdd);
    r[j + 12] = _mm512_shuffle_f32x4(t[j + 8], t[j + 12], 0xdd);
  }
}
#endif

constexpr int64_t kMaxGroup = 16, kMaxHeadDim = 256;

// A sliding-window layer (window > 0) starts at position len - window: the blocks before it are
// never read (they may have been handed back).
inline int64_t window_start(int64_t len, int64_t window) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }

inline void check_heads(const at::Tensor& q, const at::Tensor& k_cache) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float (T, Hq, D), each row's heads contiguous");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % kLanes == 0 && D <= kMaxHeadDim, "head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "unsupported head grouping");
}

}  // namespace tokenmill

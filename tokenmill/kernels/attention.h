// What the decode and the context attention kernels share (attention.cpp, context_attention.cpp).
#pragma once

#include <c10/util/Float8_e5m2.h>

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

// The 8-bit caches (--kv-cache-dtype int8 | fp8_e5m2). int8: a float32 scale per row (one
// position's head: x = q * s, s = max|x| / 127 over the row). A block keeps its bs x Hkv rows of D
// int8 values first, as a float16 cache keeps its rows, then the scales, so rows stay on
// the same cache-line boundaries as the other caches' (rows of D + 4 bytes would straddle two lines
// each and cost a third of the decode kernel's speed). The scales lie head by head (Hkv x bs): a
// KV head's 16 positions share one cache line, where position-major scales spread them over 8
// lines for 8 KV heads — a third more lines per decode step than the values alone, for one item
// (sequence, KV head) that reads one head. The tensor is int8 (num_blocks, block_size,
// Hkv, D + 4): the block's bytes, not its layout. fp8_e5m2: float16's top byte, no scale, widened by
// a shift (torch.float8_e5m2 (..., D)).
constexpr int64_t kMaxGroup = 16, kMaxHeadDim = 256;

struct KvInt8 { int8_t q; };
struct KvFp8 { uint8_t b; };
template <typename T> constexpr int64_t kv_pad = 0;  // the scale's elements per row (after the block's values)
template <> constexpr int64_t kv_pad<KvInt8> = 4;
template <typename T> constexpr bool kv_scaled = kv_pad<T> > 0;
template <typename T>
inline float kv_scale(const T* p) {
  float s;
  std::memcpy(&s, p, sizeof(float));
  return s;
}

// A head size from a cache's last dimension: less an int8 cache's scale bytes.
inline int64_t cache_head_dim(const at::Tensor& cache) { return cache.size(3) - (cache.scalar_type() == at::kChar ? 4 : 0); }

// Where a cache's rows lie, in elements from its start: position `off` of block `blk`, head h;
// the row's scale (int8): consecutive positions' scales `step` elements apart, heads' `hstep`.
template <typename T>
struct KvBlocks {
  int64_t bs, Hkv, D, row, block, step, hstep;
  KvBlocks(int64_t bs_, int64_t Hkv_, int64_t D_)
      : bs(bs_), Hkv(Hkv_), D(D_), row(Hkv_ * D_), block(bs_ * Hkv_ * (D_ + kv_pad<T>)), step(kv_pad<T>),
        hstep(kv_pad<T> * bs_) {}
  explicit KvBlocks(const at::Tensor& cache) : KvBlocks(cache.size(1), cache.size(2), cache_head_dim(cache)) {}
  int64_t at(int64_t blk, int64_t off, int64_t h) const { return blk * block + off * row + h * D; }
  int64_t scale_at(int64_t blk, int64_t off, int64_t h) const { return blk * block + bs * row + h * hstep + off * step; }
};

inline v16f load_kv(const KvInt8* p) { return bytes(reinterpret_cast<const int8_t*>(p)); }
inline v16f load_kv(const KvFp8* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8));
#elif defined(__AVX2__)
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  return join(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
#else
  v16f v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(c10::Float8_e5m2(p[i].b, c10::Float8_e5m2::from_bits()));
  return v;
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 cache elements -> 8 floats (the AVX2 paths' half vectors).
inline __m256 load_kv8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_kv8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load_kv8(const KvInt8* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p))); }
inline __m256 load_kv8(const KvFp8* p) { return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(load8(p)), 8)); }
#endif

// One head row of D floats into the cache's format, as torch's rounding does (nearest even): float16
// and fp8 by conversion, int8 by its row scale, written at `scale` (a row of zeros gets scale 0).
inline void store_kv_row(const float* x, int64_t D, float* dst, float*) { std::memcpy(dst, x, sizeof(float) * D); }
inline void store_kv_row(const float* x, int64_t D, at::Half* dst, at::Half*) {
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<at::Half>(x[i]);
}
inline void store_kv_row(const float* x, int64_t D, KvFp8* dst, KvFp8*) {
  for (int64_t i = 0; i < D; ++i) dst[i].b = c10::Float8_e5m2(x[i]).x;
}
inline void store_kv_row(const float* x, int64_t D, KvInt8* dst, KvInt8* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax / 127.f;
  for (int64_t i = 0; i < D; ++i)
    dst[i].q = static_cast<int8_t>(s > 0.f ? std::max(-127.f, std::min(127.f, std::nearbyint(x[i] / s))) : 0.f);
  std::memcpy(scale, &s, sizeof(float));
}

// Each token's K and V rows (Hkv heads of D floats, token rows at strides ldk/ldv) into its cache
// slot (block slot / bs, position slot % bs). k_smooth (Hkv x D, or null): K divided by it channel by
// channel before it is rounded (int8 caches: models/kv_smoothing.py).
template <typename T>
void store_kv_rows(const float* k, const float* v, int64_t ldk, int64_t ldv, const int64_t* slots, int64_t B,
                   const KvBlocks<T>& L, int64_t num_slots, T* kc, T* vc, const float* k_smooth = nullptr) {
  float ks[kMaxHeadDim];
  for (int64_t b = 0; b < B; ++b) {
    const int64_t slot = slots[b];
    TORCH_CHECK(slot >= 0 && slot < num_slots, "cache slot out of range");
    const int64_t blk = slot / L.bs, off = slot % L.bs;
    for (int64_t h = 0; h < L.Hkv; ++h) {
      const int64_t at = L.at(blk, off, h), sat = L.scale_at(blk, off, h);
      const float* kr = k + b * ldk + h * L.D;
      if (k_smooth) {
        for (int64_t i = 0; i < L.D; ++i) ks[i] = kr[i] / k_smooth[h * L.D + i];
        kr = ks;
      }
      store_kv_row(kr, L.D, kc + at, kc + sat);
      store_kv_row(v + b * ldv + h * L.D, L.D, vc + at, vc + sat);
    }
  }
}

// Calls f(T{}) with T the element type of the caches (float, at::Half, KvInt8, KvFp8).
template <typename F>
void with_kv_type(const at::Tensor& cache, F&& f) {
  switch (cache.scalar_type()) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kChar: f(KvInt8{}); break;
    case at::kFloat8_e5m2: f(KvFp8{}); break;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", cache.scalar_type());
  }
}
template <typename T>
const T* kv_data(const at::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
template <typename T>
T* kv_data_mut(at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

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


// A sliding-window layer (window > 0) starts at position len - window: the blocks before it are
// never read (they may have been handed back).
inline int64_t window_start(int64_t len, int64_t window) { return window > 0 ? std::max<int64_t>(0, len - window) : 0; }

inline void check_heads(const at::Tensor& q, const at::Tensor& k_cache) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be float (T, Hq, D), each row's heads contiguous");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(cache_head_dim(k_cache) == D && D % kLanes == 0 && D <= kMaxHeadDim,
              "head_dim must be a multiple of 16, <= 256 (an int8 cache's rows: D + 4 bytes)");
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "unsupported head grouping");
}

}  // namespace tokenmill

// Shared by tokenmill's CPU kernels: 16-float vectors (one AVX-512 register, two AVX2 ones) written
// with GCC/Clang vector extensions, and the few loads and reductions that need intrinsics, for
// AVX-512 and for AVX2 (the two halves of a v16f are two ymm registers: split/join are free).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace tokenmill {

constexpr int64_t kLanes = 16;
// 16 float lanes, as values. Memory goes through v16u (aligned(4) + may_alias: unaligned loads and
// stores): a value type with alignment 4 makes GCC keep AVX2 pairs of ymm on the stack.
typedef float v16f __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t v16si __attribute__((vector_size(64)));

#if defined(__AVX512F__)
constexpr int kRowTile = 8;  // 8 rows x 2 accumulators + weights fit 32 zmm registers
#else
constexpr int kRowTile = 4;  // AVX2: 16 ymm registers
#endif

inline v16f load(const float* p) { return *reinterpret_cast<const v16u*>(p); }

#if defined(__AVX2__)
inline v16f join(__m256 a, __m256 b) { return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline __m256 low8(v16f v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
inline __m256 high8(v16f v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
inline __m128i load8(const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
// 8 lanes -> their sum / maximum
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

// A scalar in all 16 lanes. Write it out in hot loops: without AVX-512, GCC builds `scalar * v16f`
// through the stack (context attention then ran an order of magnitude slower on AVX2).
inline v16f splat(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX2__)
  const __m256 v = _mm256_set1_ps(x);
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
#else
  return v16f{} + x;
#endif
}

inline void store(float* p, v16f v, int n) {
  if (n == kLanes) *reinterpret_cast<v16u*>(p) = v;
  else std::memcpy(p, &v, sizeof(float) * n);
}

// 16 bytes -> the 16 low nibbles and the 16 high nibbles, as floats.
inline void nibbles(const uint8_t* p, v16f& lo, v16f& hi) {
#if defined(__AVX512F__)
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
#elif defined(__AVX2__)
  const __m256i q0 = _mm256_cvtepu8_epi32(load8(p)), q1 = _mm256_cvtepu8_epi32(load8(p + 8)), f = _mm256_set1_epi32(15);
  lo = join(_mm256_cvtepi32_ps(_mm256_and_si256(q0, f)), _mm256_cvtepi32_ps(_mm256_and_si256(q1, f)));
  hi = join(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)));
#else
  for (int i = 0; i < kLanes; ++i) {
    lo[i] = static_cast<float>(p[i] & 15);
    hi[i] = static_cast<float>(p[i] >> 4);
  }
#endif
}

// 16 signed bytes -> 16 floats.
inline v16f bytes(const int8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p))), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(p + 8))));
#else
  v16f v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline float hsum(v16f v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#elif defined(__AVX2__)
  return hsum8(_mm256_add_ps(low8(v), high8(v)));
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// exp16 below for 8 lanes, in intrinsics: GCC lowers the 64-byte vector extension's compares and
// selects to scalar code on AVX2 (each lane through the stack), so the AVX2 build spells them out.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x));  // NaN stays NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x));
  __m256 p = _mm256_set1_ps(1.3981999e-3f);
  for (const float c : {8.3334519e-3f, 4.1665795e-2f, 1.6666666e-1f, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// e^x for 16 lanes: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial (relative error
// ~2e-7, as good as expf for softmax); x below -87 gives ~0, above 88 e^88.
inline v16f exp16(v16f x) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  return join(exp8(low8(x)), exp8(high8(x)));
#else
  const v16f lo = v16f{} - 87.f, hi = v16f{} + 88.f;
  x = x < lo ? lo : x;  // lane-wise select
  x = x > hi ? hi : x;  // e^88 ~ 1.7e38: past it the exponent bits would overflow
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
#endif
}

#if defined(__AVX2__)
// One register of floats at the ISA's width (zmm; ymm on AVX2), for register tiles: a tile written as
// an array of v16f makes GCC keep AVX2's ymm halves on the stack and rebuild each vector lane by
// lane (LoRA's tile ran 10x slower so). VecW tiles compute the same FMA chains on either ISA.
#if defined(__AVX512F__)
using VecW = __m512;
constexpr int64_t kW = 16;
inline VecW load_w(const float* p) { return _mm512_loadu_ps(p); }
inline VecW load_w(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VecW zero_w() { return _mm512_setzero_ps(); }
inline VecW splat_w(const float* p) { return _mm512_set1_ps(*p); }
inline VecW fma_w(VecW a, VecW b, VecW c) { return _mm512_fmadd_ps(a, b, c); }
inline VecW mul_w(VecW a, VecW b) { return _mm512_mul_ps(a, b); }
inline VecW add_w(VecW a, VecW b) { return _mm512_add_ps(a, b); }
inline VecW sub_w(VecW a, VecW b) { return _mm512_sub_ps(a, b); }
inline VecW max_w(VecW a, VecW b) { return _mm512_max_ps(a, b); }
inline VecW exp_w(VecW x) { return __m512(exp16(v16f(x))); }
inline float hsum_w(VecW v) { return _mm512_reduce_add_ps(v); }
inline float hmax_w(VecW v) { return _mm512_reduce_max_ps(v); }
inline void store_w(float* p, VecW v) { _mm512_storeu_ps(p, v); }
#else
using VecW = __m256;
constexpr int64_t kW = 8;
inline VecW load_w(const float* p) { return _mm256_loadu_ps(p); }
inline VecW load_w(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VecW zero_w() { return _mm256_setzero_ps(); }
inline VecW splat_w(const float* p) { return _mm256_broadcast_ss(p); }
inline VecW fma_w(VecW a, VecW b, VecW c) { return _mm256_fmadd_ps(a, b, c); }
inline VecW mul_w(VecW a, VecW b) { return _mm256_mul_ps(a, b); }
inline VecW add_w(VecW a, VecW b) { return _mm256_add_ps(a, b); }
inline VecW sub_w(VecW a, VecW b) { return _mm256_sub_ps(a, b); }
inline VecW max_w(VecW a, VecW b) { return _mm256_max_ps(a, b); }
inline VecW exp_w(VecW x) { return exp8(x); }
inline float hsum_w(VecW v) { return hsum8(v); }
inline float hmax_w(VecW v) { return hmax8(v); }
inline void store_w(float* p, VecW v) { _mm256_storeu_ps(p, v); }
#endif
template <typename W>
inline VecW load_w_n(const W* p, int64_t n) {  // zeros past n (none at all for n <= 0)
  if (n >= kW) return load_w(p);
  W buf[kW] = {};
  if (n > 0) std::memcpy(buf, p, sizeof(W) * n);
  return load_w(buf);
}
inline void store_w_n(float* p, VecW v, int64_t n) {
  if (n >= kW) return store_w(p, v);
  if (n > 0) std::memcpy(p, &v, sizeof(float) * n);
}
#endif

}  // namespace tokenmill

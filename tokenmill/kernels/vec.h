// Shared by tokenmill's CPU kernels: 16-float vectors (one AVX-512 register, two AVX2 ones) written
// with GCC/Clang vector extensions, and the few loads that need intrinsics.
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
// 16 float lanes; aligned(4) + may_alias make plain dereferences unaligned loads/stores.
typedef float v16f __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t v16si __attribute__((vector_size(64)));

#if defined(__AVX512F__)
constexpr int kRowTile = 8;  // 8 rows x 2 accumulators + weights fit 32 zmm registers
#else
constexpr int kRowTile = 4;  // AVX2: 16 ymm registers
#endif

inline v16f load(const float* p) { return *reinterpret_cast<const v16f*>(p); }

inline void store(float* p, v16f v, int n) {
  if (n == kLanes) *reinterpret_cast<v16f*>(p) = v;
  else std::memcpy(p, &v, sizeof(float) * n);
}

// 16 bytes -> the 16 low nibbles and the 16 high nibbles, as floats.
inline void nibbles(const uint8_t* p, v16f& lo, v16f& hi) {
#if defined(__AVX512F__)
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
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
#else
  v16f v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

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
// ~2e-7, as good as expf for softmax); x below -87 gives ~0, above 88 e^88.
inline v16f exp16(v16f x) {
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
}

}  // namespace tokenmill

// tokenmill's CPU kernels: weight-only int4/int8 linear layers and paged decode attention.
//
// Written with GCC/Clang vector extensions (16 float lanes: one AVX-512 register, two AVX2 ones),
// compiled for the host (-march=native) on first use. Threads come from ATen's pool, so
// torch.set_num_threads / --threads govern them too. Owns arithmetic only: shapes and layouts are
// checked here, policy (when to call which kernel) lives in the Python layers.
//
// Weight layout, "panels" of 16 output rows (N padded to a multiple of 16 with zero rows):
//
//   int4  q   uint8 (P, K/2, 16)  byte [p, j, i] = q[16p+i, 2j] | q[16p+i, 2j+1] << 4
//         s,m float (P, K/g, 16)  w[n, k] = q[n, k] * s[n, k/g] + m[n, k/g]
//   int8  q   int8  (P, K, 16)    w[n, k] = q[16p+i, k] * s[n]
//         s   float (P*16,)
//
// so one 16-byte load gives two input columns of 16 output rows: dequantized once into two
// vectors and reused by every row of x in the tile (a GEMM with weight reuse, not a GEMV per
// row). Arithmetic is float32 throughout: the result equals dequantize + matmul up to summation
// order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace {

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

// One tile: `MT` rows of x times one 16-row int4 panel. Even and odd columns accumulate
// separately so that a single row still has two independent FMA chains.
template <int MT>
void int4_tile(const float* x, int64_t ldx, const uint8_t* q, const float* s, const float* m,
               int64_t K, int64_t group, float* y, int64_t ldy, int nvalid) {
  v16f acc[MT][2];
  for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = v16f{};
  const int64_t ngroups = K / group;
  for (int64_t g = 0; g < ngroups; ++g) {
    const v16f sc = load(s + g * kLanes), mn = load(m + g * kLanes);
    for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
      v16f lo, hi;
      nibbles(q + k * (kLanes / 2), lo, hi);
      const v16f w0 = lo * sc + mn, w1 = hi * sc + mn;
      for (int r = 0; r < MT; ++r) {
        acc[r][0] += w0 * x[r * ldx + k];
        acc[r][1] += w1 * x[r * ldx + k + 1];
      }
    }
  }
  for (int r = 0; r < MT; ++r) store(y + r * ldy, acc[r][0] + acc[r][1], nvalid);
}

template <int MT>
void int8_tile(const float* x, int64_t ldx, const int8_t* q, const float* s, int64_t K, float* y,
               int64_t ldy, int nvalid) {
  v16f acc[MT][2];
  for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = v16f{};
  for (int64_t k = 0; k < K; k += 2) {
    const v16f w0 = bytes(q + k * kLanes), w1 = bytes(q + (k + 1) * kLanes);
    for (int r = 0; r < MT; ++r) {
      acc[r][0] += w0 * x[r * ldx + k];
      acc[r][1] += w1 * x[r * ldx + k + 1];
    }
  }
  const v16f sc = load(s);
  for (int r = 0; r < MT; ++r) store(y + r * ldy, (acc[r][0] + acc[r][1]) * sc, nvalid);
}

// Calls tile<MT> for a full tile and tile<rows> for the remainder, which is < kRowTile.
template <template <int> class Tile, typename... Args>
void dispatch_rows(int rows, Args... args) {
  switch (rows) {
    case 1: Tile<1>::run(args...); break;
    case 2: Tile<2>::run(args...); break;
    case 3: Tile<3>::run(args...); break;
    case 4: Tile<4>::run(args...); break;
#if defined(__AVX512F__)
    case 5: Tile<5>::run(args...); break;
    case 6: Tile<6>::run(args...); break;
    case 7: Tile<7>::run(args...); break;
    case 8: Tile<8>::run(args...); break;
#endif
    default: TORCH_CHECK(false, "row tile out of range");
  }
}

template <int MT>
struct Int4Tile {
  template <typename... A>
  static void run(A... a) { int4_tile<MT>(a...); }
};

template <int MT>
struct Int8Tile {
  template <typename... A>
  static void run(A... a) { int8_tile<MT>(a...); }
};

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be (M, ", K, "), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
}

// Panels split across threads; each walks all rows of x, kRowTile at a time, so a panel's
// weights (K/2 * 16 bytes) stay in L1 while x streams from L2.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const at::Tensor& m,
                       int64_t N) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.size(2) == kLanes && q.is_contiguous(),
              "int4 weights must be uint8 (P, K/2, 16)");
  const int64_t P = q.size(0), K = q.size(1) * 2, G = s.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 2 == 0, "group size must be even and divide K");
  TORCH_CHECK(s.sizes() == m.sizes() && s.size(0) == P && s.is_contiguous() && m.is_contiguous() &&
              s.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat, "scales/mins must be float (P, G, 16)");
  TORCH_CHECK(N > (P - 1) * kLanes && N <= P * kLanes, "N does not match the panels");
  check_x(x, K);
  const int64_t M = x.size(0), group = K / G;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int nvalid = static_cast<int>(std::min<int64_t>(kLanes, N - p * kLanes));
      for (int64_t r = 0; r < M; r += kRowTile) {
        dispatch_rows<Int4Tile>(static_cast<int>(std::min<int64_t>(kRowTile, M - r)), xp + r * K, K,
                                qp + p * K * (kLanes / 2), sp + p * G * kLanes, mp + p * G * kLanes,
                                K, group, yp + r * N + p * kLanes, N, nvalid);
      }
    }
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t N) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kChar && q.size(2) == kLanes && q.is_contiguous(),
              "int8 weights must be int8 (P, K, 16)");
  const int64_t P = q.size(0), K = q.size(1);
  TORCH_CHECK(K % 2 == 0, "K must be even");
  TORCH_CHECK(s.numel() == P * kLanes && s.scalar_type() == at::kFloat && s.is_contiguous(),
              "scales must be float (P*16,)");
  TORCH_CHECK(N > (P - 1) * kLanes && N <= P * kLanes, "N does not match the panels");
  check_x(x, K);
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int nvalid = static_cast<int>(std::min<int64_t>(kLanes, N - p * kLanes));
      for (int64_t r = 0; r < M; r += kRowTile) {
        dispatch_rows<Int8Tile>(static_cast<int>(std::min<int64_t>(kRowTile, M - r)), xp + r * K, K,
                                qp + p * K * kLanes, sp + p * kLanes, K, yp + r * N + p * kLanes,
                                N, nvalid);
      }
    }
  });
  return y;
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

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("int4_linear(Tensor x, Tensor q, Tensor s, Tensor m, int N) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor s, int N) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("paged_decode_attention", &paged_decode_attention);
}

// Weight-only int4/int8 linear layers: y = x W^T with W stored quantized.
//
// Compiled on first use for one ISA variant (build.py). Threads come from ATen's pool, so
// torch.set_num_threads / --threads govern them too. Owns arithmetic only: shapes and layouts are
// checked here, policy (when to call which kernel) lives in the Python layers.
//
// Weights come in "panels" of 16 output rows (N padded to a multiple of 16 with zero rows), in one
// of two layouts: the dot layout wherever K (and the int4 group) is a multiple of 32, else the float one.
//
// float layout: x stays float32, the weights are widened to float32.
//   int4  q   uint8 (P, K/2, 16)  byte [p, j, i] = q[16p+i, 2j] | q[16p+i, 2j+1] << 4
//         s,m float (P, K/g, 16)  w[n, k] = q[n, k] * s[n, k/g] + m[n, k/g]
//   int8  q   int8  (P, K, 16)    w[n, k] = q[16p+i, k] * s[n]
//         s   float (P*16,)
//   One 16-byte load gives two input columns of 16 output rows, dequantized once into two vectors
//   and reused by every row of x in the tile (a GEMM with weight reuse, not a GEMV per row).
//   Float32 arithmetic: equals dequantize + matmul up to summation order.
//
// dot layout (every variant): x is rounded to 16- or 8-bit integers per 32 inputs, x ~ d_b * xq,
// and VPDPBUSD (AVX512-VNNI, AVX-VNNI) multiplies 4 weight bytes by 4 activation bytes per lane;
// AVX2 has VPMADDUBSW + VPMADDWD for int4 and VPMADDWD on widened weights for int8 (the AVX2
// tiles below). 16 bits: xq = 256 h + l split into two int8 halves, one product for h and one
// for l; 8 bits: xq = h, one product.
//   int4  q   uint8 (P, K/8, 16, 4)  byte [p, o, i, j] = q[n, 8o+j] | q[n, 8o+4+j] << 4
//   int8  q   uint8 (P, K/4, 16, 4)  byte [p, o, i, j] = q[n, 4o+j] + 128   (unsigned for VPDPBUSD)
//   y[n] = sum_b d_b s[n, g(b)] (q . xq)_b + sum_g m[n, g] sum_{b in g} d_b sum(xq)_b   (int4)
//   y[n] = s[n] sum_b d_b ((q + 128) . xq - 128 sum xq)_b                            (int8)
//   i.e. exactly round(x) . w, summed in float32 over each `segment` of inputs (whole blocks and
//   groups; all K by default) and over the segments in float64, rounded once at the end (or not at
//   all: `partial` returns the float64 sums of a tensor-parallel rank's input slice, see YOut).
//   One 64-byte load holds 128 int4 (64 int8) weights: 2-4x fewer
//   instructions per weight than the float layout. 16 bits: a relative error of ~1e-5 of each
//   block's largest input, float32-level; 8 bits (llama.cpp's Q8 arithmetic): ~1.6x faster at
//   batch, +0.23 % perplexity on the default model (and greedy answers it is unsure of can change).
#include <functional>
#include <string>
#include <vector>

#include "ops.h"

namespace tokenmill {
namespace {

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
        acc[r][0] += w0 * splat(x[r * ldx + k]);
        acc[r][1] += w1 * splat(x[r * ldx + k + 1]);
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
      acc[r][0] += w0 * splat(x[r * ldx + k]);
      acc[r][1] += w1 * splat(x[r * ldx + k + 1]);
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

// Tile<MT>::run(args...) calls the tile function named by the rest of the arguments, which may use
// MT (e.g. int4_tile<MT>): lets dispatch_rows pick MT at run time.
#define TILE_ADAPTER(Name, ...)                     \
  template <int MT>                                 \
  struct Name {                                     \
    template <typename... A>                        \
    static void run(A... a) { __VA_ARGS__(a...); }  \
  };
TILE_ADAPTER(Int4Tile, int4_tile<MT>)
TILE_ADAPTER(Int8Tile, int8_tile<MT>)

// Groups of `panels` adjacent panels split across threads; each walks all rows of x `tile` rows at a
// time, so the group's weights stay in L1 while x streams from L2. call(p, np, r, rows, nvalid_last):
// panels [p, p+np) (only the last may be partial), rows [r, r+rows).
template <typename Call>
void for_each_tile(int64_t P, int64_t M, int64_t N, int64_t tile, int64_t panels, const Call& call) {
  at::parallel_for(0, (P + panels - 1) / panels, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t * panels;
      const int np = static_cast<int>(std::min<int64_t>(panels, P - p));
      const int nvalid = static_cast<int>(std::min<int64_t>(kLanes, N - (p + np - 1) * kLanes));
      for (int64_t r = 0; r < M; r += tile) call(p, np, r, static_cast<int>(std::min<int64_t>(tile, M - r)), nvalid);
    }
  });
}

void check_n(int64_t N, int64_t P) {
  TORCH_CHECK(N > (P - 1) * kLanes && N <= P * kLanes, "N does not match the panels");
}

void check_scales_mins(const at::Tensor& s, const at::Tensor& m, int64_t P, at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(s.sizes() == m.sizes() && s.size(0) == P && s.is_contiguous() && m.is_contiguous() &&
              s.scalar_type() == dtype && m.scalar_type() == dtype, "scales/mins must be ", dtype, " (P, G, 16)");
}

void check_x(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be (M, ", K, "), got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
}

}  // namespace

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const at::Tensor& m,
                       int64_t N) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.size(2) == kLanes && q.is_contiguous(),
              "int4 weights must be uint8 (P, K/2, 16)");
  const int64_t P = q.size(0), K = q.size(1) * 2, G = s.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 2 == 0, "group size must be even and divide K");
  check_scales_mins(s, m, P);
  check_n(N, P);
  check_x(x, K);
  const int64_t M = x.size(0), group = K / G;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *mp = m.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_each_tile(P, M, N, kRowTile, 1, [&](int64_t p, int, int64_t r, int rows, int nvalid) {
    dispatch_rows<Int4Tile>(rows, xp + r * K, K, qp + p * K * (kLanes / 2), sp + p * G * kLanes,
                            mp + p * G * kLanes, K, group, yp + r * N + p * kLanes, N, nvalid);
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
  check_n(N, P);
  check_x(x, K);
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_each_tile(P, M, N, kRowTile, 1, [&](int64_t p, int, int64_t r, int rows, int nvalid) {
    dispatch_rows<Int8Tile>(rows, xp + r * K, K, qp + p * K * kLanes, sp + p * kLanes, K, yp + r * N + p * kLanes,
                            N, nvalid);
  });
  return y;
}

namespace {
#ifdef TOKENMILL_DOT
constexpr bool kDot = true;

// x (M, K) float -> integers per 32 inputs, xq = round(x / d_b), |xq| <= 127 * 256 (16 bits) or 127
// (8 bits, llama.cpp's Q8 activations). The tiles read them as int8 halves, xq = 256 h + l (h, l
// (M, K); 8 bits: xq = h, l unused) or, for the AVX2 int8 kernel, as int16 (x16 (M, K)). d (M, K/32),
// qsum (M, K/32) sums of the integers, xsum (M, K/group) sums of the rounded x per weight group (the
// int4 minimum term): the product equals round(x) . w exactly, up to float32 summation.
// 16 bits keep the product within float32's accuracy; 8 bits halve the integer products per weight
// for +0.23 % perplexity on the default model (benchmarks/RESULTS.md).
struct QuantizedX {
  std::vector<int8_t> h, l;
  std::vector<int16_t> x16;
  std::vector<float> d, xsum;
  std::vector<int32_t> qsum;
};

enum XForm { kHalves = 0, kInt16 = 1 };

// 32 int32 lanes (4 vectors) -> 32 int8 / 16 int16 in order. The packs work per 128-bit lane, so
// the results come interleaved by lane and one permute puts them back. Values fit: no saturation.
inline __m256i pack8(const __m256i* q) {
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline __m256i pack16(__m256i a, __m256i b) { return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); }

// One block of 32 inputs -> its integers (rounded to nearest even) in the layout the tiles read,
// their sum and the block's scale. In vector registers throughout: at prompt sizes a scalar split
// into halves cost about a tenth of the int4 product's time.
inline float quantize_block(const float* x, float qmax, XForm form, bool wide, int8_t* h, int8_t* l, int16_t* x16,
                            int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  const float amax = hmax8(m);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? qmax / amax : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  *sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
  if (form == kInt16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16), pack16(q[0], q[1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16 + 16), pack16(q[2], q[3]));
  } else if (!wide) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), pack8(q));
  } else {  // q = 256 hi + lo, hi = floor((q + 128) / 256): lo in [-128, 127]
    __m256i hi[4], lo[4];
    for (int i = 0; i < 4; ++i) {
      hi[i] = _mm256_srai_epi32(_mm256_add_epi32(q[i], _mm256_set1_epi32(128)), 8);
      lo[i] = _mm256_sub_epi32(q[i], _mm256_slli_epi32(hi[i], 8));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h), pack8(hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(l), pack8(lo));
  }
  return amax / qmax;
}

QuantizedX quantize_x(const float* x, int64_t M, int64_t K, int64_t group, bool wide, XForm form) {
  const int64_t nb = K / 32, ng = group ? K / group : 0;
  // |256 h + l| <= 32512 keeps h in [-127, 127]
  const float qmax = wide ? 127.f * 256.f : 127.f;
  const bool halves = form == kHalves;
  QuantizedX r{std::vector<int8_t>(halves ? M * K : 0), std::vector<int8_t>(halves && wide ? M * K : 0),
               std::vector<int16_t>(halves ? 0 : M * K), std::vector<float>(M * nb), std::vector<float>(M * ng),
               std::vector<int32_t>(M * nb)};
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t off = i * K + b * 32;
        r.d[i * nb + b] = quantize_block(x + off, qmax, form, wide, halves ? r.h.data() + off : nullptr,
                                         halves && wide ? r.l.data() + off : nullptr,
                                         halves ? nullptr : r.x16.data() + off, &r.qsum[i * nb + b]);
      }
      for (int64_t g = 0; g < ng; ++g) {  // the rounded x's sum: the error of q.x and m.x then cancel
        float acc = 0.f;
        for (int64_t b = g * (group / 32); b < (g + 1) * (group / 32); ++b) acc += r.d[i * nb + b] * r.qsum[i * nb + b];
        r.xsum[i * ng + g] = acc;
      }
    }
  });
  return r;
}

// Software prefetch distance for the weight stream. A thread walks its panels front to back, one
// contiguous stream, but the hardware prefetcher stops at every 4 KiB page boundary; prefetching
// 4 KiB ahead keeps the stream going across them. Batch-1 int4 products over DRAM-resident weights:
// 50-56 us vs 62-87 us for the 3072 x 576 matrix (alternated runs, 2 threads).
constexpr int64_t kPrefetch = 4096;

inline void prefetch_ahead(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch, _MM_HINT_T0); }

// The dot tiles below are kept out of line (noinline): inlined, all six row counts of a tile land in
// one dispatch function whose register allocation spills the accumulators to the stack, on AVX-512
// and AVX2 alike (benchmarks/RESULTS.md has the before and after).
// The tiles read x through raw pointers at their first row: through the vectors, the compiler
// reloads their data pointers around every int8 load (int8_t may alias anything) -- ~1.4x slower.
struct XRows {
  const int8_t *h, *l;
  const int16_t* x16;
  const float *d, *xsum;
  const int32_t* qsum;
};

XRows rows_at(const QuantizedX& x, int64_t row0, int64_t K, int64_t group) {
  const int64_t nb = K / 32, ng = group ? K / group : 0;
  auto at = [&](const auto& v) { return v.empty() ? nullptr : v.data() + row0 * K; };
  return {at(x.h), at(x.l), at(x.x16), x.d.data() + row0 * nb, x.xsum.data() + row0 * ng, x.qsum.data() + row0 * nb};
}

// Where a tile writes (row stride ld): float32 outputs, or, for a row-parallel rank's partial
// output under tensor parallelism, the float64 sums themselves (one of f, d is set). A tile sums
// each `segment` of inputs in float32 from zero and the segments' sums in float64, which is exact
// in practice (a few float32 values); rounding happens once, after the ranks' partials are added.
// A tensor-parallel rank's input slice is a run of whole segments, so every rank count computes
// the same float32 segment sums and rounds the same float64 total: TP=N gives TP=1's bits.
struct YOut {
  float* f;
  double* d;
  int64_t ld;
  YOut at(int64_t row, int64_t col) const { return {f ? f + row * ld + col : nullptr, d ? d + row * ld + col : nullptr, ld}; }
};

#if defined(TOKENMILL_DOT512)
inline v16f load_half(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

struct Sum16 {  // 16 float64 lanes: the segment sums of a panel's outputs
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  void add(v16f v) { lo = _mm512_add_pd(lo, _mm512_cvtps_pd(low8(v))), hi = _mm512_add_pd(hi, _mm512_cvtps_pd(high8(v))); }
  void put(const YOut& y, int64_t col, int n) const {
    if (y.f) return store(y.f + col, join(_mm512_cvtpd_ps(lo), _mm512_cvtpd_ps(hi)), n);
    alignas(64) double t[kLanes];
    _mm512_store_pd(t, lo), _mm512_store_pd(t + 8, hi);
    std::memcpy(y.d + col, t, sizeof(double) * n);
  }
};

// A dot tile is MT rows of x times NP adjacent panels (NP * 16 outputs): each broadcast of x feeds
// NP weight vectors and each weight vector MT rows, and MT * NP int32 chains run side by side.
// Measured on this machine's 3072x576 and 576x1536 matrices at 256 rows, one core: 8 bits 5x2
// ~250 GFLOP/s vs 8x1 ~180; 16 bits 3x2 ~160 vs 4x1 ~115. Only the last panel may be partial.
constexpr int kDot8Rows = 5, kDot16Rows = 3, kDotPanels = 2;

// int4: per (row, panel) an int32 chain of weights times h and, for 16-bit x (W), one times l.
template <int MT, int NP, bool W>
__attribute__((noinline)) void int4_dot_tile(XRows x, int64_t K, int64_t group, int64_t segment, const uint8_t* q, const at::Half* s,
                                             const at::Half* m, YOut y, int nvalid_last) {
  const int64_t nb = K / 32, ng = K / group, bpg = group / 32, gps = segment / group, qstride = K * 8, sstride = ng * kLanes;
  const __m512i low = _mm512_set1_epi8(0x0F);
  Sum16 sum[MT][NP];
  for (int64_t g0 = 0; g0 < ng; g0 += gps) {
    v16f acc[MT][NP];
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NP; ++j) acc[r][j] = v16f{};
    for (int64_t g = g0; g < g0 + gps; ++g) {
      v16f sw[NP], mw[NP];
      for (int j = 0; j < NP; ++j) sw[j] = load_half(s + j * sstride + g * kLanes), mw[j] = load_half(m + j * sstride + g * kLanes);
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
        __m512i hacc[MT][NP], lacc[MT][NP];
        for (int r = 0; r < MT; ++r)
          for (int j = 0; j < NP; ++j) hacc[r][j] = lacc[r][j] = _mm512_setzero_si512();
        for (int64_t o = 0; o < 4; ++o) {
          __m512i lo[NP], hi[NP];
          for (int j = 0; j < NP; ++j) {
            const uint8_t* qj = q + j * qstride + (b * 4 + o) * 64;
            prefetch_ahead(qj);
            const __m512i v = _mm512_loadu_si512(qj);
            lo[j] = _mm512_and_si512(v, low), hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          }
          for (int r = 0; r < MT; ++r) {
            const int64_t at = r * K + b * 32 + o * 8;
            const __m512i h0 = bcast4(x.h + at), h1 = bcast4(x.h + at + 4);
            for (int j = 0; j < NP; ++j)
              hacc[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hacc[r][j], lo[j], h0), hi[j], h1);
            if constexpr (W) {
              const __m512i l0 = bcast4(x.l + at), l1 = bcast4(x.l + at + 4);
              for (int j = 0; j < NP; ++j)
                lacc[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lacc[r][j], lo[j], l0), hi[j], l1);
            }
          }
        }
        for (int r = 0; r < MT; ++r) {
          const float d = x.d[r * nb + b];
          for (int j = 0; j < NP; ++j) {
            const __m512i dot = W ? _mm512_add_epi32(_mm512_slli_epi32(hacc[r][j], 8), lacc[r][j]) : hacc[r][j];
            acc[r][j] += v16f(_mm512_cvtepi32_ps(dot)) * (sw[j] * d);
          }
        }
      }
      for (int r = 0; r < MT; ++r)
        for (int j = 0; j < NP; ++j) acc[r][j] += mw[j] * x.xsum[r * ng + g];
    }
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NP; ++j) sum[r][j].add(acc[r][j]);
  }
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < NP; ++j) sum[r][j].put(y.at(r, 0), j * kLanes, j == NP - 1 ? nvalid_last : kLanes);
}

// int8: (q + 128) . xq - 128 sum(xq) per block of 32; each segment's sum scaled per output row.
template <int MT, int NP, bool W>
__attribute__((noinline)) void int8_dot_tile(XRows x, int64_t K, int64_t segment, const uint8_t* q, const float* s, YOut y,
                                             int nvalid_last) {
  const int64_t nb = K / 32, bps = segment / 32, qstride = K * kLanes;
  Sum16 sum[MT][NP];
  for (int64_t b0 = 0; b0 < nb; b0 += bps) {
    v16f acc[MT][NP];
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NP; ++j) acc[r][j] = v16f{};
    for (int64_t b = b0; b < b0 + bps; ++b) {
      __m512i hacc[MT][NP], lacc[MT][NP];
      for (int r = 0; r < MT; ++r)
        for (int j = 0; j < NP; ++j) hacc[r][j] = lacc[r][j] = _mm512_setzero_si512();
      for (int64_t o = 0; o < 8; ++o) {
        __m512i v[NP];
        for (int j = 0; j < NP; ++j) {
          const uint8_t* qj = q + j * qstride + (b * 8 + o) * 64;
          prefetch_ahead(qj);
          v[j] = _mm512_loadu_si512(qj);
        }
        for (int r = 0; r < MT; ++r) {
          const int64_t at = r * K + b * 32 + o * 4;
          const __m512i h = bcast4(x.h + at);
          for (int j = 0; j < NP; ++j) hacc[r][j] = _mm512_dpbusd_epi32(hacc[r][j], v[j], h);
          if constexpr (W) {
            const __m512i l = bcast4(x.l + at);
            for (int j = 0; j < NP; ++j) lacc[r][j] = _mm512_dpbusd_epi32(lacc[r][j], v[j], l);
          }
        }
      }
      for (int r = 0; r < MT; ++r) {
        const __m512i bias = _mm512_set1_epi32(128 * x.qsum[r * nb + b]);
        const float d = x.d[r * nb + b];
        for (int j = 0; j < NP; ++j) {
          const __m512i dot = W ? _mm512_add_epi32(_mm512_slli_epi32(hacc[r][j], 8), lacc[r][j]) : hacc[r][j];
          acc[r][j] += v16f(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, bias))) * d;
        }
      }
    }
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NP; ++j) sum[r][j].add(acc[r][j] * load(s + j * kLanes));  // scaled as a whole sum would be
  }
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < NP; ++j) sum[r][j].put(y.at(r, 0), j * kLanes, j == NP - 1 ? nvalid_last : kLanes);
}

constexpr int kInt4Rows8 = kDot8Rows, kInt4Rows16 = kDot16Rows, kInt8Rows8 = kDot8Rows, kInt8Rows16 = kDot16Rows;
constexpr XForm kInt8X = kHalves;
#else
// AVX2 (and AVX-VNNI): the same byte layouts, read as two 8-output halves of 32 bytes per panel
// row. 16 ymm registers hold a tile of MT rows x NU halves: int4 keeps 2 (16-bit x: 4) integer
// accumulators per row and half, the unpacked nibbles 2 per half, a broadcast or two.
//   int4: VPMADDUBSW multiplies the nibbles (u8, 0..15) by x's int8 bytes and adds pairs into
//   int16 lanes; the 4 octets of a 32-input block stay below 2^15 (4 x 2 x 2 x 15 x 128 = 30,720),
//   so they add in int16 and VPMADDWD by ones widens them once per block. AVX-VNNI: VPDPBUSD adds
//   the quads into int32 directly.
//   int8: q + 128 (u8, 0..255) would overflow VPMADDUBSW's int16 pairs, so the weights are widened
//   to int16 and VPMADDWD multiplies them by x as int16 (either width, one instruction per 16
//   weights and row; AVX-VNNI: VPDPWSSD), each output's pairs of lanes added once per block.
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

#if defined(__AVXVNNI__)
inline __m256i dot_quads(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
inline __m256i quad_sums(__m256i acc) { return acc; }
inline __m256i dot_pairs(__m256i acc, __m256i w, __m256i x) { return _mm256_dpwssd_avx_epi32(acc, w, x); }
#else
inline __m256i dot_quads(__m256i acc, __m256i w, __m256i x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
inline __m256i quad_sums(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
inline __m256i dot_pairs(__m256i acc, __m256i w, __m256i x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
#endif

inline __m256 load_half8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// y[r, 8u + i] (8 lanes of output half u): all 8, a prefix, or none of a partial last panel
inline void store8(float* p, __m256 v, int n) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else if (n > 0) std::memcpy(p, &v, sizeof(float) * n);
}

struct Sum8 {  // 8 float64 lanes: the segment sums of an output half
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  void add(__m256 v) {
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  void put(const YOut& y, int64_t col, int n) const {
    if (y.f) return store8(y.f + col, _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo)), n);
    alignas(32) double t[8];
    _mm256_store_pd(t, lo), _mm256_store_pd(t + 4, hi);
    if (n > 0) std::memcpy(y.d + col, t, sizeof(double) * std::min(n, 8));
  }
};

template <int MT, int NU, bool W>
__attribute__((noinline)) void int4_dot_tile(XRows x, int64_t K, int64_t group, int64_t segment, const uint8_t* q, const at::Half* s,
                                             const at::Half* m, YOut y, int nvalid) {
  const int64_t nb = K / 32, ng = K / group, bpg = group / 32, gps = segment / group;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int u0 = 0; u0 < 2; u0 += NU) {
    Sum8 sum[MT][NU];
    for (int64_t g0 = 0; g0 < ng; g0 += gps) {
      __m256 acc[MT][NU];
      for (int r = 0; r < MT; ++r)
        for (int u = 0; u < NU; ++u) acc[r][u] = _mm256_setzero_ps();
      for (int64_t g = g0; g < g0 + gps; ++g) {
        __m256 sw[NU], mw[NU];
        for (int u = 0; u < NU; ++u)
          sw[u] = load_half8(s + g * kLanes + (u0 + u) * 8), mw[u] = load_half8(m + g * kLanes + (u0 + u) * 8);
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
          __m256i hacc[MT][NU], lacc[MT][NU];
          for (int r = 0; r < MT; ++r)
            for (int u = 0; u < NU; ++u) hacc[r][u] = lacc[r][u] = _mm256_setzero_si256();
          for (int64_t o = 0; o < 4; ++o) {
            const uint8_t* qo = q + (b * 4 + o) * 64;
            if (u0 == 0) prefetch_ahead(qo);
            __m256i lo[NU], hi[NU];
            for (int u = 0; u < NU; ++u) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qo + (u0 + u) * 32));
              lo[u] = _mm256_and_si256(v, low), hi[u] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < MT; ++r) {
              const int64_t at = r * K + b * 32 + o * 8;
              const __m256i h0 = bcast4(x.h + at), h1 = bcast4(x.h + at + 4);
              for (int u = 0; u < NU; ++u) hacc[r][u] = dot_quads(dot_quads(hacc[r][u], lo[u], h0), hi[u], h1);
              if constexpr (W) {
                const __m256i l0 = bcast4(x.l + at), l1 = bcast4(x.l + at + 4);
                for (int u = 0; u < NU; ++u) lacc[r][u] = dot_quads(dot_quads(lacc[r][u], lo[u], l0), hi[u], l1);
              }
            }
          }
          for (int r = 0; r < MT; ++r) {
            const __m256 d = _mm256_set1_ps(x.d[r * nb + b]);
            for (int u = 0; u < NU; ++u) {
              const __m256i dot = W ? _mm256_add_epi32(_mm256_slli_epi32(quad_sums(hacc[r][u]), 8), quad_sums(lacc[r][u]))
                                    : quad_sums(hacc[r][u]);
              acc[r][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw[u], d), acc[r][u]);
            }
          }
        }
        for (int r = 0; r < MT; ++r)
          for (int u = 0; u < NU; ++u) acc[r][u] = _mm256_fmadd_ps(mw[u], _mm256_set1_ps(x.xsum[r * ng + g]), acc[r][u]);
      }
      for (int r = 0; r < MT; ++r)
        for (int u = 0; u < NU; ++u) sum[r][u].add(acc[r][u]);
    }
    for (int r = 0; r < MT; ++r)
      for (int u = 0; u < NU; ++u) sum[r][u].put(y.at(r, 0), (u0 + u) * 8, nvalid - (u0 + u) * 8);
  }
}

// int8: the 64 bytes of an input quad hold 4 outputs per 16 bytes, widened to 16 int16 lanes
// (output, input) whose VPMADDWD with x's 4 inputs leaves 2 int32 lanes per output.
template <int MT, int NU, bool W>
__attribute__((noinline)) void int8_dot_tile(XRows x, int64_t K, int64_t segment, const uint8_t* q, const float* s, YOut y,
                                             int nvalid) {
  const int64_t nb = K / 32, bps = segment / 32;
  for (int u0 = 0; u0 < 2; u0 += NU) {
    Sum8 sum[MT][NU];
    for (int64_t b0 = 0; b0 < nb; b0 += bps) {
      __m256 acc[MT][NU];
      for (int r = 0; r < MT; ++r)
        for (int u = 0; u < NU; ++u) acc[r][u] = _mm256_setzero_ps();
      for (int64_t b = b0; b < b0 + bps; ++b) {
        __m256i iacc[MT][NU][2];
        for (int r = 0; r < MT; ++r)
          for (int u = 0; u < NU; ++u) iacc[r][u][0] = iacc[r][u][1] = _mm256_setzero_si256();
        for (int64_t o = 0; o < 8; ++o) {
          const uint8_t* qo = q + (b * 8 + o) * 64;
          if (u0 == 0) prefetch_ahead(qo);
          __m256i w[NU][2];
          for (int u = 0; u < NU; ++u)
            for (int c = 0; c < 2; ++c)
              w[u][c] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qo + (u0 + u) * 32 + c * 16)));
          for (int r = 0; r < MT; ++r) {
            int64_t four;
            std::memcpy(&four, x.x16 + r * K + b * 32 + o * 4, 8);
            const __m256i xb = _mm256_set1_epi64x(four);
            for (int u = 0; u < NU; ++u)
              for (int c = 0; c < 2; ++c) iacc[r][u][c] = dot_pairs(iacc[r][u][c], w[u][c], xb);
          }
        }
        for (int r = 0; r < MT; ++r) {
          const __m256i bias = _mm256_set1_epi32(128 * x.qsum[r * nb + b]);
          const __m256 d = _mm256_set1_ps(x.d[r * nb + b]);
          for (int u = 0; u < NU; ++u) {  // hadd: [o0 o1 o4 o5 | o2 o3 o6 o7] -> in order
            const __m256i dot = _mm256_permute4x64_epi64(_mm256_hadd_epi32(iacc[r][u][0], iacc[r][u][1]), 0xD8);
            acc[r][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot, bias)), d, acc[r][u]);
          }
        }
      }
      for (int r = 0; r < MT; ++r)  // scaled as a whole sum would be
        for (int u = 0; u < NU; ++u) sum[r][u].add(_mm256_mul_ps(acc[r][u], _mm256_loadu_ps(s + (u0 + u) * 8)));
    }
    for (int r = 0; r < MT; ++r)
      for (int u = 0; u < NU; ++u) sum[r][u].put(y.at(r, 0), (u0 + u) * 8, nvalid - (u0 + u) * 8);
  }
}

// Tiles (rows x halves): one half at a time keeps a tile's integer and float accumulators, the
// unpacked nibbles and the broadcasts within the 16 ymm registers (3 x 2 at 16 bits spills). Swept
// over 2-6 rows x 1-2 halves, 16 and 256 rows of SmolLM2's 3072x576 and 576x1536, AVX2 build on a
// Xeon (Zen 2 sweeps were too noisy to rank): 16-bit int4 4 x 1 (3 x 1 close, 3 x 2 last); 8-bit 6 x 1
// (5 x 1 led one sweep, 6 won the kernel_bench pairs at 16-256 rows); int8 (the output head) 4 x 1
// over 2, 3 and 5 rows.
constexpr int kDotPanels = 1;
constexpr int kInt4Rows8 = 6, kInt4Rows16 = 4, kInt8Rows8 = 4, kInt8Rows16 = 4;
constexpr XForm kInt8X = kInt16;
#endif

// Tile<MT, NP>::run(args...) picked at run time for rows <= 6; NP: 512-bit panels per tile (AVX-512),
// 256-bit halves processed together (AVX2: one, the sweep's pick).
#define DOT_TILE_ADAPTER(Name, ...)                 \
  template <int MT, int NP>                         \
  struct Name {                                     \
    template <typename... A>                        \
    static void run(A... a) { __VA_ARGS__(a...); }  \
  };
DOT_TILE_ADAPTER(Int4Dot16Tile, int4_dot_tile<MT, NP, true>)
DOT_TILE_ADAPTER(Int4Dot8Tile, int4_dot_tile<MT, NP, false>)
DOT_TILE_ADAPTER(Int8Dot16Tile, int8_dot_tile<MT, NP, true>)
DOT_TILE_ADAPTER(Int8Dot8Tile, int8_dot_tile<MT, NP, false>)

template <template <int, int> class Tile, int NP, typename... Args>
void dispatch_dot_rows(int rows, Args... args) {
  switch (rows) {
    case 1: Tile<1, NP>::run(args...); break;
    case 2: Tile<2, NP>::run(args...); break;
    case 3: Tile<3, NP>::run(args...); break;
    case 4: Tile<4, NP>::run(args...); break;
    case 5: Tile<5, NP>::run(args...); break;
    case 6: Tile<6, NP>::run(args...); break;
    default: TORCH_CHECK(false, "row tile out of range");
  }
}

// np: the tile's panels, kDotPanels but for a partial last group (on AVX2 kDotPanels is 1: one path)
template <template <int, int> class Tile, typename... Args>
void dispatch_dot(int rows, int np, Args... args) {
  if (np == kDotPanels) dispatch_dot_rows<Tile, kDotPanels>(rows, args...);
  else dispatch_dot_rows<Tile, 1>(rows, args...);
}

void check_bits(int64_t bits) { TORCH_CHECK(bits == 8 || bits == 16, "activation bits must be 8 or 16, got ", bits); }

// segment 0: all K inputs in one float32 sum
int64_t check_segment(int64_t segment, int64_t K, int64_t unit) {
  if (segment == 0) return K;
  TORCH_CHECK(segment > 0 && segment % unit == 0 && K % segment == 0, "a segment of ", segment,
              " inputs must be a multiple of ", unit, " dividing K = ", K);
  return segment;
}

// (M, N) float32, or float64 partial sums
at::Tensor output(const at::Tensor& x, int64_t N, bool partial) {
  return at::empty({x.size(0), N}, x.options().dtype(partial ? at::kDouble : at::kFloat));
}
YOut out_at(at::Tensor& y, int64_t row, int64_t col) {
  const int64_t N = y.size(1);
  return y.scalar_type() == at::kDouble ? YOut{nullptr, y.data_ptr<double>(), N}.at(row, col)
                                        : YOut{y.data_ptr<float>(), nullptr, N}.at(row, col);
}

}  // namespace

at::Tensor int4_linear_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const at::Tensor& m,
                           int64_t N, int64_t bits, int64_t segment, bool partial) {
  check_bits(bits);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.size(2) == 64 && q.is_contiguous(),
              "int4 dot weights must be uint8 (P, K/8, 64)");
  const int64_t P = q.size(0), K = q.size(1) * 8, G = s.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 32 == 0, "group size must be a multiple of 32 dividing K");
  check_scales_mins(s, m, P, at::kHalf);
  check_n(N, P);
  check_x(x, K);
  const int64_t M = x.size(0), group = K / G;
  segment = check_segment(segment, K, group);
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), M, K, group, bits == 16, kHalves);
  at::Tensor y = output(x, N, partial);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const at::Half *sp = s.data_ptr<at::Half>(), *mp = m.data_ptr<at::Half>();
  const int tile = bits == 16 ? kInt4Rows16 : kInt4Rows8;
  for_each_tile(P, M, N, tile, kDotPanels, [&](int64_t p, int np, int64_t r, int rows, int nvalid) {
    const XRows xr = rows_at(xq, r, K, group);
    const uint8_t* qt = qp + p * K * 8;
    const at::Half *st = sp + p * G * kLanes, *mt = mp + p * G * kLanes;
    const YOut yt = out_at(y, r, p * kLanes);
    if (bits == 16) dispatch_dot<Int4Dot16Tile>(rows, np, xr, K, group, segment, qt, st, mt, yt, nvalid);
    else dispatch_dot<Int4Dot8Tile>(rows, np, xr, K, group, segment, qt, st, mt, yt, nvalid);
  });
  return y;
}

at::Tensor int8_linear_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t N, int64_t bits,
                           int64_t segment, bool partial) {
  check_bits(bits);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.size(2) == 64 && q.is_contiguous(),
              "int8 dot weights must be uint8 (P, K/4, 64)");
  const int64_t P = q.size(0), K = q.size(1) * 4;
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(s.numel() == P * kLanes && s.scalar_type() == at::kFloat && s.is_contiguous(),
              "scales must be float (P*16,)");
  check_n(N, P);
  check_x(x, K);
  const int64_t M = x.size(0);
  segment = check_segment(segment, K, 32);
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), M, K, 0, bits == 16, kInt8X);
  at::Tensor y = output(x, N, partial);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const int tile = bits == 16 ? kInt8Rows16 : kInt8Rows8;
  for_each_tile(P, M, N, tile, kDotPanels, [&](int64_t p, int np, int64_t r, int rows, int nvalid) {
    const XRows xr = rows_at(xq, r, K, 0);
    const uint8_t* qt = qp + p * K * kLanes;
    const YOut yt = out_at(y, r, p * kLanes);
    if (bits == 16) dispatch_dot<Int8Dot16Tile>(rows, np, xr, K, segment, qt, sp + p * kLanes, yt, nvalid);
    else dispatch_dot<Int8Dot8Tile>(rows, np, xr, K, segment, qt, sp + p * kLanes, yt, nvalid);
  });
  return y;
}
#else
}  // namespace
constexpr bool kDot = false;
#endif

std::string layout() { return kDot ? "dot" : "float"; }
std::string isa() { return TOKENMILL_ISA; }

}  // namespace tokenmill

TORCH_LIBRARY(tokenmill, m) {
  m.def("layout", &tokenmill::layout);
  m.def("isa", &tokenmill::isa);
  m.def("int4_linear(Tensor x, Tensor q, Tensor s, Tensor m, int N) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor q, Tensor s, int N) -> Tensor");
#ifdef TOKENMILL_DOT
  m.def("int4_linear_dot(Tensor x, Tensor q, Tensor s, Tensor m, int N, int bits, int segment=0, bool partial=False) -> Tensor");
  m.def("int8_linear_dot(Tensor x, Tensor q, Tensor s, int N, int bits, int segment=0, bool partial=False) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("int4_linear", &tokenmill::int4_linear);
  m.impl("int8_linear", &tokenmill::int8_linear);
#ifdef TOKENMILL_DOT
  m.impl("int4_linear_dot", &tokenmill::int4_linear_dot);
  m.impl("int8_linear_dot", &tokenmill::int8_linear_dot);
#endif
}

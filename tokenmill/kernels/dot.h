// The dot layout's shared pieces (linear.cpp, kquant.cpp): activations rounded to integers per 32
// inputs, where a tile writes, the ISA's integer-product helpers, and the loops that split panels
// over threads and pick a tile for the rows left. Included by each kernel file into an anonymous
// namespace of its own: internal helpers, one copy per file.
#pragma once
#include <algorithm>
#include <cstring>
#include <vector>

#include "ops.h"

namespace tokenmill {
namespace {


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


#ifdef TOKENMILL_DOT

// the lookup types' tables (lut.cpp): IQ4_NL/IQ4_XS's non-linear one, MXFP4's FP4 (E2M1) doubled
constexpr int8_t kIQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int8_t kFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// x (M, K) float -> integers per 32 inputs, xq = round(x / d_b), |xq| <= 127 * 256 (16 bits) or 127
// (8 bits, llama.cpp's Q8 activations). The tiles read them as int8 halves, xq = 256 h + l (h, l
// (M, K); 8 bits: xq = h, l unused) or, for the AVX2 int8 kernel, as int16 (x16 (M, K)). d (M, K/32),
// qsum (M, K/32) sums of the integers, xsum (M, K/group) sums of the rounded x per weight group (the
// int4 minimum term): the product equals round(x) . w exactly, up to float32 summation.
// 16 bits keep the product within float32's accuracy; 8 bits halve the integer products per weight
// for a small perplexity cost (benchmarks/ppl.sh; figures in benchmarks/RESULTS.md).
struct QuantizedX {
  std::vector<int8_t> h, l;
  std::vector<int16_t> x16;
  std::vector<float> d, xsum;
  std::vector<int32_t> qsum;
  std::vector<int32_t> qsum16;  // (M, K/16): the integers' sums per 16 inputs (Q6_K's sub-blocks), when asked for
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
inline int32_t hsum8i(__m256i v) {
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
}

inline float quantize_block(const float* x, float qmax, XForm form, bool wide, int8_t* h, int8_t* l, int16_t* x16,
                            int32_t* sum, int32_t* sum16) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  const float amax = hmax8(m);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? qmax / amax : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  *sum = hsum8i(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  if (sum16) sum16[0] = hsum8i(_mm256_add_epi32(q[0], q[1])), sum16[1] = *sum - sum16[0];
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

QuantizedX quantize_x(const float* x, int64_t M, int64_t K, int64_t group, bool wide, XForm form, bool sums16 = false) {
  const int64_t nb = K / 32, ng = group ? K / group : 0;
  // |256 h + l| <= 32512 keeps h in [-127, 127]
  const float qmax = wide ? 127.f * 256.f : 127.f;
  const bool halves = form == kHalves;
  QuantizedX r{std::vector<int8_t>(halves ? M * K : 0), std::vector<int8_t>(halves && wide ? M * K : 0),
               std::vector<int16_t>(halves ? 0 : M * K), std::vector<float>(M * nb), std::vector<float>(M * ng),
               std::vector<int32_t>(M * nb), std::vector<int32_t>(sums16 ? M * nb * 2 : 0)};
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t off = i * K + b * 32;
        r.d[i * nb + b] = quantize_block(x + off, qmax, form, wide, halves ? r.h.data() + off : nullptr,
                                         halves && wide ? r.l.data() + off : nullptr,
                                         halves ? nullptr : r.x16.data() + off, &r.qsum[i * nb + b],
                                         sums16 ? &r.qsum16[(i * nb + b) * 2] : nullptr);
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
// 4 KiB ahead keeps the stream going across them (batch-1 products over DRAM-resident weights are
// faster with it: benchmarks/kernel_bench.py).
constexpr int64_t kPrefetch = 4096;

inline void prefetch_ahead(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch, _MM_HINT_T0); }

// The dot tiles below are kept out of line (noinline): inlined, all six row counts of a tile land in
// one dispatch function whose register allocation spills the accumulators to the stack, on AVX-512
// and AVX2 alike (benchmarks/RESULTS.md has the before and after).
// The tiles read x through raw pointers at their first row: through the vectors, the compiler
// reloads their data pointers around every int8 load (int8_t may alias anything), measurably slower.
struct XRows {
  const int8_t *h, *l;
  const int16_t* x16;
  const float *d, *xsum;
  const int32_t* qsum;
  const int32_t* qsum16;
};

XRows rows_at(const QuantizedX& x, int64_t row0, int64_t K, int64_t group) {
  const int64_t nb = K / 32, ng = group ? K / group : 0;
  auto at = [&](const auto& v) { return v.empty() ? nullptr : v.data() + row0 * K; };
  return {at(x.h), at(x.l), at(x.x16), x.d.data() + row0 * nb, x.xsum.data() + row0 * ng, x.qsum.data() + row0 * nb,
          x.qsum16.empty() ? nullptr : x.qsum16.data() + row0 * nb * 2};
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

// Where an int4 tile's per-group scale s and minimum m come from (w = q s + m):
// HalfScales: float16 s and m per group (Q4_1, AWQ, GPTQ), (P, G, 16) each; without m (symmetric
// weights: GGUF Q4_0 and Q5_0, w = s (q - off)) m = -off s, exact in float32, off 8 or 16.
// KScales: GGUF Q4_K super-blocks, exactly: s = d sc and m = -dmin mn, with 6-bit sc and mn per 32
// inputs held as bytes (P, K/32, [16 sc | 16 mn]) and float16 d and -dmin per 256 inputs (P, K/256,
// [16 d | 16 -dmin]); float16 times a 6-bit integer is exact in float32. 0.578 bytes per weight
// against the file's 0.5625.
struct HalfScales {
  const at::Half *s, *m;
  int64_t stride;  // per panel: G * 16
  float off = 8.f;
  v16f scale(int j, int64_t g) const { return load_half(s + j * stride + g * kLanes); }
  v16f min(int j, int64_t g) const { return m ? load_half(m + j * stride + g * kLanes) : scale(j, g) * -off; }
};
struct KScales {
  const uint8_t* sm;
  const at::Half* dd;
  int64_t sm_stride, dd_stride;  // per panel: K/32 * 32, K/256 * 32
  static v16f bytes16(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  v16f scale(int j, int64_t g) const { return load_half(dd + j * dd_stride + (g >> 3) * 32) * bytes16(sm + j * sm_stride + g * 32); }
  v16f min(int j, int64_t g) const {
    return load_half(dd + j * dd_stride + (g >> 3) * 32 + 16) * bytes16(sm + j * sm_stride + g * 32 + 16);
  }
};

// The block scale of 16 outputs (one panel's row of s) in float32, per type.
struct LutScales {
  const void* s;
  const at::Half* d;  // IQ4_XS's d per 256
  int kind;           // 0 IQ4_NL, 1 IQ4_XS, 2 MXFP4
  int64_t s_stride, d_stride;  // per panel: K/32 * 16, K/256 * 16
  v16f at(int j, int64_t b) const {
    const int64_t i = j * s_stride + b * kLanes;
    if (kind == 0) return load_half(static_cast<const at::Half*>(s) + i);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(s) + i));
    if (kind == 1) return load_half(d + j * d_stride + (b >> 3) * kLanes) * v16f(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)));
    const __m512i e = _mm512_cvtepu8_epi32(raw);  // 2^(e - 128): exponent field e - 1, or a subnormal below e = 2
    const __mmask16 sub = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    return _mm512_castsi512_ps(_mm512_mask_sllv_epi32(normal, sub, _mm512_set1_epi32(0x00200000), e));
  }
};


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
// The shapes are the sweep's picks (benchmarks/kernel_bench.py): two panels per tile beat one at
// either width. Only the last panel may be partial.
constexpr int kDot8Rows = 5, kDot16Rows = 3, kDotPanels = 2;
#else
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

// two octets of up to 6-bit weights times x's int8 into int32: VPMADDUBSW's pairs (63 x 128 x 2 each)
// add up to 32,256 over the two, within int16; VPMADDWD by ones widens them (Q6_K, the 5-bit tiles)
#if defined(__AVXVNNI__)
inline __m256i dot_wide(__m256i acc, __m256i lo, __m256i x0, __m256i hi, __m256i x1) {
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, x0), hi, x1);
}
#else
inline __m256i dot_wide(__m256i acc, __m256i lo, __m256i x0, __m256i hi, __m256i x1) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
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
constexpr int kDotPanels = 1;
#endif

// Tile<MT, NP>::run(args...) picked at run time for rows <= 6; NP: 512-bit panels per tile (AVX-512),
// 256-bit halves processed together (AVX2: one, the sweep's pick).
#define DOT_TILE_ADAPTER(Name, ...)                 \
  template <int MT, int NP>                         \
  struct Name {                                     \
    template <typename... A>                        \
    static void run(A... a) { __VA_ARGS__(a...); }  \
  };

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

// A dot-layout weight tensor of exactly this shape and dtype, contiguous.
void check_panel(const at::Tensor& t, at::IntArrayRef sizes, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.sizes() == sizes && t.scalar_type() == dtype && t.is_contiguous(), what, " must be ", dtype, " ", sizes,
              ", got ", t.scalar_type(), " ", t.sizes());
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

#endif  // TOKENMILL_DOT

}  // namespace
}  // namespace tokenmill

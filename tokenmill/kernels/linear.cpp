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
//   One 64-byte load holds 128 int4 (64 int8) weights: fewer instructions per weight than the
//   float layout. 16 bits: float32-level accuracy; 8 bits (llama.cpp's Q8 arithmetic): half the
//   integer products, faster at batch, for a small perplexity cost (and greedy answers it is unsure
//   of can change; benchmarks/ppl.sh and kernel_bench.py measure both).
#include <functional>
#include <string>

#include "dot.h"

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
  const bool grouped = s.dim() == 3;  // a float16 scale per block of 32 inputs (GGUF Q8_0)
  if (grouped) check_panel(s, {P, K / 32, kLanes}, at::kHalf, "int8 block scales");
  else TORCH_CHECK(s.numel() == P * kLanes && s.scalar_type() == at::kFloat && s.is_contiguous(),
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

#ifdef TOKENMILL_DOT
constexpr bool kDot = true;   // the dot layout's kernels: dot_linear.cpp
#else
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
  m.def("int4_linear_dot(Tensor x, Tensor q, Tensor s, Tensor? m, int N, int bits, int segment=0, bool partial=False, "
        "Tensor? qh=None) -> Tensor");
  m.def("int8_linear_dot(Tensor x, Tensor q, Tensor s, int N, int bits, int segment=0, bool partial=False) -> Tensor");
  m.def("q4k_linear_dot(Tensor x, Tensor q, Tensor sm, Tensor dd, int N, int bits, int segment=0, bool partial=False, "
        "Tensor? qh=None) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("int4_linear", &tokenmill::int4_linear);
  m.impl("int8_linear", &tokenmill::int8_linear);
}

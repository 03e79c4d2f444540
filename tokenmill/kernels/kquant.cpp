// GGUF's K-quants with a scale per 16 inputs, at their own width: Q6_K, Q3_K and Q2_K. A float16 d
// per 256 inputs (a super-block) and the file's own integers and sub-block scales:
//   Q6_K  w = d sc (q - 32), q = lo | hi << 4 in 0..63, sc int8
//   Q3_K  w = d sc (q - 4), q = lo2 | third << 2 in 0..7, sc = the file's 6-bit scale - 32 (int8)
//   Q2_K  w = d sc q - dmin mn, q in 0..3, sc and mn 4-bit (a byte sc | mn << 4, as the file's)
// (Q4_K and Q5_K run on the int4 tiles of linear.cpp with their super-block scales, KScales; Q5_K
// adds a plane of fifth bits. Their transcoding is here, q45k_pack.)
//
// Layout, 16-row panels like the other dot weights (kernels/panels.py packs them):
//   ql  uint8 (P, K/8, 64)    Q6_K's low nibbles in the int4 dot layout: byte [p, o, i*4 + j] =
//                             lo(q[16p+i, 8o+j]) | lo(q[16p+i, 8o+4+j]) << 4
//   qh  uint8 (P, K/32, 128)  per block of 32 inputs, 2-bit fields (Q6_K's highs, Q3_K's and Q2_K's
//                             low two bits): byte [p, b, i*4 + j] holds those of q[n, 32b + 8o + j]
//                             at bits 2o..2o+1 for o = 0..3, byte [p, b, 64 + i*4 + j] those of
//                             q[n, 32b + 8o + 4 + j]; Q3_K/Q2_K hold it as (P, K/16, 64), the same bytes
//   hb  uint8 (P, K/32, 64)   Q3_K's third bits: bit o of byte [p, b, i*4 + j] for q[n, 32b + 8o + j],
//                             bit 4 + o for q[n, 32b + 8o + 4 + j] (the fifth-bit layout of linear.cpp)
//   sc  (P, K/16, 16)         int8 (Q6_K, Q3_K), uint8 sc | mn << 4 (Q2_K)
//   d   float16 (P, K/256, 16), Q2_K (P, K/256, 32): 16 d | 16 -dmin
// Bytes per weight: Q6_K 0.8203 (the file's 210 per 256), Q3_K 0.4453 (file 0.4297), Q2_K 0.3281 (the
// file's). An octet's weights are assembled from their bit fields with shifts and masks; VPDPBUSD
// (VPMADDUBSW on AVX2) multiplies them by the activations' integers; sum((q - c) xq) = q . xq - c
// sum(xq) per 16 inputs, and Q2_K's minimum is mn times that sum.
#include <type_traits>

#include "dot.h"

namespace tokenmill {
namespace {
#ifdef TOKENMILL_DOT

enum KFormat { kQ6 = 0, kQ3 = 1, kQ2 = 2 };
constexpr int32_t offset_of(int F) { return F == kQ6 ? 32 : F == kQ3 ? 4 : 0; }

#if defined(TOKENMILL_DOT512)
// bit `from` of every byte to bit `to`, masked (16-bit shifts: what crosses from the neighbour byte is masked off)
inline __m512i move_bits(__m512i v, int from, int to, __m512i mask) {
  const __m512i s = from > to ? _mm512_srli_epi16(v, from - to) : from < to ? _mm512_slli_epi16(v, to - from) : v;
  return _mm512_and_si512(s, mask);
}
inline __m128i load16(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

template <int MT, int NP, bool W, int F>
__attribute__((noinline)) void k16_dot_tile(XRows x, int64_t K, int64_t segment, const uint8_t* ql, const uint8_t* qh,
                                            const void* scales, const at::Half* d, YOut y, int nvalid_last) {
  const int64_t nb = K / 32, bps = segment / 32, lstride = F == kQ6 ? K * 8 : K * 2, hstride = K * 4, sstride = K,
                dl = F == kQ2 ? 32 : 16, dstride = K / 256 * dl;
  const uint8_t* sc = static_cast<const uint8_t*>(scales);
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30), two = _mm512_set1_epi8(3),
                third = _mm512_set1_epi8(4), nib = _mm512_set1_epi32(15);
  Sum16 sum[MT][NP];
  for (int64_t b0 = 0; b0 < nb; b0 += bps) {
    v16f acc[MT][NP];
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NP; ++j) acc[r][j] = v16f{};
    for (int64_t b = b0; b < b0 + bps; ++b) {
      __m512i h0[NP], h1[NP], hb[NP];
      v16f dv[NP], mv[NP];
      for (int j = 0; j < NP; ++j) {
        const uint8_t* hj = qh + j * hstride + b * 128;
        h0[j] = _mm512_loadu_si512(hj), h1[j] = _mm512_loadu_si512(hj + 64);
        if constexpr (F != kQ6) prefetch_ahead(hj), prefetch_ahead(hj + 64);
        if constexpr (F == kQ3) hb[j] = _mm512_loadu_si512(ql + j * lstride + b * 64), prefetch_ahead(ql + j * lstride + b * 64);
        dv[j] = load_half(d + j * dstride + (b >> 3) * dl);
        if constexpr (F == kQ2) mv[j] = load_half(d + j * dstride + (b >> 3) * dl + 16);
      }
#pragma GCC unroll 2  // unrolled, every field's shift is an immediate (a shift by a register is slower)
      for (int half = 0; half < 2; ++half) {  // a sub-block of 16 inputs: octets 2 half and 2 half + 1
        __m512i hacc[MT][NP], lacc[MT][NP];
        for (int r = 0; r < MT; ++r)
          for (int j = 0; j < NP; ++j) hacc[r][j] = lacc[r][j] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int o = 2 * half; o < 2 * half + 2; ++o) {
          __m512i lo[NP], hi[NP];
          for (int j = 0; j < NP; ++j) {
            if constexpr (F == kQ6) {
              const uint8_t* qj = ql + j * lstride + (b * 4 + o) * 64;
              prefetch_ahead(qj);
              const __m512i v = _mm512_loadu_si512(qj);
              lo[j] = _mm512_or_si512(_mm512_and_si512(v, low), move_bits(h0[j], 2 * o, 4, top));
              hi[j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), move_bits(h1[j], 2 * o, 4, top));
            } else {
              lo[j] = move_bits(h0[j], 2 * o, 0, two), hi[j] = move_bits(h1[j], 2 * o, 0, two);
              if constexpr (F == kQ3) {
                lo[j] = _mm512_or_si512(lo[j], move_bits(hb[j], o, 2, third));
                hi[j] = _mm512_or_si512(hi[j], move_bits(hb[j], 4 + o, 2, third));
              }
            }
          }
          for (int r = 0; r < MT; ++r) {
            const int64_t at = r * K + b * 32 + o * 8;
            const __m512i x0 = bcast4(x.h + at), x1 = bcast4(x.h + at + 4);
            for (int j = 0; j < NP; ++j) hacc[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hacc[r][j], lo[j], x0), hi[j], x1);
            if constexpr (W) {
              const __m512i l0 = bcast4(x.l + at), l1 = bcast4(x.l + at + 4);
              for (int j = 0; j < NP; ++j) lacc[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lacc[r][j], lo[j], l0), hi[j], l1);
            }
          }
        }
        for (int r = 0; r < MT; ++r) {
          const int32_t qs = x.qsum16[(r * nb + b) * 2 + half];
          const float dx = x.d[r * nb + b];
          const __m512i bias = _mm512_set1_epi32(offset_of(F) * qs);
          for (int j = 0; j < NP; ++j) {  // the scales reloaded per row (from L1): kept live, they cost spills
            const __m512i dot = W ? _mm512_add_epi32(_mm512_slli_epi32(hacc[r][j], 8), lacc[r][j]) : hacc[r][j];
            const __m128i raw = load16(sc + j * sstride + (2 * b + half) * kLanes);
            if constexpr (F == kQ2) {
              const __m512i sm = _mm512_cvtepu8_epi32(raw);
              const v16f s = dv[j] * v16f(_mm512_cvtepi32_ps(_mm512_and_si512(sm, nib)));
              const v16f m = mv[j] * v16f(_mm512_cvtepi32_ps(_mm512_srli_epi32(sm, 4)));
              acc[r][j] += v16f(_mm512_cvtepi32_ps(dot)) * (s * dx) + m * (qs * dx);
            } else {
              const v16f s = dv[j] * v16f(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)));
              acc[r][j] += v16f(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, bias))) * (s * dx);
            }
          }
        }
      }
    }
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NP; ++j) sum[r][j].add(acc[r][j]);
  }
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < NP; ++j) sum[r][j].put(y.at(r, 0), j * kLanes, j == NP - 1 ? nvalid_last : kLanes);
}
// 8-bit x: 4 rows x 2 panels (accumulators, unpacked weights, highs and broadcasts: 28 of 32 zmm); 16-bit: 2 x 2
constexpr int kK16Rows8 = 4, kK16Rows16 = 2;
#else
inline __m256i move_bits(__m256i v, int from, int to, __m256i mask) {
  const __m256i s = from > to ? _mm256_srli_epi16(v, from - to) : from < to ? _mm256_slli_epi16(v, to - from) : v;
  return _mm256_and_si256(s, mask);
}
inline __m256i load32v(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

template <int MT, int NU, bool W, int F>
__attribute__((noinline)) void k16_dot_tile(XRows x, int64_t K, int64_t segment, const uint8_t* ql, const uint8_t* qh,
                                            const void* scales, const at::Half* d, YOut y, int nvalid) {
  const int64_t nb = K / 32, bps = segment / 32, dl = F == kQ2 ? 32 : 16;
  const uint8_t* sc = static_cast<const uint8_t*>(scales);
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), two = _mm256_set1_epi8(3),
                third = _mm256_set1_epi8(4), nib = _mm256_set1_epi32(15);
  for (int u0 = 0; u0 < 2; u0 += NU) {
    Sum8 sum[MT][NU];
    for (int64_t b0 = 0; b0 < nb; b0 += bps) {
      __m256 acc[MT][NU];
      for (int r = 0; r < MT; ++r)
        for (int u = 0; u < NU; ++u) acc[r][u] = _mm256_setzero_ps();
      for (int64_t b = b0; b < b0 + bps; ++b) {
        __m256i h0[NU], h1[NU], hb[NU];
        __m256 dv[NU], mv[NU];
        if constexpr (F != kQ6)
          if (u0 == 0) prefetch_ahead(qh + b * 128), prefetch_ahead(qh + b * 128 + 64);
        if constexpr (F == kQ3)
          if (u0 == 0) prefetch_ahead(ql + b * 64);
        for (int u = 0; u < NU; ++u) {
          h0[u] = load32v(qh + b * 128 + (u0 + u) * 32), h1[u] = load32v(qh + b * 128 + 64 + (u0 + u) * 32);
          if constexpr (F == kQ3) hb[u] = load32v(ql + b * 64 + (u0 + u) * 32);
          dv[u] = load_half8(d + (b >> 3) * dl + (u0 + u) * 8);
          if constexpr (F == kQ2) mv[u] = load_half8(d + (b >> 3) * dl + 16 + (u0 + u) * 8);
        }
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          __m256i hacc[MT][NU], lacc[MT][NU];
          for (int r = 0; r < MT; ++r)
            for (int u = 0; u < NU; ++u) hacc[r][u] = lacc[r][u] = _mm256_setzero_si256();
#pragma GCC unroll 2
          for (int o = 2 * half; o < 2 * half + 2; ++o) {
            __m256i lo[NU], hi[NU];
            if constexpr (F == kQ6) {
              const uint8_t* qo = ql + (b * 4 + o) * 64;
              if (u0 == 0) prefetch_ahead(qo);
              for (int u = 0; u < NU; ++u) {
                const __m256i v = load32v(qo + (u0 + u) * 32);
                lo[u] = _mm256_or_si256(_mm256_and_si256(v, low), move_bits(h0[u], 2 * o, 4, top));
                hi[u] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), move_bits(h1[u], 2 * o, 4, top));
              }
            } else {
              for (int u = 0; u < NU; ++u) {
                lo[u] = move_bits(h0[u], 2 * o, 0, two), hi[u] = move_bits(h1[u], 2 * o, 0, two);
                if constexpr (F == kQ3) {
                  lo[u] = _mm256_or_si256(lo[u], move_bits(hb[u], o, 2, third));
                  hi[u] = _mm256_or_si256(hi[u], move_bits(hb[u], 4 + o, 2, third));
                }
              }
            }
            for (int r = 0; r < MT; ++r) {
              const int64_t at = r * K + b * 32 + o * 8;
              const __m256i x0 = bcast4(x.h + at), x1 = bcast4(x.h + at + 4);
              for (int u = 0; u < NU; ++u) hacc[r][u] = dot_wide(hacc[r][u], lo[u], x0, hi[u], x1);
              if constexpr (W) {
                const __m256i l0 = bcast4(x.l + at), l1 = bcast4(x.l + at + 4);
                for (int u = 0; u < NU; ++u) lacc[r][u] = dot_wide(lacc[r][u], lo[u], l0, hi[u], l1);
              }
            }
          }
          __m256 s[NU], m[NU];
          for (int u = 0; u < NU; ++u) {
            const __m128i raw = load8(sc + (2 * b + half) * kLanes + (u0 + u) * 8);
            if constexpr (F == kQ2) {
              const __m256i sm = _mm256_cvtepu8_epi32(raw);
              s[u] = _mm256_mul_ps(dv[u], _mm256_cvtepi32_ps(_mm256_and_si256(sm, nib)));
              m[u] = _mm256_mul_ps(mv[u], _mm256_cvtepi32_ps(_mm256_srli_epi32(sm, 4)));
            } else {
              s[u] = _mm256_mul_ps(dv[u], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
            }
          }
          for (int r = 0; r < MT; ++r) {
            const int32_t qs = x.qsum16[(r * nb + b) * 2 + half];
            const __m256 dx = _mm256_set1_ps(x.d[r * nb + b]);
            const __m256i bias = _mm256_set1_epi32(offset_of(F) * qs);
            for (int u = 0; u < NU; ++u) {
              const __m256i dot = W ? _mm256_add_epi32(_mm256_slli_epi32(hacc[r][u], 8), lacc[r][u]) : hacc[r][u];
              if constexpr (F == kQ2) {
                acc[r][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s[u], dx), acc[r][u]);
                acc[r][u] = _mm256_fmadd_ps(m[u], _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(qs)), dx), acc[r][u]);
              } else {
                acc[r][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot, bias)), _mm256_mul_ps(s[u], dx), acc[r][u]);
              }
            }
          }
        }
      }
      for (int r = 0; r < MT; ++r)
        for (int u = 0; u < NU; ++u) sum[r][u].add(acc[r][u]);
    }
    for (int r = 0; r < MT; ++r)
      for (int u = 0; u < NU; ++u) sum[r][u].put(y.at(r, 0), (u0 + u) * 8, nvalid - (u0 + u) * 8);
  }
}
// 16 ymm: 3 rows x 1 half at 8 bits, 2 at 16
constexpr int kK16Rows8 = 3, kK16Rows16 = 2;
#include "rows_avx2.h"
#endif

template <int F>
struct K16 {
  DOT_TILE_ADAPTER(Dot16, k16_dot_tile<MT, NP, true, F>)
  DOT_TILE_ADAPTER(Dot8, k16_dot_tile<MT, NP, false, F>)
};

// x (M, K) times a weight of format F: ql (Q6_K's nibbles, Q3_K's third bits, Q2_K none), qh, sc, d
// checked by the callers.
at::Tensor k16_linear(int F, const at::Tensor& x, const uint8_t* ql, const uint8_t* qh, const void* sc,
                      const at::Half* d, int64_t P, int64_t K, int64_t N, int64_t bits, int64_t segment, bool partial) {
  check_n(N, P);
  check_x(x, K);
  const int64_t M = x.size(0);
  segment = check_segment(segment, K, 256);
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), M, K, 0, bits == 16, kHalves, /*sums16=*/true);
  at::Tensor y = output(x, N, partial);
  const int64_t lstride = F == kQ6 ? K * 8 : K * 2, dstride = K / 256 * (F == kQ2 ? 32 : 16);
#if !defined(TOKENMILL_DOT512)
  if (F == kQ6 && M >= kManyRowsMin) {  // many rows: rows_avx2.h
    for_each_tile(P, M, N, kManyRows, 1, [&](int64_t p, int, int64_t r, int rows, int nvalid) {
      const XRows xr = rows_at(xq, r, K, 0);
      const YOut yt = out_at(y, r, p * kLanes);
      const int8_t* sct = static_cast<const int8_t*>(sc) + p * K;
      if (bits == 16) q6k_many_rows<true>(xr, rows, K, segment, ql + p * lstride, qh + p * K * 4, sct, d + p * dstride, yt, nvalid);
      else q6k_many_rows<false>(xr, rows, K, segment, ql + p * lstride, qh + p * K * 4, sct, d + p * dstride, yt, nvalid);
    });
    return y;
  }
#endif
  const int tile = bits == 16 ? kK16Rows16 : kK16Rows8;
  for_each_tile(P, M, N, tile, kDotPanels, [&](int64_t p, int np, int64_t r, int rows, int nvalid) {
    const XRows xr = rows_at(xq, r, K, 0);
    const YOut yt = out_at(y, r, p * kLanes);
    const uint8_t *qlt = ql ? ql + p * lstride : nullptr, *qht = qh + p * K * 4;
    const uint8_t* sct = static_cast<const uint8_t*>(sc) + p * K;
    const at::Half* dt = d + p * dstride;
    auto run = [&](auto format) {
      constexpr int f = decltype(format)::value;
      if (bits == 16) dispatch_dot<K16<f>::template Dot16>(rows, np, xr, K, segment, qlt, qht, static_cast<const void*>(sct), dt, yt, nvalid);
      else dispatch_dot<K16<f>::template Dot8>(rows, np, xr, K, segment, qlt, qht, static_cast<const void*>(sct), dt, yt, nvalid);
    };
    if (F == kQ6) run(std::integral_constant<int, kQ6>());
    else if (F == kQ3) run(std::integral_constant<int, kQ3>());
    else run(std::integral_constant<int, kQ2>());
  });
  return y;
}

}  // namespace

at::Tensor q6k_linear_dot(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                          const at::Tensor& d, int64_t N, int64_t bits, int64_t segment, bool partial) {
  check_bits(bits);
  TORCH_CHECK(ql.dim() == 3 && ql.scalar_type() == at::kByte && ql.size(2) == 64 && ql.is_contiguous(),
              "Q6_K low nibbles must be uint8 (P, K/8, 64)");
  const int64_t P = ql.size(0), K = ql.size(1) * 8;
  TORCH_CHECK(K % 256 == 0, "Q6_K needs K a multiple of 256");
  check_panel(qh, {P, K / 32, 128}, at::kByte, "Q6_K highs");
  check_panel(sc, {P, K / 16, 16}, at::kChar, "Q6_K scales");
  check_panel(d, {P, K / 256, 16}, at::kHalf, "Q6_K d");
  return k16_linear(kQ6, x, ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr(), d.data_ptr<at::Half>(), P, K,
                    N, bits, segment, partial);
}

at::Tensor q23k_linear_dot(const at::Tensor& x, const at::Tensor& q2, const at::Tensor& sc, const at::Tensor& d,
                           const c10::optional<at::Tensor>& hb, int64_t N, int64_t bits, int64_t segment, bool partial) {
  check_bits(bits);
  TORCH_CHECK(q2.dim() == 3 && q2.scalar_type() == at::kByte && q2.size(2) == 64 && q2.is_contiguous(),
              "Q2_K/Q3_K 2-bit fields must be uint8 (P, K/16, 64)");
  const int64_t P = q2.size(0), K = q2.size(1) * 16;
  TORCH_CHECK(K % 256 == 0, "Q2_K/Q3_K need K a multiple of 256");
  const bool three = hb.has_value() && hb->defined();
  if (three) check_panel(*hb, {P, K / 32, 64}, at::kByte, "Q3_K third bits");
  check_panel(sc, {P, K / 16, 16}, three ? at::kChar : at::kByte, three ? "Q3_K scales" : "Q2_K scales and minimums");
  check_panel(d, {P, K / 256, three ? 16 : 32}, at::kHalf, three ? "Q3_K d" : "Q2_K d and -dmin");
  return k16_linear(three ? kQ3 : kQ2, x, three ? hb->data_ptr<uint8_t>() : nullptr, q2.data_ptr<uint8_t>(), sc.data_ptr(),
                    d.data_ptr<at::Half>(), P, K, N, bits, segment, partial);
}
#else
}  // namespace
#endif

// ---------------------------------------------------------------------------- transcoding
// raw GGUF rows (N, super-blocks x bytes) -> the panels above, bits moved and nothing rounded (the
// loader's inner loop). Four outputs (j = 0..3) of a panel row at a time, as one 32-bit word:
// output byte [octet o, row i, j] = value(8o + j) | value(8o + 4 + j) << 4, and in both formats the
// 4 values an octet's word needs sit in 4 consecutive source bytes, under one shift.
namespace {
inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
constexpr uint32_t kNib = 0x0F0F0F0Fu, kTwo = 0x03030303u, kOne = 0x01010101u;

int64_t check_raw(const at::Tensor& raw, int64_t block_bytes) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.size(1) % block_bytes == 0,
              "raw rows must be contiguous uint8 (N, super-blocks x ", block_bytes, ")");
  return raw.size(1) / block_bytes;
}

void check_out(const at::Tensor& t, int64_t P, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) >= P && t.scalar_type() == dtype && t.is_contiguous(), what, " has the wrong shape");
}
}  // namespace

// Rows [row0, row0 + raw.size(0)) of the weight (row0 a multiple of 16) into panels from row0 / 16 of
// the full-size outputs; rows past the raw rows are zeros (a partial last panel).
// Q4_K and Q5_K share the super-block's head (d, dmin, 12 bytes of 6-bit scales and mins) and the
// nibbles' order; Q5_K's 32 bytes before the nibbles hold the fifth bits (weight 32g + t: bit g of
// byte t), moved into qh (P, K/32, 64) as linear.cpp's 5-bit tiles read them.
void q45k_pack(const at::Tensor& raw, at::Tensor q, at::Tensor sm, at::Tensor dd, const at::Tensor* qh, int64_t row0) {
  const int64_t bytes = qh ? 176 : 144, nib = qh ? 48 : 16;
  const int64_t SB = check_raw(raw, bytes), N = raw.size(0), P = (N + 15) / 16, K = SB * 256, rb = raw.size(1), p0 = row0 / 16;
  TORCH_CHECK(row0 % 16 == 0, "row0 must start a panel");
  check_out(q, p0 + P, at::kByte, "q"), check_out(sm, p0 + P, at::kByte, "sm"), check_out(dd, p0 + P, at::kHalf, "dd");
  TORCH_CHECK(q.size(1) == K / 8 && sm.size(1) == K / 32 && dd.size(1) == SB, "outputs do not match ", K, " inputs");
  if (qh) {
    check_out(*qh, p0 + P, at::kByte, "qh");
    TORCH_CHECK(qh->size(1) == K / 32 && qh->size(2) == 64, "qh must be (P, K/32, 64)");
  }
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t *qp = q.data_ptr<uint8_t>(), *smp = sm.data_ptr<uint8_t>(), *hp = qh ? qh->data_ptr<uint8_t>() : nullptr;
  uint16_t* ddp = reinterpret_cast<uint16_t*>(dd.data_ptr<at::Half>());
  at::parallel_for(0, P, 1, [&](int64_t a, int64_t b) {
    for (int64_t lp = a; lp < b; ++lp)
      for (int64_t s = 0; s < SB; ++s) {
        const int64_t p = p0 + lp;
        uint16_t* dpan = ddp + (p * SB + s) * 32;
        uint8_t* span = smp + (p * K / 32 + s * 8) * 32;
        uint8_t* qpan = qp + (p * K / 8 + s * 32) * 64;
        uint8_t* hpan = hp ? hp + (p * K / 32 + s * 8) * 64 : nullptr;
        for (int i = 0; i < 16; ++i) {
          if (lp * 16 + i >= N) {  // padding rows: zeros
            dpan[i] = dpan[16 + i] = 0;
            for (int g = 0; g < 8; ++g) span[g * 32 + i] = span[g * 32 + 16 + i] = 0;
            for (int o = 0; o < 32; ++o) store32(qpan + o * 64 + i * 4, 0);
            if (hpan)
              for (int g = 0; g < 8; ++g) store32(hpan + g * 64 + i * 4, 0);
            continue;
          }
          const uint8_t* blk = src + (lp * 16 + i) * rb + s * bytes;
          uint16_t d, dmin;
          std::memcpy(&d, blk, 2), std::memcpy(&dmin, blk + 2, 2);
          dpan[i] = d, dpan[16 + i] = dmin ^ 0x8000;  // -dmin, exactly
          const uint8_t* sc = blk + 4;  // 6-bit scale and min of group g (gguf-py's Q4_K.get_scale_min)
          for (int g = 0; g < 8; ++g) {
            span[g * 32 + i] = g < 4 ? sc[g] & 63 : (sc[g + 4] & 15) | ((sc[g - 4] >> 2) & 48);
            span[g * 32 + 16 + i] = g < 4 ? sc[g + 4] & 63 : (sc[g + 4] >> 4) | ((sc[g] >> 2) & 48);
          }
          // weight 64c + 32h + j is nibble h of byte nib + 32c + j: octet o -> c = o / 8, h = o % 8 / 4
          for (int o = 0; o < 32; ++o) {
            const uint8_t* at = blk + nib + 32 * (o / 8) + 8 * (o % 4);
            const int sh = 4 * (o % 8 / 4);
            store32(qpan + o * 64 + i * 4, ((load32(at) >> sh) & kNib) | ((load32(at + 4) >> sh) & kNib) << 4);
          }
          if (!hpan) continue;
          // group g, octet o: weights 8o + j and 8o + 4 + j at bits o and 4 + o of byte [g, i*4 + j]
          for (int g = 0; g < 8; ++g) {
            uint32_t word = 0;
            for (int o = 0; o < 4; ++o)
              word |= ((load32(blk + 16 + 8 * o) >> g) & kOne) << o | ((load32(blk + 20 + 8 * o) >> g) & kOne) << (4 + o);
            store32(hpan + g * 64 + i * 4, word);
          }
        }
      }
  });
}

void q4k_pack(const at::Tensor& raw, at::Tensor q, at::Tensor sm, at::Tensor dd, int64_t row0) {
  q45k_pack(raw, q, sm, dd, nullptr, row0);
}
void q5k_pack(const at::Tensor& raw, at::Tensor q, at::Tensor sm, at::Tensor dd, at::Tensor qh, int64_t row0) {
  q45k_pack(raw, q, sm, dd, &qh, row0);
}

void q6k_pack(const at::Tensor& raw, at::Tensor ql, at::Tensor qh, at::Tensor sc, at::Tensor d, int64_t row0) {
  const int64_t SB = check_raw(raw, 210), N = raw.size(0), P = (N + 15) / 16, K = SB * 256, rb = raw.size(1), p0 = row0 / 16;
  TORCH_CHECK(row0 % 16 == 0, "row0 must start a panel");
  check_out(ql, p0 + P, at::kByte, "ql"), check_out(qh, p0 + P, at::kByte, "qh"), check_out(sc, p0 + P, at::kChar, "sc");
  check_out(d, p0 + P, at::kHalf, "d");
  TORCH_CHECK(ql.size(1) == K / 8 && qh.size(1) == K / 32 && sc.size(1) == K / 16 && d.size(1) == SB,
              "outputs do not match ", K, " inputs");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t *qlp = ql.data_ptr<uint8_t>(), *qhp = qh.data_ptr<uint8_t>();
  int8_t* scp = sc.data_ptr<int8_t>();
  uint16_t* dp = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  at::parallel_for(0, P, 1, [&](int64_t a, int64_t b) {
    for (int64_t lp = a; lp < b; ++lp)
      for (int64_t s = 0; s < SB; ++s) {
        const int64_t p = p0 + lp;
        int8_t* span = scp + (p * K / 16 + s * 16) * 16;
        uint8_t* lpan = qlp + (p * K / 8 + s * 32) * 64;
        uint8_t* hpan = qhp + (p * K / 32 + s * 8) * 128;
        for (int i = 0; i < 16; ++i) {
          if (lp * 16 + i >= N) {
            dp[(p * SB + s) * 16 + i] = 0;
            for (int g = 0; g < 16; ++g) span[g * 16 + i] = 0;
            for (int o = 0; o < 32; ++o) store32(lpan + o * 64 + i * 4, 0);
            for (int k = 0; k < 16; ++k) store32(hpan + k * 64 + i * 4, 0);
            continue;
          }
          const uint8_t* blk = src + (lp * 16 + i) * rb + s * 210;
          std::memcpy(&dp[(p * SB + s) * 16 + i], blk + 208, 2);
          for (int g = 0; g < 16; ++g) span[g * 16 + i] = static_cast<int8_t>(blk[192 + g]);
          // weight w = 128h + r: low nibble (r / 64) of byte h*64 + r % 64, high bits 2 (r / 32) of byte
          // 128 + h*32 + r % 32 (gguf-py's Q6_K); octet o: h = o / 16, r = 8 (o % 16) + j
          for (int o = 0; o < 32; ++o) {
            const uint8_t* at = blk + 64 * (o / 16) + 8 * (o % 8);
            const int sh = 4 * (o % 16 / 8);
            store32(lpan + o * 64 + i * 4, ((load32(at) >> sh) & kNib) | ((load32(at + 4) >> sh) & kNib) << 4);
          }
          // block bk of 32 (w = 32 bk + 8 o' + 4 half + j): h = bk / 4, high bits 2 (bk % 4) of byte
          // 128 + 32 h + 8 o' + 4 half + j, placed at bits 2 o' of byte [bk, half*64 + i*4 + j]
          for (int bk = 0; bk < 8; ++bk)
            for (int half = 0; half < 2; ++half) {
              const uint8_t* at = blk + 128 + 32 * (bk / 4) + 4 * half;
              const int sh = 2 * (bk % 4);
              uint32_t word = 0;
              for (int o = 0; o < 4; ++o) word |= ((load32(at + 8 * o) >> sh) & kTwo) << (2 * o);
              store32(hpan + bk * 128 + half * 64 + i * 4, word);
            }
        }
      }
  });
}

// Q3_K (110 bytes per 256: hmask[32] | qs[64] | 12 bytes of 6-bit scales | d) and Q2_K (84: 16
// bytes sc | mn << 4 | qs[64] | d | dmin), hb given for Q3_K. Weight 128h + 32t + r: 2 bits at 2t of
// qs[32h + r]; Q3_K's third bit at bit 4h + t of hmask[r]. Input 32bb + 8o + 4 half + j of a
// super-block has h = bb / 4, t = bb % 4 (so 4h + t = bb), r = 8o + 4 half + j: an octet's 4 values
// sit in 4 consecutive bytes under one shift, as in q6k_pack.
void q23k_pack(const at::Tensor& raw, at::Tensor q2, at::Tensor sc, at::Tensor d, const at::Tensor* hb, int64_t row0) {
  const bool three = hb != nullptr;
  const int64_t bytes = three ? 110 : 84, dl = three ? 16 : 32;
  const int64_t SB = check_raw(raw, bytes), N = raw.size(0), P = (N + 15) / 16, K = SB * 256, rb = raw.size(1), p0 = row0 / 16;
  TORCH_CHECK(row0 % 16 == 0, "row0 must start a panel");
  check_out(q2, p0 + P, at::kByte, "q2"), check_out(sc, p0 + P, three ? at::kChar : at::kByte, "sc");
  check_out(d, p0 + P, at::kHalf, "d");
  TORCH_CHECK(q2.size(1) == K / 16 && sc.size(1) == K / 16 && d.size(1) == SB && d.size(2) == dl,
              "outputs do not match ", K, " inputs");
  if (three) {
    check_out(*hb, p0 + P, at::kByte, "hb");
    TORCH_CHECK(hb->size(1) == K / 32 && hb->size(2) == 64, "hb must be (P, K/32, 64)");
  }
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t *qp = q2.data_ptr<uint8_t>(), *hp = three ? hb->data_ptr<uint8_t>() : nullptr;
  uint8_t* sp = static_cast<uint8_t*>(sc.data_ptr());
  uint16_t* dp = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  at::parallel_for(0, P, 1, [&](int64_t a, int64_t b) {
    for (int64_t lp = a; lp < b; ++lp)
      for (int64_t s = 0; s < SB; ++s) {
        const int64_t p = p0 + lp;
        uint8_t* qpan = qp + (p * K / 16 + s * 16) * 64;
        uint8_t* span = sp + (p * K / 16 + s * 16) * 16;
        uint16_t* dpan = dp + (p * SB + s) * dl;
        uint8_t* hpan = three ? hp + (p * K / 32 + s * 8) * 64 : nullptr;
        for (int i = 0; i < 16; ++i) {
          if (lp * 16 + i >= N) {  // padding rows: zeros
            dpan[i] = 0;
            if (!three) dpan[16 + i] = 0;
            for (int k = 0; k < 16; ++k) span[k * 16 + i] = 0;
            for (int k = 0; k < 16; ++k) store32(qpan + k * 64 + i * 4, 0);
            if (three)
              for (int bb = 0; bb < 8; ++bb) store32(hpan + bb * 64 + i * 4, 0);
            continue;
          }
          const uint8_t* blk = src + (lp * 16 + i) * rb + s * bytes;
          const uint8_t* qs = blk + (three ? 32 : 16);
          if (three) {
            std::memcpy(&dpan[i], blk + 108, 2);
            for (int k = 0; k < 16; ++k) {
              const int ls = ((blk[96 + k % 8] >> (4 * (k / 8))) & 15) | (((blk[104 + k % 4] >> (2 * (k / 4))) & 3) << 4);
              span[k * 16 + i] = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
            }
          } else {
            uint16_t dmin;
            std::memcpy(&dpan[i], blk + 80, 2), std::memcpy(&dmin, blk + 82, 2);
            dpan[16 + i] = dmin ^ 0x8000;  // -dmin, exactly
            for (int k = 0; k < 16; ++k) span[k * 16 + i] = blk[k];
          }
          for (int bb = 0; bb < 8; ++bb) {
            for (int half = 0; half < 2; ++half) {
              uint32_t word = 0;
              for (int o = 0; o < 4; ++o) word |= ((load32(qs + 32 * (bb / 4) + 8 * o + 4 * half) >> (2 * (bb % 4))) & kTwo) << (2 * o);
              store32(qpan + (bb * 2 + half) * 64 + i * 4, word);
            }
            if (!three) continue;
            uint32_t word = 0;
            for (int o = 0; o < 4; ++o)
              word |= ((load32(blk + 8 * o) >> bb) & kOne) << o | ((load32(blk + 8 * o + 4) >> bb) & kOne) << (4 + o);
            store32(hpan + bb * 64 + i * 4, word);
          }
        }
      }
  });
}
void q3k_pack(const at::Tensor& raw, at::Tensor q2, at::Tensor sc, at::Tensor d, at::Tensor hb, int64_t row0) {
  q23k_pack(raw, q2, sc, d, &hb, row0);
}
void q2k_pack(const at::Tensor& raw, at::Tensor q2, at::Tensor sc, at::Tensor d, int64_t row0) {
  q23k_pack(raw, q2, sc, d, nullptr, row0);
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
#ifdef TOKENMILL_DOT
  m.def("q6k_linear_dot(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, int N, int bits, int segment=0, "
        "bool partial=False) -> Tensor");
  m.def("q23k_linear_dot(Tensor x, Tensor q2, Tensor sc, Tensor d, Tensor? hb, int N, int bits, int segment=0, "
        "bool partial=False) -> Tensor");
#endif
  m.def("q4k_pack(Tensor raw, Tensor(a!) q, Tensor(b!) sm, Tensor(c!) dd, int row0) -> ()");
  m.def("q5k_pack(Tensor raw, Tensor(a!) q, Tensor(b!) sm, Tensor(c!) dd, Tensor(d!) qh, int row0) -> ()");
  m.def("q6k_pack(Tensor raw, Tensor(a!) ql, Tensor(b!) qh, Tensor(c!) sc, Tensor(d!) d, int row0) -> ()");
  m.def("q3k_pack(Tensor raw, Tensor(a!) q2, Tensor(b!) sc, Tensor(c!) d, Tensor(d!) hb, int row0) -> ()");
  m.def("q2k_pack(Tensor raw, Tensor(a!) q2, Tensor(b!) sc, Tensor(c!) d, int row0) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
#ifdef TOKENMILL_DOT
  m.impl("q6k_linear_dot", &tokenmill::q6k_linear_dot);
  m.impl("q23k_linear_dot", &tokenmill::q23k_linear_dot);
#endif
  m.impl("q4k_pack", &tokenmill::q4k_pack);
  m.impl("q5k_pack", &tokenmill::q5k_pack);
  m.impl("q6k_pack", &tokenmill::q6k_pack);
  m.impl("q3k_pack", &tokenmill::q3k_pack);
  m.impl("q2k_pack", &tokenmill::q2k_pack);
}

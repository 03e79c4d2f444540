// GGUF Q6_K at its own width: w = d sc (q - 32) with q = lo | hi << 4 in 0..63, one signed 8-bit
// scale sc per 16 inputs and a float16 d per 256 (a super-block), exactly as the file stores them.
// (Q4_K and Q5_K run on the int4 tiles of linear.cpp with their super-block scales, KScales; Q5_K
// adds a plane of fifth bits. Their transcoding is here, q45k_pack.)
//
// Layout, 16-row panels like the other dot weights (kernels/__init__.py packs it):
//   ql  uint8 (P, K/8, 64)    the low nibbles in the int4 dot layout: byte [p, o, i*4 + j] =
//                             lo(q[16p+i, 8o+j]) | lo(q[16p+i, 8o+4+j]) << 4
//   qh  uint8 (P, K/32, 128)  per block of 32 inputs, the 2-bit highs: byte [p, b, i*4 + j] holds
//                             hi(q[n, 32b + 8o + j]) at bits 2o..2o+1 for o = 0..3, and byte
//                             [p, b, 64 + i*4 + j] the same of q[n, 32b + 8o + 4 + j]
//   sc  int8  (P, K/16, 16)   d   float16 (P, K/256, 16)
// 0.8203 bytes per weight: the file's own 210 bytes per 256. An octet's 6-bit weights are the
// nibbles OR'ed with their highs shifted into bits 4-5; VPDPBUSD (VPMADDUBSW on AVX2) multiplies
// them by the activations' integers, and sum((q - 32) xq) = q . xq - 32 sum(xq) per 16 inputs.
#include "dot.h"

namespace tokenmill {
namespace {
#ifdef TOKENMILL_DOT

#if defined(TOKENMILL_DOT512)
// bits 2o..2o+1 of every byte -> bits 4..5 (16-bit shifts: what crosses into the neighbour byte is masked off)
inline __m512i highs(__m512i h, int o, __m512i mask) {
  const __m512i v = o == 0 ? _mm512_slli_epi16(h, 4) : o == 1 ? _mm512_slli_epi16(h, 2) : o == 2 ? h : _mm512_srli_epi16(h, 2);
  return _mm512_and_si512(v, mask);
}
inline v16f int8x16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int MT, int NP, bool W>
__attribute__((noinline)) void q6k_dot_tile(XRows x, int64_t K, int64_t segment, const uint8_t* ql, const uint8_t* qh,
                                            const int8_t* sc, const at::Half* d, YOut y, int nvalid_last) {
  const int64_t nb = K / 32, bps = segment / 32, lstride = K * 8, hstride = K * 4, sstride = K, dstride = K / 16;
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  Sum16 sum[MT][NP];
  for (int64_t b0 = 0; b0 < nb; b0 += bps) {
    v16f acc[MT][NP];
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NP; ++j) acc[r][j] = v16f{};
    for (int64_t b = b0; b < b0 + bps; ++b) {
      __m512i h0[NP], h1[NP];
      v16f dv[NP];
      for (int j = 0; j < NP; ++j) {
        h0[j] = _mm512_loadu_si512(qh + j * hstride + b * 128), h1[j] = _mm512_loadu_si512(qh + j * hstride + b * 128 + 64);
        dv[j] = load_half(d + j * dstride + (b >> 3) * kLanes);
      }
      for (int half = 0; half < 2; ++half) {  // a sub-block of 16 inputs: octets 2 half and 2 half + 1
        __m512i hacc[MT][NP], lacc[MT][NP];
        for (int r = 0; r < MT; ++r)
          for (int j = 0; j < NP; ++j) hacc[r][j] = lacc[r][j] = _mm512_setzero_si512();
        for (int o = 2 * half; o < 2 * half + 2; ++o) {
          __m512i lo[NP], hi[NP];
          for (int j = 0; j < NP; ++j) {
            const uint8_t* qj = ql + j * lstride + (b * 4 + o) * 64;
            prefetch_ahead(qj);
            const __m512i v = _mm512_loadu_si512(qj);
            lo[j] = _mm512_or_si512(_mm512_and_si512(v, low), highs(h0[j], o, top));
            hi[j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), highs(h1[j], o, top));
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
          const __m512i bias = _mm512_set1_epi32(32 * x.qsum16[(r * nb + b) * 2 + half]);
          const float dx = x.d[r * nb + b];
          for (int j = 0; j < NP; ++j) {
            const __m512i dot = W ? _mm512_add_epi32(_mm512_slli_epi32(hacc[r][j], 8), lacc[r][j]) : hacc[r][j];
            const v16f s = dv[j] * int8x16(sc + j * sstride + (2 * b + half) * kLanes);
            acc[r][j] += v16f(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, bias))) * (s * dx);
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
constexpr int kQ6Rows8 = 4, kQ6Rows16 = 2;
#else
inline __m256i highs(__m256i h, int o, __m256i mask) {
  const __m256i v = o == 0 ? _mm256_slli_epi16(h, 4) : o == 1 ? _mm256_slli_epi16(h, 2) : o == 2 ? h : _mm256_srli_epi16(h, 2);
  return _mm256_and_si256(v, mask);
}
template <int MT, int NU, bool W>
__attribute__((noinline)) void q6k_dot_tile(XRows x, int64_t K, int64_t segment, const uint8_t* ql, const uint8_t* qh,
                                            const int8_t* sc, const at::Half* d, YOut y, int nvalid) {
  const int64_t nb = K / 32, bps = segment / 32;
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  for (int u0 = 0; u0 < 2; u0 += NU) {
    Sum8 sum[MT][NU];
    for (int64_t b0 = 0; b0 < nb; b0 += bps) {
      __m256 acc[MT][NU];
      for (int r = 0; r < MT; ++r)
        for (int u = 0; u < NU; ++u) acc[r][u] = _mm256_setzero_ps();
      for (int64_t b = b0; b < b0 + bps; ++b) {
        __m256i h0[NU], h1[NU];
        __m256 dv[NU];
        for (int u = 0; u < NU; ++u) {
          h0[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + b * 128 + (u0 + u) * 32));
          h1[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + b * 128 + 64 + (u0 + u) * 32));
          dv[u] = load_half8(d + (b >> 3) * kLanes + (u0 + u) * 8);
        }
        for (int half = 0; half < 2; ++half) {
          __m256i hacc[MT][NU], lacc[MT][NU];
          for (int r = 0; r < MT; ++r)
            for (int u = 0; u < NU; ++u) hacc[r][u] = lacc[r][u] = _mm256_setzero_si256();
          for (int o = 2 * half; o < 2 * half + 2; ++o) {
            const uint8_t* qo = ql + (b * 4 + o) * 64;
            if (u0 == 0) prefetch_ahead(qo);
            __m256i lo[NU], hi[NU];
            for (int u = 0; u < NU; ++u) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qo + (u0 + u) * 32));
              lo[u] = _mm256_or_si256(_mm256_and_si256(v, low), highs(h0[u], o, top));
              hi[u] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), highs(h1[u], o, top));
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
          for (int r = 0; r < MT; ++r) {
            const __m256i bias = _mm256_set1_epi32(32 * x.qsum16[(r * nb + b) * 2 + half]);
            const __m256 dx = _mm256_set1_ps(x.d[r * nb + b]);
            for (int u = 0; u < NU; ++u) {
              const __m256i dot = W ? _mm256_add_epi32(_mm256_slli_epi32(hacc[r][u], 8), lacc[r][u]) : hacc[r][u];
              const __m256 s = _mm256_mul_ps(dv[u], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                  load8(sc + (2 * b + half) * kLanes + (u0 + u) * 8))));
              acc[r][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot, bias)), _mm256_mul_ps(s, dx), acc[r][u]);
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
constexpr int kQ6Rows8 = 3, kQ6Rows16 = 2;
#endif

DOT_TILE_ADAPTER(Q6KDot16Tile, q6k_dot_tile<MT, NP, true>)
DOT_TILE_ADAPTER(Q6KDot8Tile, q6k_dot_tile<MT, NP, false>)

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
  check_n(N, P);
  check_x(x, K);
  const int64_t M = x.size(0);
  segment = check_segment(segment, K, 256);
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), M, K, 0, bits == 16, kHalves, /*sums16=*/true);
  at::Tensor y = output(x, N, partial);
  const uint8_t *qlp = ql.data_ptr<uint8_t>(), *qhp = qh.data_ptr<uint8_t>();
  const int8_t* scp = sc.data_ptr<int8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const int tile = bits == 16 ? kQ6Rows16 : kQ6Rows8;
  for_each_tile(P, M, N, tile, kDotPanels, [&](int64_t p, int np, int64_t r, int rows, int nvalid) {
    const XRows xr = rows_at(xq, r, K, 0);
    const YOut yt = out_at(y, r, p * kLanes);
    const uint8_t *qlt = qlp + p * K * 8, *qht = qhp + p * K * 4;
    const int8_t* sct = scp + p * K;
    const at::Half* dt = dp + p * (K / 16);
    if (bits == 16) dispatch_dot<Q6KDot16Tile>(rows, np, xr, K, segment, qlt, qht, sct, dt, yt, nvalid);
    else dispatch_dot<Q6KDot8Tile>(rows, np, xr, K, segment, qlt, qht, sct, dt, yt, nvalid);
  });
  return y;
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

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
#ifdef TOKENMILL_DOT
  m.def("q6k_linear_dot(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, int N, int bits, int segment=0, "
        "bool partial=False) -> Tensor");
#endif
  m.def("q4k_pack(Tensor raw, Tensor(a!) q, Tensor(b!) sm, Tensor(c!) dd, int row0) -> ()");
  m.def("q5k_pack(Tensor raw, Tensor(a!) q, Tensor(b!) sm, Tensor(c!) dd, Tensor(d!) qh, int row0) -> ()");
  m.def("q6k_pack(Tensor raw, Tensor(a!) ql, Tensor(b!) qh, Tensor(c!) sc, Tensor(d!) d, int row0) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
#ifdef TOKENMILL_DOT
  m.impl("q6k_linear_dot", &tokenmill::q6k_linear_dot);
#endif
  m.impl("q4k_pack", &tokenmill::q4k_pack);
  m.impl("q5k_pack", &tokenmill::q5k_pack);
  m.impl("q6k_pack", &tokenmill::q6k_pack);
}

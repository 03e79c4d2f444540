// GGUF Q6_K at its own width: w = d sc (q - 32) with q = lo | hi << 4 in 0..63, one signed 8-bit
// scale sc per 16 inputs and a float16 d per 256 (a super-block), exactly as the file stores them.
// (Q4_K runs on the int4 tiles of linear.cpp with its super-block scales: KScales.)
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
// two octets of 6-bit weights times x's int8 into int32: VPMADDUBSW's pairs (63 x 128 x 2 each) add
// up to 32,256 over the two, within int16; VPMADDWD by ones widens them
#if defined(__AVXVNNI__)
inline __m256i dot6(__m256i acc, __m256i lo, __m256i x0, __m256i hi, __m256i x1) {
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, lo, x0), hi, x1);
}
#else
inline __m256i dot6(__m256i acc, __m256i lo, __m256i x0, __m256i hi, __m256i x1) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

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
              for (int u = 0; u < NU; ++u) hacc[r][u] = dot6(hacc[r][u], lo[u], x0, hi[u], x1);
              if constexpr (W) {
                const __m256i l0 = bcast4(x.l + at), l1 = bcast4(x.l + at + 4);
                for (int u = 0; u < NU; ++u) lacc[r][u] = dot6(lacc[r][u], lo[u], l0, hi[u], l1);
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
  TORCH_CHECK(qh.sizes() == at::IntArrayRef({P, K / 32, 128}) && qh.scalar_type() == at::kByte && qh.is_contiguous(),
              "Q6_K highs must be uint8 (P, K/32, 128)");
  TORCH_CHECK(sc.sizes() == at::IntArrayRef({P, K / 16, 16}) && sc.scalar_type() == at::kChar && sc.is_contiguous(),
              "Q6_K scales must be int8 (P, K/16, 16)");
  TORCH_CHECK(d.sizes() == at::IntArrayRef({P, K / 256, 16}) && d.scalar_type() == at::kHalf && d.is_contiguous(),
              "Q6_K d must be float16 (P, K/256, 16)");
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
// loader's inner loop: in numpy and torch it was most of a 3B model's load time).
namespace {
// The octets of 16 rows' 256 values q[16][256] (0..15) into the int4 dot layout at out (32 octets x 64 bytes).
void put_nibbles(const uint8_t (*q)[256], uint8_t* out) {
  for (int o = 0; o < 32; ++o)
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 4; ++j) out[o * 64 + i * 4 + j] = (q[i][8 * o + j] & 15) | (q[i][8 * o + 4 + j] & 15) << 4;
}

int64_t check_raw(const at::Tensor& raw, int64_t block_bytes) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.size(1) % block_bytes == 0,
              "raw rows must be contiguous uint8 (N, super-blocks x ", block_bytes, ")");
  return raw.size(1) / block_bytes;
}
}  // namespace

std::vector<at::Tensor> q4k_pack(const at::Tensor& raw) {
  const int64_t SB = check_raw(raw, 144), N = raw.size(0), P = (N + 15) / 16, K = SB * 256, rb = raw.size(1);
  at::Tensor q = at::zeros({P, K / 8, 64}, raw.options()), sm = at::zeros({P, K / 32, 32}, raw.options());
  at::Tensor dd = at::zeros({P, SB, 32}, raw.options().dtype(at::kHalf));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t *qp = q.data_ptr<uint8_t>(), *smp = sm.data_ptr<uint8_t>();
  uint16_t* ddp = reinterpret_cast<uint16_t*>(dd.data_ptr<at::Half>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    uint8_t v[16][256];
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t s = 0; s < SB; ++s) {
        std::memset(v, 0, sizeof(v));
        for (int i = 0; i < 16 && p * 16 + i < N; ++i) {
          const uint8_t* b = src + (p * 16 + i) * rb + s * 144;
          uint16_t d, dmin;
          std::memcpy(&d, b, 2), std::memcpy(&dmin, b + 2, 2);
          ddp[(p * SB + s) * 32 + i] = d, ddp[(p * SB + s) * 32 + 16 + i] = dmin ^ 0x8000;  // -dmin, exactly
          const uint8_t* sc = b + 4;  // 6-bit scale and min of group g (gguf-py's Q4_K.get_scale_min)
          for (int g = 0; g < 8; ++g) {
            const uint8_t scale = g < 4 ? sc[g] & 63 : (sc[g + 4] & 15) | ((sc[g - 4] >> 2) & 48);
            const uint8_t mn = g < 4 ? sc[g + 4] & 63 : (sc[g + 4] >> 4) | ((sc[g] >> 2) & 48);
            smp[((p * K / 32) + s * 8 + g) * 32 + i] = scale, smp[((p * K / 32) + s * 8 + g) * 32 + 16 + i] = mn;
          }
          for (int w = 0; w < 256; ++w) v[i][w] = (b[16 + 32 * (w / 64) + w % 32] >> (4 * ((w / 32) % 2))) & 15;
        }
        put_nibbles(v, qp + (p * K / 8 + s * 32) * 64);
      }
  });
  return {q, sm, dd};
}

std::vector<at::Tensor> q6k_pack(const at::Tensor& raw) {
  const int64_t SB = check_raw(raw, 210), N = raw.size(0), P = (N + 15) / 16, K = SB * 256, rb = raw.size(1);
  at::Tensor ql = at::zeros({P, K / 8, 64}, raw.options()), qh = at::zeros({P, K / 32, 128}, raw.options());
  at::Tensor sc = at::zeros({P, K / 16, 16}, raw.options().dtype(at::kChar));
  at::Tensor d = at::zeros({P, SB, 16}, raw.options().dtype(at::kHalf));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t *qlp = ql.data_ptr<uint8_t>(), *qhp = qh.data_ptr<uint8_t>();
  int8_t* scp = sc.data_ptr<int8_t>();
  uint16_t* dp = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    uint8_t v[16][256];
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t s = 0; s < SB; ++s) {
        std::memset(v, 0, sizeof(v));
        for (int i = 0; i < 16 && p * 16 + i < N; ++i) {
          const uint8_t* b = src + (p * 16 + i) * rb + s * 210;
          std::memcpy(&dp[(p * SB + s) * 16 + i], b + 208, 2);
          for (int g = 0; g < 16; ++g) scp[((p * K / 16) + s * 16 + g) * 16 + i] = static_cast<int8_t>(b[192 + g]);
          for (int w = 0; w < 256; ++w) {  // gguf-py's Q6_K: halves of 128, low nibbles of 64, highs of 32
            const int h = w / 128, r = w % 128;
            const int lo = (b[h * 64 + r % 64] >> (4 * (r / 64))) & 15, hi = (b[128 + h * 32 + r % 32] >> (2 * (r / 32))) & 3;
            v[i][w] = static_cast<uint8_t>(lo | hi << 4);
          }
        }
        put_nibbles(v, qlp + (p * K / 8 + s * 32) * 64);
        for (int blk = 0; blk < 8; ++blk) {  // highs: bits 2o..2o+1 of byte [half*64 + i*4 + j] = hi(32 blk + 8o + 4 half + j)
          uint8_t* out = qhp + ((p * K / 32) + s * 8 + blk) * 128;
          for (int half = 0; half < 2; ++half)
            for (int i = 0; i < 16; ++i)
              for (int j = 0; j < 4; ++j) {
                uint8_t byte = 0;
                for (int o = 0; o < 4; ++o) byte |= ((v[i][32 * blk + 8 * o + 4 * half + j] >> 4) & 3) << (2 * o);
                out[half * 64 + i * 4 + j] = byte;
              }
        }
      }
  });
  return {ql, qh, sc, d};
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
#ifdef TOKENMILL_DOT
  m.def("q6k_linear_dot(Tensor x, Tensor ql, Tensor qh, Tensor sc, Tensor d, int N, int bits, int segment=0, "
        "bool partial=False) -> Tensor");
#endif
  m.def("q4k_pack(Tensor raw) -> Tensor[]");
  m.def("q6k_pack(Tensor raw) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
#ifdef TOKENMILL_DOT
  m.impl("q6k_linear_dot", &tokenmill::q6k_linear_dot);
#endif
  m.impl("q4k_pack", &tokenmill::q4k_pack);
  m.impl("q6k_pack", &tokenmill::q6k_pack);
}

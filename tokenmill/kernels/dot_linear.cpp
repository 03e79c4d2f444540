// The dot layout's linear kernels (linear.cpp's comment describes both layouts): x rounded to
// 16- or 8-bit integers per 32 inputs and multiplied by the weight bytes in integer products, on
// int4, 5-bit, Q4_K/Q5_K and int8 (Q8_0) panels. Only variants built with TOKENMILL_DOT hold them.
#include "dot.h"

namespace tokenmill {
#ifdef TOKENMILL_DOT
namespace {

#if defined(TOKENMILL_DOT512)
// bit t of every byte -> bit 4 (16-bit shifts: what crosses into the neighbour byte is masked off after)
inline __m512i fifth_bit(__m512i h, int t) {
  switch (t) {
    case 0: return _mm512_slli_epi16(h, 4);
    case 1: return _mm512_slli_epi16(h, 3);
    case 2: return _mm512_slli_epi16(h, 2);
    case 3: return _mm512_slli_epi16(h, 1);
    case 4: return h;
    case 5: return _mm512_srli_epi16(h, 1);
    case 6: return _mm512_srli_epi16(h, 2);
    default: return _mm512_srli_epi16(h, 3);
  }
}

// int4: per (row, panel) an int32 chain of weights times h and, for 16-bit x (W), one times l.
// H: 5-bit weights (Q5_0, Q5_1, Q5_K), the nibbles' fifth bits from a plane of one bit per weight
// (qh, see fifth_bit), OR'ed in as bit 4: the same products on 0..31.
template <int MT, int NP, bool W, class S, bool H = false>
__attribute__((noinline)) void int4_dot_tile(XRows x, int64_t K, int64_t group, int64_t segment, const uint8_t* q, S sc,
                                             YOut y, int nvalid_last, const uint8_t* qh = nullptr) {
  const int64_t nb = K / 32, ng = K / group, bpg = group / 32, gps = segment / group, qstride = K * 8, hstride = K * 2;
  const __m512i low = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  Sum16 sum[MT][NP];
  for (int64_t g0 = 0; g0 < ng; g0 += gps) {
    v16f acc[MT][NP];
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NP; ++j) acc[r][j] = v16f{};
    for (int64_t g = g0; g < g0 + gps; ++g) {
      v16f sw[NP], mw[NP];
      for (int j = 0; j < NP; ++j) sw[j] = sc.scale(j, g), mw[j] = sc.min(j, g);
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
        __m512i hacc[MT][NP], lacc[MT][NP];
        for (int r = 0; r < MT; ++r)
          for (int j = 0; j < NP; ++j) hacc[r][j] = lacc[r][j] = _mm512_setzero_si512();
        __m512i hb[NP];
        if constexpr (H)
          for (int j = 0; j < NP; ++j) hb[j] = _mm512_loadu_si512(qh + j * hstride + b * 64);
        for (int o = 0; o < 4; ++o) {
          __m512i lo[NP], hi[NP];
          for (int j = 0; j < NP; ++j) {
            const uint8_t* qj = q + j * qstride + (b * 4 + o) * 64;
            prefetch_ahead(qj);
            const __m512i v = _mm512_loadu_si512(qj);
            lo[j] = _mm512_and_si512(v, low), hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            if constexpr (H) {
              lo[j] = _mm512_or_si512(lo[j], _mm512_and_si512(fifth_bit(hb[j], o), bit4));
              hi[j] = _mm512_or_si512(hi[j], _mm512_and_si512(fifth_bit(hb[j], o + 4), bit4));
            }
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

// int8: (q + 128) . xq - 128 sum(xq) per block of 32; each segment's sum scaled per output row, or
// (G: GGUF Q8_0) each block's by its own scale, float16 (P, K/32, 16) as the file stores it.
template <int MT, int NP, bool W, bool G = false>
__attribute__((noinline)) void int8_dot_tile(XRows x, int64_t K, int64_t segment, const uint8_t* q, const void* sv, YOut y,
                                             int nvalid_last) {
  const float* s = static_cast<const float*>(sv);       // per output row
  const at::Half* sb = static_cast<const at::Half*>(sv);  // G: per block, float16 (Q8_0's own d)
  const int64_t nb = K / 32, bps = segment / 32, qstride = K * kLanes, sstride = G ? K / 2 : kLanes;
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
      v16f sb16[NP];  // G: the block's scales, once per block for every row
      if constexpr (G)
        for (int j = 0; j < NP; ++j) sb16[j] = load_half(sb + j * sstride + b * kLanes);
      for (int r = 0; r < MT; ++r) {
        const __m512i bias = _mm512_set1_epi32(128 * x.qsum[r * nb + b]);
        const float d = x.d[r * nb + b];
        for (int j = 0; j < NP; ++j) {
          const __m512i dot = W ? _mm512_add_epi32(_mm512_slli_epi32(hacc[r][j], 8), lacc[r][j]) : hacc[r][j];
          const v16f prod = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, bias));
          if constexpr (G) acc[r][j] += prod * (sb16[j] * d);
          else acc[r][j] += prod * d;
        }
      }
    }
    for (int r = 0; r < MT; ++r)  // scaled as a whole sum would be
      for (int j = 0; j < NP; ++j) sum[r][j].add(G ? acc[r][j] : acc[r][j] * load(s + j * sstride));
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

// As the AVX-512 HalfScales and KScales, 8 outputs (half u of the panel) at a time.
struct HalfScales {
  const at::Half *s, *m;
  int64_t stride;
  float off = 8.f;  // without m: m = -off s
  __m256 scale(int64_t g, int u) const { return load_half8(s + g * kLanes + u * 8); }
  __m256 min(int64_t g, int u) const {
    return m ? load_half8(m + g * kLanes + u * 8) : _mm256_mul_ps(scale(g, u), _mm256_set1_ps(-off));
  }
};
struct KScales {
  const uint8_t* sm;
  const at::Half* dd;
  int64_t sm_stride, dd_stride;
  static __m256 bytes8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(p))); }
  __m256 scale(int64_t g, int u) const { return _mm256_mul_ps(load_half8(dd + (g >> 3) * 32 + u * 8), bytes8(sm + g * 32 + u * 8)); }
  __m256 min(int64_t g, int u) const {
    return _mm256_mul_ps(load_half8(dd + (g >> 3) * 32 + 16 + u * 8), bytes8(sm + g * 32 + 16 + u * 8));
  }
};

// bit t of every byte -> bit 4, as the AVX-512 fifth_bit
inline __m256i fifth_bit(__m256i h, int t) {
  switch (t) {
    case 0: return _mm256_slli_epi16(h, 4);
    case 1: return _mm256_slli_epi16(h, 3);
    case 2: return _mm256_slli_epi16(h, 2);
    case 3: return _mm256_slli_epi16(h, 1);
    case 4: return h;
    case 5: return _mm256_srli_epi16(h, 1);
    case 6: return _mm256_srli_epi16(h, 2);
    default: return _mm256_srli_epi16(h, 3);
  }
}

// H (5-bit weights): VPMADDUBSW's pairs reach 2 x 31 x 128, so the int16 sums are widened per octet
// (dot_wide) instead of once per block; AVX-VNNI adds into int32 either way.
template <int MT, int NU, bool W, class S, bool H = false>
__attribute__((noinline)) void int4_dot_tile(XRows x, int64_t K, int64_t group, int64_t segment, const uint8_t* q, S sc,
                                             YOut y, int nvalid, const uint8_t* qh = nullptr) {
  const int64_t nb = K / 32, ng = K / group, bpg = group / 32, gps = segment / group;
  const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  for (int u0 = 0; u0 < 2; u0 += NU) {
    Sum8 sum[MT][NU];
    for (int64_t g0 = 0; g0 < ng; g0 += gps) {
      __m256 acc[MT][NU];
      for (int r = 0; r < MT; ++r)
        for (int u = 0; u < NU; ++u) acc[r][u] = _mm256_setzero_ps();
      for (int64_t g = g0; g < g0 + gps; ++g) {
        __m256 sw[NU], mw[NU];
        for (int u = 0; u < NU; ++u)
          sw[u] = sc.scale(g, u0 + u), mw[u] = sc.min(g, u0 + u);
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
          __m256i hacc[MT][NU], lacc[MT][NU];
          for (int r = 0; r < MT; ++r)
            for (int u = 0; u < NU; ++u) hacc[r][u] = lacc[r][u] = _mm256_setzero_si256();
          __m256i hb[NU];
          if constexpr (H)
            for (int u = 0; u < NU; ++u) hb[u] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + b * 64 + (u0 + u) * 32));
          for (int o = 0; o < 4; ++o) {
            const uint8_t* qo = q + (b * 4 + o) * 64;
            if (u0 == 0) prefetch_ahead(qo);
            __m256i lo[NU], hi[NU];
            for (int u = 0; u < NU; ++u) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qo + (u0 + u) * 32));
              lo[u] = _mm256_and_si256(v, low), hi[u] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
              if constexpr (H) {
                lo[u] = _mm256_or_si256(lo[u], _mm256_and_si256(fifth_bit(hb[u], o), bit4));
                hi[u] = _mm256_or_si256(hi[u], _mm256_and_si256(fifth_bit(hb[u], o + 4), bit4));
              }
            }
            for (int r = 0; r < MT; ++r) {
              const int64_t at = r * K + b * 32 + o * 8;
              const __m256i h0 = bcast4(x.h + at), h1 = bcast4(x.h + at + 4);
              for (int u = 0; u < NU; ++u)
                hacc[r][u] = H ? dot_wide(hacc[r][u], lo[u], h0, hi[u], h1) : dot_quads(dot_quads(hacc[r][u], lo[u], h0), hi[u], h1);
              if constexpr (W) {
                const __m256i l0 = bcast4(x.l + at), l1 = bcast4(x.l + at + 4);
                for (int u = 0; u < NU; ++u)
                  lacc[r][u] = H ? dot_wide(lacc[r][u], lo[u], l0, hi[u], l1) : dot_quads(dot_quads(lacc[r][u], lo[u], l0), hi[u], l1);
              }
            }
          }
          for (int r = 0; r < MT; ++r) {
            const __m256 d = _mm256_set1_ps(x.d[r * nb + b]);
            for (int u = 0; u < NU; ++u) {
              const __m256i hs = H ? hacc[r][u] : quad_sums(hacc[r][u]);
              const __m256i dot = W ? _mm256_add_epi32(_mm256_slli_epi32(hs, 8), H ? lacc[r][u] : quad_sums(lacc[r][u])) : hs;
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
template <int MT, int NU, bool W, bool G = false>
__attribute__((noinline)) void int8_dot_tile(XRows x, int64_t K, int64_t segment, const uint8_t* q, const void* sv, YOut y,
                                             int nvalid) {
  const float* s = static_cast<const float*>(sv);
  const at::Half* sb = static_cast<const at::Half*>(sv);
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
            const __m256 ds = G ? _mm256_mul_ps(load_half8(sb + b * kLanes + (u0 + u) * 8), d) : d;
            acc[r][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot, bias)), ds, acc[r][u]);
          }
        }
      }
      for (int r = 0; r < MT; ++r)  // scaled as a whole sum would be
        for (int u = 0; u < NU; ++u) sum[r][u].add(G ? acc[r][u] : _mm256_mul_ps(acc[r][u], _mm256_loadu_ps(s + (u0 + u) * 8)));
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
constexpr int kInt4Rows8 = 6, kInt4Rows16 = 4, kInt8Rows8 = 4, kInt8Rows16 = 4;
constexpr XForm kInt8X = kInt16;
#include "rows_avx2.h"
#endif

// Many rows of x on AVX2 / AVX-VNNI (rows_avx2.h) for the int4 and 5-bit types (hp: the fifth
// bits): true where it ran the product.
template <class MakeScales>
bool int4_many(const QuantizedX& xq, int64_t M, int64_t N, int64_t K, int64_t P, int64_t group, int64_t segment,
               bool wide, const uint8_t* qp, const uint8_t* hp, MakeScales make, at::Tensor& y) {
#if defined(TOKENMILL_DOT512)
  return false;
#else
  if (M < kManyRowsMin) return false;
  for_each_tile(P, M, N, kManyRows, 1, [&](int64_t p, int, int64_t r, int rows, int nvalid) {
    const XRows xr = rows_at(xq, r, K, group);
    const YOut yt = out_at(y, r, p * kLanes);
    const uint8_t *qt = qp + p * K * 8, *ht = hp ? hp + p * K * 2 : nullptr;
    if (hp && wide) int4_many_rows<true, decltype(make(p)), true>(xr, rows, K, group, segment, qt, make(p), yt, nvalid, ht);
    else if (hp) int4_many_rows<false, decltype(make(p)), true>(xr, rows, K, group, segment, qt, make(p), yt, nvalid, ht);
    else if (wide) int4_many_rows<true>(xr, rows, K, group, segment, qt, make(p), yt, nvalid);
    else int4_many_rows<false>(xr, rows, K, group, segment, qt, make(p), yt, nvalid);
  });
  return true;
#endif
}

DOT_TILE_ADAPTER(Int4Dot16Tile, int4_dot_tile<MT, NP, true, HalfScales>)
DOT_TILE_ADAPTER(Int4Dot8Tile, int4_dot_tile<MT, NP, false, HalfScales>)
DOT_TILE_ADAPTER(Q4KDot16Tile, int4_dot_tile<MT, NP, true, KScales>)
DOT_TILE_ADAPTER(Q4KDot8Tile, int4_dot_tile<MT, NP, false, KScales>)
DOT_TILE_ADAPTER(Int8Dot16Tile, int8_dot_tile<MT, NP, true>)
DOT_TILE_ADAPTER(Int8Dot8Tile, int8_dot_tile<MT, NP, false>)
DOT_TILE_ADAPTER(Int5Dot16Tile, int4_dot_tile<MT, NP, true, HalfScales, true>)
DOT_TILE_ADAPTER(Int5Dot8Tile, int4_dot_tile<MT, NP, false, HalfScales, true>)
DOT_TILE_ADAPTER(Q5KDot16Tile, int4_dot_tile<MT, NP, true, KScales, true>)
DOT_TILE_ADAPTER(Q5KDot8Tile, int4_dot_tile<MT, NP, false, KScales, true>)
DOT_TILE_ADAPTER(Int8GDot16Tile, int8_dot_tile<MT, NP, true, true>)
DOT_TILE_ADAPTER(Int8GDot8Tile, int8_dot_tile<MT, NP, false, true>)

}  // namespace

// The 5-bit types' plane of fifth bits, uint8 (P, K/32, 64): byte [p, b, i*4 + j] holds bit 4 of
// q[16p+i, 32b + 8o + j] at bit o and of q[16p+i, 32b + 8o + 4 + j] at bit 4 + o (octets o = 0..3).
const uint8_t* fifth_bits(const c10::optional<at::Tensor>& qh, int64_t P, int64_t K) {
  if (!qh || !qh->defined()) return nullptr;
  check_panel(*qh, {P, K / 32, 64}, at::kByte, "5-bit weights' fifth bits");
  return qh->data_ptr<uint8_t>();
}

at::Tensor int4_linear_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const c10::optional<at::Tensor>& m,
                           int64_t N, int64_t bits, int64_t segment, bool partial, const c10::optional<at::Tensor>& qh) {
  check_bits(bits);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.size(2) == 64 && q.is_contiguous(),
              "int4 dot weights must be uint8 (P, K/8, 64)");
  const int64_t P = q.size(0), K = q.size(1) * 8, G = s.size(1);
  TORCH_CHECK(G > 0 && K % G == 0 && (K / G) % 32 == 0, "group size must be a multiple of 32 dividing K");
  const bool sym = !m || !m->defined();  // symmetric: w = s (q - 8), or s (q - 16) with fifth bits
  check_scales_mins(s, sym ? s : *m, P, at::kHalf);
  check_n(N, P);
  check_x(x, K);
  const int64_t M = x.size(0), group = K / G;
  segment = check_segment(segment, K, group);
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), M, K, group, bits == 16, kHalves);
  at::Tensor y = output(x, N, partial);
  const uint8_t *qp = q.data_ptr<uint8_t>(), *hp = fifth_bits(qh, P, K);
  const at::Half *sp = s.data_ptr<at::Half>(), *mp = sym ? nullptr : m->data_ptr<at::Half>();
  auto scales = [&](int64_t p) {
    return HalfScales{sp + p * G * kLanes, mp ? mp + p * G * kLanes : nullptr, G * kLanes, hp ? 16.f : 8.f};
  };
  if (int4_many(xq, M, N, K, P, group, segment, bits == 16, qp, hp, scales, y)) return y;
  const int tile = bits == 16 ? kInt4Rows16 : kInt4Rows8;
  for_each_tile(P, M, N, tile, kDotPanels, [&](int64_t p, int np, int64_t r, int rows, int nvalid) {
    const XRows xr = rows_at(xq, r, K, group);
    const uint8_t* qt = qp + p * K * 8;
    const HalfScales sc{sp + p * G * kLanes, mp ? mp + p * G * kLanes : nullptr, G * kLanes, hp ? 16.f : 8.f};
    const YOut yt = out_at(y, r, p * kLanes);
    if (hp && bits == 16) dispatch_dot<Int5Dot16Tile>(rows, np, xr, K, group, segment, qt, sc, yt, nvalid, hp + p * K * 2);
    else if (hp) dispatch_dot<Int5Dot8Tile>(rows, np, xr, K, group, segment, qt, sc, yt, nvalid, hp + p * K * 2);
    else if (bits == 16) dispatch_dot<Int4Dot16Tile>(rows, np, xr, K, group, segment, qt, sc, yt, nvalid);
    else dispatch_dot<Int4Dot8Tile>(rows, np, xr, K, group, segment, qt, sc, yt, nvalid);
  });
  return y;
}

at::Tensor q4k_linear_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sm, const at::Tensor& dd,
                          int64_t N, int64_t bits, int64_t segment, bool partial, const c10::optional<at::Tensor>& qh) {
  check_bits(bits);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.size(2) == 64 && q.is_contiguous(),
              "Q4_K weights must be uint8 (P, K/8, 64)");
  const int64_t P = q.size(0), K = q.size(1) * 8;
  TORCH_CHECK(K % 256 == 0, "Q4_K needs K a multiple of 256");
  check_panel(sm, {P, K / 32, 32}, at::kByte, "Q4_K scales/mins");
  check_panel(dd, {P, K / 256, 32}, at::kHalf, "Q4_K d/-dmin");
  check_n(N, P);
  check_x(x, K);
  const int64_t M = x.size(0), group = 32;
  segment = check_segment(segment, K, 256);
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), M, K, group, bits == 16, kHalves);
  at::Tensor y = output(x, N, partial);
  const uint8_t *qp = q.data_ptr<uint8_t>(), *smp = sm.data_ptr<uint8_t>(), *hp = fifth_bits(qh, P, K);
  const at::Half* ddp = dd.data_ptr<at::Half>();
  auto scales = [&](int64_t p) { return KScales{smp + p * K, ddp + p * (K / 8), K, K / 8}; };
  if (int4_many(xq, M, N, K, P, group, segment, bits == 16, qp, hp, scales, y)) return y;
  const int tile = bits == 16 ? kInt4Rows16 : kInt4Rows8;
  for_each_tile(P, M, N, tile, kDotPanels, [&](int64_t p, int np, int64_t r, int rows, int nvalid) {
    const XRows xr = rows_at(xq, r, K, group);
    const KScales sc{smp + p * K, ddp + p * (K / 8), K, K / 8};
    const YOut yt = out_at(y, r, p * kLanes);
    const uint8_t* qt = qp + p * K * 8;
    if (hp && bits == 16) dispatch_dot<Q5KDot16Tile>(rows, np, xr, K, group, segment, qt, sc, yt, nvalid, hp + p * K * 2);
    else if (hp) dispatch_dot<Q5KDot8Tile>(rows, np, xr, K, group, segment, qt, sc, yt, nvalid, hp + p * K * 2);
    else if (bits == 16) dispatch_dot<Q4KDot16Tile>(rows, np, xr, K, group, segment, qt, sc, yt, nvalid);
    else dispatch_dot<Q4KDot8Tile>(rows, np, xr, K, group, segment, qt, sc, yt, nvalid);
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
  const bool grouped = s.dim() == 3;  // a float16 scale per block of 32 inputs (GGUF Q8_0)
  if (grouped) check_panel(s, {P, K / 32, kLanes}, at::kHalf, "int8 block scales");
  else TORCH_CHECK(s.numel() == P * kLanes && s.scalar_type() == at::kFloat && s.is_contiguous(),
                   "scales must be float (P*16,)");
  check_n(N, P);
  check_x(x, K);
  const int64_t M = x.size(0);
  segment = check_segment(segment, K, 32);
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), M, K, 0, bits == 16, kInt8X);
  at::Tensor y = output(x, N, partial);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = grouped ? nullptr : s.data_ptr<float>();
  const at::Half* hp = grouped ? s.data_ptr<at::Half>() : nullptr;
  const int tile = bits == 16 ? kInt8Rows16 : kInt8Rows8;
  for_each_tile(P, M, N, tile, kDotPanels, [&](int64_t p, int np, int64_t r, int rows, int nvalid) {
    const XRows xr = rows_at(xq, r, K, 0);
    const uint8_t* qt = qp + p * K * kLanes;
    const YOut yt = out_at(y, r, p * kLanes);
    const void* st = grouped ? static_cast<const void*>(hp + p * K / 2) : static_cast<const void*>(sp + p * kLanes);
    if (grouped && bits == 16) dispatch_dot<Int8GDot16Tile>(rows, np, xr, K, segment, qt, st, yt, nvalid);
    else if (grouped) dispatch_dot<Int8GDot8Tile>(rows, np, xr, K, segment, qt, st, yt, nvalid);
    else if (bits == 16) dispatch_dot<Int8Dot16Tile>(rows, np, xr, K, segment, qt, st, yt, nvalid);
    else dispatch_dot<Int8Dot8Tile>(rows, np, xr, K, segment, qt, st, yt, nvalid);
  });
  return y;
}
#endif

}  // namespace tokenmill

#ifdef TOKENMILL_DOT
TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("int4_linear_dot", &tokenmill::int4_linear_dot);
  m.impl("int8_linear_dot", &tokenmill::int8_linear_dot);
  m.impl("q4k_linear_dot", &tokenmill::q4k_linear_dot);
}
#endif

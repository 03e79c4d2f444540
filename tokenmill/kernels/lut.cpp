// GGUF's 4-bit lookup types at their own width: each weight a 4-bit index into a 16-entry table of
// int8 values, times a scale per 32 inputs. IQ4_NL and IQ4_XS share llama.cpp's non-linear table
// (-127..113); MXFP4's is FP4 (E2M1) doubled (-12..12).
//
// Layout, 16-row panels like the other dot weights (quant/kquant.py packs them):
//   q  uint8 (P, K/8, 64)   the indices in the int4 dot layout (linear.cpp)
//   s  the scales, whose dtype names the type:
//      float16 (P, K/32, 16)  IQ4_NL: the block's d
//      int8    (P, K/32, 16)  IQ4_XS: the block's 6-bit scale - 32, times d float16 (P, K/256, 16)
//      uint8   (P, K/32, 16)  MXFP4: the block's E8M0 exponent e, scale 2^(e - 128)
// Bytes per weight: 0.5625 (IQ4_NL's file: the same), 0.539 (IQ4_XS: 0.531), 0.531 (MXFP4: the same).
// Every scale is exact in float32, so the weights multiplied are exactly gguf-py's.
//
// The product: VPSHUFB looks the 16 table entries up, offset by 128 to be unsigned (1..241), and
// VPDPBUSD multiplies them by the activations' integers; dot(T + 128, xq) - 128 sum(xq) per block
// of 32. AVX2 without VNNI has only VPMADDUBSW, whose int16 pairs 241 x 128 x 2 would overflow: there
// each entry is split into its two nibbles (T + 128 = 16 hi + lo, two lookups) and the two products
// add in int16 like the int4 ones, widened once per block.
#include "dot.h"

namespace tokenmill {
namespace {
#ifdef TOKENMILL_DOT


// the table + 128 as 16 unsigned bytes (shift 0), or one nibble of each (shift 4: high, 0 with mask: low)
__m128i table_bytes(const int8_t* t, int shift, bool nibble) {
  alignas(16) uint8_t b[16];
  for (int i = 0; i < 16; ++i) {
    const int u = t[i] + 128;
    b[i] = static_cast<uint8_t>(nibble ? (u >> shift) & 15 : u);
  }
  return _mm_load_si128(reinterpret_cast<const __m128i*>(b));
}

#if defined(TOKENMILL_DOT512)
template <int MT, int NP, bool W>
__attribute__((noinline)) void lut_dot_tile(XRows x, int64_t K, int64_t segment, const uint8_t* q, LutScales sc,
                                            __m512i table, YOut y, int nvalid_last) {
  const int64_t nb = K / 32, bps = segment / 32, qstride = K * 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
  Sum16 sum[MT][NP];
  for (int64_t b0 = 0; b0 < nb; b0 += bps) {
    v16f acc[MT][NP];
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NP; ++j) acc[r][j] = v16f{};
    for (int64_t b = b0; b < b0 + bps; ++b) {
      __m512i hacc[MT][NP], lacc[MT][NP];
      for (int r = 0; r < MT; ++r)
        for (int j = 0; j < NP; ++j) hacc[r][j] = lacc[r][j] = _mm512_setzero_si512();
      for (int o = 0; o < 4; ++o) {
        __m512i lo[NP], hi[NP];
        for (int j = 0; j < NP; ++j) {
          const uint8_t* qj = q + j * qstride + (b * 4 + o) * 64;
          prefetch_ahead(qj);
          const __m512i v = _mm512_loadu_si512(qj);
          lo[j] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
          hi[j] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
        for (int r = 0; r < MT; ++r) {
          const int64_t at = r * K + b * 32 + o * 8;
          const __m512i h0 = bcast4(x.h + at), h1 = bcast4(x.h + at + 4);
          for (int j = 0; j < NP; ++j) hacc[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hacc[r][j], lo[j], h0), hi[j], h1);
          if constexpr (W) {
            const __m512i l0 = bcast4(x.l + at), l1 = bcast4(x.l + at + 4);
            for (int j = 0; j < NP; ++j) lacc[r][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lacc[r][j], lo[j], l0), hi[j], l1);
          }
        }
      }
      v16f sv[NP];
      for (int j = 0; j < NP; ++j) sv[j] = sc.at(j, b);
      for (int r = 0; r < MT; ++r) {
        const __m512i bias = _mm512_set1_epi32(128 * x.qsum[r * nb + b]);
        const float dx = x.d[r * nb + b];
        for (int j = 0; j < NP; ++j) {
          const __m512i dot = W ? _mm512_add_epi32(_mm512_slli_epi32(hacc[r][j], 8), lacc[r][j]) : hacc[r][j];
          acc[r][j] += v16f(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, bias))) * (sv[j] * dx);
        }
      }
    }
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NP; ++j) sum[r][j].add(acc[r][j]);
  }
  for (int r = 0; r < MT; ++r)
    for (int j = 0; j < NP; ++j) sum[r][j].put(y.at(r, 0), j * kLanes, j == NP - 1 ? nvalid_last : kLanes);
}
constexpr int kLutRows8 = kDot8Rows, kLutRows16 = kDot16Rows;

struct Tables {
  __m512i u;
  explicit Tables(const int8_t* t) : u(_mm512_broadcast_i32x4(table_bytes(t, 0, false))) {}
};
#define LUT_TABLE_ARG tables.u
#else
// As the AVX-512 LutScales, 8 outputs (half u of the panel) at a time.
struct LutScales {
  const void* s;
  const at::Half* d;
  int kind;
  int64_t s_stride, d_stride;
  __m256 at(int64_t b, int u) const {
    const int64_t i = b * kLanes + u * 8;
    if (kind == 0) return load_half8(static_cast<const at::Half*>(s) + i);
    const __m128i raw = load8(static_cast<const uint8_t*>(s) + i);
    if (kind == 1) return _mm256_mul_ps(load_half8(d + (b >> 3) * kLanes + u * 8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
    const __m256i e = _mm256_cvtepu8_epi32(raw);
    const __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, sub));
  }
};

// One octet's looked-up weights times x's 4-byte broadcasts into a block's integer accumulator.
// VNNI: one int32 chain of (T + 128) products. Without it: two int16 chains, of the high and the low
// nibbles of T + 128 (each as small as an int4 weight), combined as 16 hi + lo at the block's end.
struct LutAcc {
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
#if defined(__AVXVNNI__)
  void add(const __m256i* w, __m256i x0, __m256i x1) { a = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(a, w[0], x0), w[1], x1); }
  __m256i dot() const { return a; }
#else
  void add(const __m256i* w, __m256i x0, __m256i x1) {
    a = _mm256_add_epi16(a, _mm256_add_epi16(_mm256_maddubs_epi16(w[0], x0), _mm256_maddubs_epi16(w[1], x1)));
    b = _mm256_add_epi16(b, _mm256_add_epi16(_mm256_maddubs_epi16(w[2], x0), _mm256_maddubs_epi16(w[3], x1)));
  }
  __m256i dot() const {
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(a, ones), 4), _mm256_madd_epi16(b, ones));
  }
#endif
};

#if defined(__AVXVNNI__)
constexpr int kLutWeights = 2;  // per octet and half: T + 128 of the low and the high nibbles
struct Tables {
  __m256i u;
  explicit Tables(const int8_t* t) : u(_mm256_broadcastsi128_si256(table_bytes(t, 0, false))) {}
  void look(__m256i lo, __m256i hi, __m256i* w) const { w[0] = _mm256_shuffle_epi8(u, lo), w[1] = _mm256_shuffle_epi8(u, hi); }
};
#else
constexpr int kLutWeights = 4;  // per octet and half: the high nibbles of T + 128 (low, high index), then the low
struct Tables {
  __m256i h, l;
  explicit Tables(const int8_t* t)
      : h(_mm256_broadcastsi128_si256(table_bytes(t, 4, true))), l(_mm256_broadcastsi128_si256(table_bytes(t, 0, true))) {}
  void look(__m256i lo, __m256i hi, __m256i* w) const {
    w[0] = _mm256_shuffle_epi8(h, lo), w[1] = _mm256_shuffle_epi8(h, hi);
    w[2] = _mm256_shuffle_epi8(l, lo), w[3] = _mm256_shuffle_epi8(l, hi);
  }
};
#endif

template <int MT, int NU, bool W>
__attribute__((noinline)) void lut_dot_tile(XRows x, int64_t K, int64_t segment, const uint8_t* q, LutScales sc,
                                            const Tables* tables, YOut y, int nvalid) {
  const int64_t nb = K / 32, bps = segment / 32;
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int u0 = 0; u0 < 2; u0 += NU) {
    Sum8 sum[MT][NU];
    for (int64_t b0 = 0; b0 < nb; b0 += bps) {
      __m256 acc[MT][NU];
      for (int r = 0; r < MT; ++r)
        for (int u = 0; u < NU; ++u) acc[r][u] = _mm256_setzero_ps();
      for (int64_t b = b0; b < b0 + bps; ++b) {
        LutAcc hacc[MT][NU], lacc[MT][NU];
        for (int o = 0; o < 4; ++o) {
          const uint8_t* qo = q + (b * 4 + o) * 64;
          if (u0 == 0) prefetch_ahead(qo);
          __m256i w[NU][kLutWeights];
          for (int u = 0; u < NU; ++u) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qo + (u0 + u) * 32));
            tables->look(_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low), w[u]);
          }
          for (int r = 0; r < MT; ++r) {
            const int64_t at = r * K + b * 32 + o * 8;
            const __m256i h0 = bcast4(x.h + at), h1 = bcast4(x.h + at + 4);
            for (int u = 0; u < NU; ++u) hacc[r][u].add(w[u], h0, h1);
            if constexpr (W) {
              const __m256i l0 = bcast4(x.l + at), l1 = bcast4(x.l + at + 4);
              for (int u = 0; u < NU; ++u) lacc[r][u].add(w[u], l0, l1);
            }
          }
        }
        for (int r = 0; r < MT; ++r) {
          const __m256i bias = _mm256_set1_epi32(128 * x.qsum[r * nb + b]);
          const __m256 dx = _mm256_set1_ps(x.d[r * nb + b]);
          for (int u = 0; u < NU; ++u) {
            const __m256i dot = W ? _mm256_add_epi32(_mm256_slli_epi32(hacc[r][u].dot(), 8), lacc[r][u].dot()) : hacc[r][u].dot();
            acc[r][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot, bias)), _mm256_mul_ps(sc.at(b, u0 + u), dx),
                                        acc[r][u]);
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
constexpr int kLutRows8 = 3, kLutRows16 = 2;
#define LUT_TABLE_ARG &tables
#endif

DOT_TILE_ADAPTER(LutDot16Tile, lut_dot_tile<MT, NP, true>)
DOT_TILE_ADAPTER(LutDot8Tile, lut_dot_tile<MT, NP, false>)

}  // namespace

at::Tensor lut_linear_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const c10::optional<at::Tensor>& d,
                          int64_t N, int64_t bits, int64_t segment, bool partial) {
  check_bits(bits);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.size(2) == 64 && q.is_contiguous(),
              "lookup-type indices must be uint8 (P, K/8, 64)");
  const int64_t P = q.size(0), K = q.size(1) * 8;
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  const int kind = s.scalar_type() == at::kHalf ? 0 : s.scalar_type() == at::kChar ? 1 : 2;
  check_panel(s, {P, K / 32, kLanes}, kind == 0 ? at::kHalf : kind == 1 ? at::kChar : at::kByte, "lookup-type scales");
  const at::Half* dp = nullptr;
  if (kind == 1) {
    TORCH_CHECK(d && d->defined() && K % 256 == 0, "IQ4_XS scales need d (P, K/256, 16) and K a multiple of 256");
    check_panel(*d, {P, K / 256, kLanes}, at::kHalf, "IQ4_XS d");
    dp = d->data_ptr<at::Half>();
  }
  check_n(N, P);
  check_x(x, K);
  const int64_t M = x.size(0);
  segment = check_segment(segment, K, 32);
  const QuantizedX xq = quantize_x(x.data_ptr<float>(), M, K, 0, bits == 16, kHalves);
  at::Tensor y = output(x, N, partial);
  const Tables tables(kind == 2 ? kFP4 : kIQ4);
  const uint8_t *qp = q.data_ptr<uint8_t>(), *sp = static_cast<const uint8_t*>(s.data_ptr());
  const int64_t sbytes = kind == 0 ? 2 : 1;
  const int tile = bits == 16 ? kLutRows16 : kLutRows8;
  for_each_tile(P, M, N, tile, kDotPanels, [&](int64_t p, int np, int64_t r, int rows, int nvalid) {
    const XRows xr = rows_at(xq, r, K, 0);
    const LutScales sc{sp + p * (K / 2) * sbytes, dp ? dp + p * (K / 16) : nullptr, kind, K / 2, K / 16};
    const YOut yt = out_at(y, r, p * kLanes);
    if (bits == 16) dispatch_dot<LutDot16Tile>(rows, np, xr, K, segment, qp + p * K * 8, sc, LUT_TABLE_ARG, yt, nvalid);
    else dispatch_dot<LutDot8Tile>(rows, np, xr, K, segment, qp + p * K * 8, sc, LUT_TABLE_ARG, yt, nvalid);
  });
  return y;
}
#else
}  // namespace
#endif

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
#ifdef TOKENMILL_DOT
  m.def("lut_linear_dot(Tensor x, Tensor q, Tensor s, Tensor? d, int N, int bits, int segment=0, bool partial=False) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
#ifdef TOKENMILL_DOT
  m.impl("lut_linear_dot", &tokenmill::lut_linear_dot);
#endif
}

// AVX2 / AVX-VNNI int4, 5-bit and Q6_K products of many rows (prompt chunks, large batches), included by
// dot_linear.cpp and kquant.cpp inside their anonymous namespaces (they hold dot.h's helpers).
//
// The few-row tiles (dot_linear.cpp) hold MT rows' integer and float accumulators in registers and
// unpack each octet of weights for them; on 16 ymm registers that spills at 6 rows and unpacks the
// weights again every 4-6 rows. Here the order is turned round: one block of 32 inputs of a panel
// half (8 outputs) is unpacked into 8 registers once, and every row of the call is multiplied by it
// in turn, its float sums kept in a small array in L1 (a load and a store per row and block, not
// per instruction). Only the row's short integer chain and two broadcasts are live beside the
// weights, so nothing spills and the unpacking is shared by all rows. The integer arithmetic is the
// tiles' (VPMADDUBSW pairs summed in int16 over a block, widened once; VPDPBUSD on AVX-VNNI), so
// results equal them exactly.
#pragma once

#if !defined(TOKENMILL_DOT512)
constexpr int kManyRows = 16;   // rows per call: the float sums' array (16 x 8 floats, 16 x 8 doubles)
constexpr int kManyRowsMin = 8;  // from this many rows of x the products take this path

// Products of the lows (o = 0..3: inputs 8o..8o+3) and highs (8o+4..8o+7) of one block's octets with
// one row's int8 quads at p: the block's 32 products per output, as quad_sums leaves them.
inline __m256i block_dot(const __m256i* w, const int8_t* p) {
  __m256i a = dot_quads(_mm256_setzero_si256(), w[0], bcast4(p));
  a = dot_quads(a, w[1], bcast4(p + 4));
  a = dot_quads(a, w[2], bcast4(p + 8));
  a = dot_quads(a, w[3], bcast4(p + 12));
  a = dot_quads(a, w[4], bcast4(p + 16));
  a = dot_quads(a, w[5], bcast4(p + 20));
  a = dot_quads(a, w[6], bcast4(p + 24));
  a = dot_quads(a, w[7], bcast4(p + 28));
  return quad_sums(a);
}

// The same for 5-bit weights (0..31): VPMADDUBSW's pairs of two octets would pass int16 over a
// block, so they widen per octet (dot_wide), as the 5-bit tiles do.
inline __m256i block_dot5(const __m256i* w, const int8_t* p) {
  __m256i a = dot_wide(_mm256_setzero_si256(), w[0], bcast4(p), w[1], bcast4(p + 4));
  a = dot_wide(a, w[2], bcast4(p + 8), w[3], bcast4(p + 12));
  a = dot_wide(a, w[4], bcast4(p + 16), w[5], bcast4(p + 20));
  return dot_wide(a, w[6], bcast4(p + 24), w[7], bcast4(p + 28));
}

// int4 weights (HalfScales or KScales; H: 5-bit, their fifth bits in qh as the tiles read them),
// `rows` <= kManyRows rows of x from x's first row, one panel (16 outputs, nvalid of them real).
// W: 16-bit x (h and l halves).
template <bool W, class S, bool H = false>
__attribute__((noinline)) void int4_many_rows(XRows x, int rows, int64_t K, int64_t group, int64_t segment,
                                              const uint8_t* q, S sc, YOut y, int nvalid, const uint8_t* qh = nullptr) {
  const int64_t nb = K / 32, ng = K / group, bpg = group / 32, gps = segment / group;
  const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  auto prod = [](const __m256i* w, const int8_t* p) { return H ? block_dot5(w, p) : block_dot(w, p); };
  alignas(32) float acc[kManyRows][8];
  for (int u = 0; u < 2; ++u) {
    Sum8 sum[kManyRows];
    for (int64_t g0 = 0; g0 < ng; g0 += gps) {
      for (int r = 0; r < rows; ++r) _mm256_store_ps(acc[r], _mm256_setzero_ps());
      for (int64_t g = g0; g < g0 + gps; ++g) {
        const __m256 s = sc.scale(g, u);
        for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
          __m256i w[8];  // octet o's lows in w[2o], highs in w[2o + 1]
          __m256i hb = _mm256_setzero_si256();
          if constexpr (H) hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + b * 64 + u * 32));
          for (int o = 0; o < 4; ++o) {
            const uint8_t* qo = q + (b * 4 + o) * 64;
            if (u == 0) prefetch_ahead(qo);
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qo + u * 32));
            w[2 * o] = _mm256_and_si256(v, low), w[2 * o + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if constexpr (H) {
              w[2 * o] = _mm256_or_si256(w[2 * o], _mm256_and_si256(fifth_bit(hb, o), bit4));
              w[2 * o + 1] = _mm256_or_si256(w[2 * o + 1], _mm256_and_si256(fifth_bit(hb, o + 4), bit4));
            }
          }
          for (int r = 0; r < rows; ++r) {
            const int64_t at = r * K + b * 32;
            __m256i dot = prod(w, x.h + at);
            if constexpr (W) dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), prod(w, x.l + at));
            const __m256 ds = _mm256_mul_ps(s, _mm256_set1_ps(x.d[r * nb + b]));
            _mm256_store_ps(acc[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ds, _mm256_load_ps(acc[r])));
          }
        }
        const __m256 m = sc.min(g, u);
        for (int r = 0; r < rows; ++r)
          _mm256_store_ps(acc[r], _mm256_fmadd_ps(m, _mm256_set1_ps(x.xsum[r * ng + g]), _mm256_load_ps(acc[r])));
      }
      for (int r = 0; r < rows; ++r) sum[r].add(_mm256_load_ps(acc[r]));
    }
    for (int r = 0; r < rows; ++r) sum[r].put(y.at(r, 0), u * 8, nvalid - u * 8);
  }
}

// Q6_K (kquant.cpp's layout): each octet's 6-bit weights assembled once from its nibbles and its two
// high bits, then every row as above. Per 16 inputs (a sub-block with its own int8 scale) the
// VPMADDUBSW pairs of two octets reach 2 x 2 x 63 x 128, so they widen per octet (dot_wide), and
// the sub-block's sum less 32 times x's sum there is scaled: the few-row tiles' arithmetic exactly.
template <bool W>
__attribute__((noinline)) void q6k_many_rows(XRows x, int rows, int64_t K, int64_t segment, const uint8_t* ql,
                                             const uint8_t* qh, const int8_t* sc, const at::Half* d, YOut y, int nvalid) {
  const int64_t nb = K / 32, bps = segment / 32;
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  auto highs = [&](__m256i h, int o) {  // bits 2o, 2o + 1 of every byte -> bits 4, 5
    const int shift = 2 * o - 4;
    return _mm256_and_si256(shift > 0 ? _mm256_srli_epi16(h, shift) : _mm256_slli_epi16(h, -shift), top);
  };
  alignas(32) float acc[kManyRows][8];
  for (int u = 0; u < 2; ++u) {
    Sum8 sum[kManyRows];
    for (int64_t b0 = 0; b0 < nb; b0 += bps) {
      for (int r = 0; r < rows; ++r) _mm256_store_ps(acc[r], _mm256_setzero_ps());
      for (int64_t b = b0; b < b0 + bps; ++b) {
        const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + b * 128 + u * 32));
        const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + b * 128 + 64 + u * 32));
        __m256i w[8];
        for (int o = 0; o < 4; ++o) {
          const uint8_t* qo = ql + (b * 4 + o) * 64;
          if (u == 0) prefetch_ahead(qo);
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qo + u * 32));
          w[2 * o] = _mm256_or_si256(_mm256_and_si256(v, low), highs(h0, o));
          w[2 * o + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), highs(h1, o));
        }
        const __m256 dv = load_half8(d + (b >> 3) * 16 + u * 8);
        __m256 s[2];
        for (int half = 0; half < 2; ++half)
          s[half] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(sc + (2 * b + half) * kLanes + u * 8))));
        for (int r = 0; r < rows; ++r) {
          const int64_t at = r * K + b * 32;
          const __m256 dx = _mm256_set1_ps(x.d[r * nb + b]);
          __m256 a = _mm256_load_ps(acc[r]);
          for (int half = 0; half < 2; ++half) {
            auto sub = [&](const int8_t* p) {
              const __m256i first = dot_wide(_mm256_setzero_si256(), w[4 * half], bcast4(p), w[4 * half + 1], bcast4(p + 4));
              return dot_wide(first, w[4 * half + 2], bcast4(p + 8), w[4 * half + 3], bcast4(p + 12));
            };
            __m256i dot = sub(x.h + at + 16 * half);
            if constexpr (W) dot = _mm256_add_epi32(_mm256_slli_epi32(dot, 8), sub(x.l + at + 16 * half));
            const __m256i bias = _mm256_set1_epi32(32 * x.qsum16[(r * nb + b) * 2 + half]);
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot, bias)), _mm256_mul_ps(s[half], dx), a);
          }
          _mm256_store_ps(acc[r], a);
        }
      }
      for (int r = 0; r < rows; ++r) sum[r].add(_mm256_load_ps(acc[r]));
    }
    for (int r = 0; r < rows; ++r) sum[r].put(y.at(r, 0), u * 8, nvalid - u * 8);
  }
}
#endif

// Paged attention of a prompt chunk over its cached context (a prefix-cache hit, or a later chunk
// of a chunked prefill), K/V read from their blocks in place, float32, float16, int8 or fp8 cache
// (each chunk's rows are widened, and an int8 cache's scaled, once into the item's float tiles).
#include <limits>
#include <vector>

#include "attention.h"

namespace tokenmill {
namespace {

// A prompt chunk over its cached context: query i (position start + i) attends to cache positions
// [0, start + i]; its own K/V are already stored. Work item = (KV head, tile of up to kQueryTile
// query tokens); each kChunk-token chunk of context is widened (K transposed in registers) once per item,
// then the item's query rows (tokens x the heads sharing the KV head) take it kRowBlock rows at a
// time, GEMM-style: one K vector load feeds kRowBlock FMAs for the scores, the online softmax runs
// once per 32 tokens, and P.V runs on register tiles (pv_rows). 32-token query tiles widen each
// chunk half as often as 16-token ones; against gather + SDPA with a mask, and the share of the FMA
// peak it reaches: benchmarks/attention_bench.py.
//   q (T, Hq, D) float32; block_table (W,) int64 covering start + T positions -> out (T, Hq, D)
constexpr int64_t kQueryTile = 32, kChunk = 2 * kLanes;
#if defined(__AVX512F__)
constexpr int kRowBlock = 12, kPvVectors = 24;  // 32 zmm: 12 rows x 2 score vectors; 24 P.V accumulators
#elif defined(__AVX2__)
constexpr int kRowBlock = 3;                    // 16 ymm: 3 rows x 4 score vectors + 4 keys (pv_avx2)
#else
constexpr int kRowBlock = 12, kPvVectors = 24;  // no variant builds without AVX2; kept portable
#endif

inline float hmax(v16f v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(v);
#elif defined(__AVX2__)
  return hmax8(_mm256_max_ps(low8(v), high8(v)));
#else
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: the same two steps on arrays of ymm registers (GCC keeps arrays of v16f pairs on the
// stack): scores R rows x 4 vectors, P.V on tiles of 3 rows x 4 vectors (32 outputs).
template <int RP, int NC>
void pv_block(const float (*p)[kChunk], const float* alpha, const float* vb, int64_t D, float* const* acc, int64_t c0) {
  __m256 a[RP][NC];
  for (int r = 0; r < RP; ++r)
    for (int j = 0; j < NC; ++j) a[r][j] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + c0 + 8 * j), _mm256_set1_ps(alpha[r]));
  for (int64_t t = 0; t < kChunk; ++t) {
    __m256 pr[RP];
    for (int r = 0; r < RP; ++r) pr[r] = _mm256_set1_ps(p[r][t]);
    for (int j = 0; j < NC; ++j) {
      const __m256 v = _mm256_loadu_ps(vb + t * D + c0 + 8 * j);
      for (int r = 0; r < RP; ++r) a[r][j] = _mm256_fmadd_ps(pr[r], v, a[r][j]);
    }
  }
  for (int r = 0; r < RP; ++r)
    for (int j = 0; j < NC; ++j) _mm256_storeu_ps(acc[r] + c0 + 8 * j, a[r][j]);
}

void pv_avx2(int R, const float (*p)[kChunk], const float* alpha, const float* vb, int64_t D, float* const* acc) {
  for (int64_t c0 = 0; c0 < D; c0 += 32) {
    const bool full = D - c0 >= 32;  // else the last 16 of a head size that is an odd multiple of 16
    int r = 0;
    for (; r + 3 <= R; r += 3)
      full ? pv_block<3, 4>(p + r, alpha + r, vb, D, acc + r, c0) : pv_block<3, 2>(p + r, alpha + r, vb, D, acc + r, c0);
    for (; r < R; ++r)
      full ? pv_block<1, 4>(p + r, alpha + r, vb, D, acc + r, c0) : pv_block<1, 2>(p + r, alpha + r, vb, D, acc + r, c0);
  }
}

template <int R>
void chunk_rows(const float* qt, int64_t ldq, const int64_t* skip, const int64_t* valid, const float* kt,
                const float* vb, int64_t D, float* const* acc, float* mx, v16f* l) {
  __m256 s[R][4];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4; ++i) s[r][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 k[4];
    for (int i = 0; i < 4; ++i) k[i] = _mm256_load_ps(kt + d * kChunk + 8 * i);
    for (int r = 0; r < R; ++r) {
      const __m256 qd = _mm256_set1_ps(qt[d * ldq + r]);
      for (int i = 0; i < 4; ++i) s[r][i] = _mm256_fmadd_ps(qd, k[i], s[r][i]);
    }
  }
  const __m256 lane = _mm256_set_ps(7, 6, 5, 4, 3, 2, 1, 0), neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float p[R][kChunk];
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    __m256 vis[4], m = neg_inf;
    for (int i = 0; i < 4; ++i) {
      const __m256 li = _mm256_add_ps(lane, _mm256_set1_ps(8.f * i));
      vis[i] = _mm256_and_ps(_mm256_cmp_ps(li, _mm256_set1_ps(static_cast<float>(valid[r])), _CMP_LT_OQ),
                             _mm256_cmp_ps(li, _mm256_set1_ps(static_cast<float>(skip[r])), _CMP_GE_OQ));
      s[r][i] = _mm256_blendv_ps(neg_inf, s[r][i], vis[i]);
      m = _mm256_max_ps(m, s[r][i]);
    }
    const float bmax = hmax8(m);
    alpha[r] = 1.f;
    if (bmax > mx[r]) {
      alpha[r] = std::exp(mx[r] - bmax);  // 0 on the first chunk
      l[r] *= splat(alpha[r]);
      mx[r] = bmax;
    }
    const __m256 mr = _mm256_set1_ps(mx[r]);
    for (int i = 0; i < 4; i += 2) {
      const v16f e = exp16(join(_mm256_sub_ps(s[r][i], mr), _mm256_sub_ps(s[r][i + 1], mr)));
      const __m256 e0 = _mm256_and_ps(low8(e), vis[i]), e1 = _mm256_and_ps(high8(e), vis[i + 1]);
      l[r] += join(e0, e1);
      _mm256_store_ps(p[r] + 8 * i, e0);
      _mm256_store_ps(p[r] + 8 * i + 8, e1);
    }
  }
  pv_avx2(R, p, alpha, vb, D, acc);
}
#else
// acc[r] = acc[r] * alpha[r] + p[r] . V for RP rows, V = the chunk's values (kChunk x 16 ND):
// the rows' outputs stay in registers (RP x ND vectors) for the whole chunk, so each probability is
// broadcast once and each V vector loaded once per RP rows; the softmax rescale rides on the load.
template <int RP, int ND>
void pv_rows(const float (*p)[kChunk], const float* alpha, const float* vb, float* const* acc) {
  v16f a[RP][ND];
  for (int r = 0; r < RP; ++r)
    for (int j = 0; j < ND; ++j) a[r][j] = load(acc[r] + j * kLanes) * splat(alpha[r]);
  for (int64_t t = 0; t < kChunk; ++t) {
    v16f v[ND];
    for (int j = 0; j < ND; ++j) v[j] = load(vb + t * ND * kLanes + j * kLanes);
    for (int r = 0; r < RP; ++r) {
      const v16f pr = splat(p[r][t]);
      for (int j = 0; j < ND; ++j) a[r][j] += pr * v[j];
    }
  }
  for (int r = 0; r < RP; ++r)
    for (int j = 0; j < ND; ++j) store(acc[r] + j * kLanes, a[r][j], kLanes);
}

// Any head size (a multiple of 16): the rows' outputs go through memory once per 16 lanes.
void pv_rows_any(int R, const float (*p)[kChunk], const float* alpha, const float* vb, int64_t D,
                 float* const* acc) {
  for (int64_t d = 0; d < D; d += kLanes)
    for (int r = 0; r < R; ++r) {
      v16f a = load(acc[r] + d) * splat(alpha[r]);
      for (int64_t t = 0; t < kChunk; ++t) a += splat(p[r][t]) * load(vb + t * D + d);
      store(acc[r] + d, a, kLanes);
    }
}

// Register tiles for head sizes 64 and 128: rows x vectors of 6 x 4 and 3 x 8 (24 accumulators).
template <int ND>
void pv_tiles(int R, const float (*p)[kChunk], const float* alpha, const float* vb, float* const* acc) {
  constexpr int RP = kPvVectors / ND;
  int r = 0;
  for (; r + RP <= R; r += RP) pv_rows<RP, ND>(p + r, alpha + r, vb, acc + r);
  for (; r < R; ++r) pv_rows<1, ND>(p + r, alpha + r, vb, acc + r);
}

// R query rows x one chunk, online softmax. qt: the rows' queries, scaled and transposed (element d
// of row r at qt[d * ldq + r]: one pointer serves every row's broadcast); kt: keys transposed
// (D x kChunk), vb: values (kChunk x D); the row sees the chunk's tokens [skip[r], valid[r]) (skip:
// before a sliding window); acc/mx/l: the rows' running output, max and (per lane) sum.
template <int R>
void chunk_rows(const float* qt, int64_t ldq, const int64_t* skip, const int64_t* valid, const float* kt,
                const float* vb, int64_t D, float* const* acc, float* mx, v16f* l) {
  v16f s[R][2];
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = v16f{};
  for (int64_t d = 0; d < D; ++d) {
    const v16f k0 = load(kt + d * kChunk), k1 = load(kt + d * kChunk + kLanes);
    for (int r = 0; r < R; ++r) {
      const v16f qd = splat(qt[d * ldq + r]);
      s[r][0] += qd * k0;
      s[r][1] += qd * k1;
    }
  }
  v16f lane;
  for (int t = 0; t < kLanes; ++t) lane[t] = static_cast<float>(t);
  const v16f neg_inf = v16f{} - std::numeric_limits<float>::infinity();
  alignas(64) float p[R][kChunk];
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    const v16f vis0 = splat(static_cast<float>(valid[r])), vis1 = vis0 - splat(static_cast<float>(kLanes));
    const v16f sk0 = splat(static_cast<float>(skip[r])), sk1 = sk0 - splat(static_cast<float>(kLanes));
    const auto in0 = (lane < vis0) & (lane >= sk0), in1 = (lane < vis1) & (lane >= sk1);
    const v16f sc0 = in0 ? s[r][0] : neg_inf, sc1 = in1 ? s[r][1] : neg_inf;
    const float bmax = hmax(sc0 > sc1 ? sc0 : sc1);
    alpha[r] = 1.f;
    if (bmax > mx[r]) {
      alpha[r] = std::exp(mx[r] - bmax);  // 0 on the first chunk
      l[r] *= alpha[r];
      mx[r] = bmax;
    }
    const v16f e0 = in0 ? exp16(sc0 - mx[r]) : v16f{}, e1 = in1 ? exp16(sc1 - mx[r]) : v16f{};
    l[r] += e0 + e1;
    store(p[r], e0, kLanes);
    store(p[r] + kLanes, e1, kLanes);
  }
  if (D == 4 * kLanes) pv_tiles<4>(R, p, alpha, vb, acc);
  else if (D == 8 * kLanes) pv_tiles<8>(R, p, alpha, vb, acc);
  else pv_rows_any(R, p, alpha, vb, D, acc);
}

#endif

// A cached row widened: 16 elements at p, times the row's scale for an int8 cache (s: 1 otherwise).
template <typename T>
inline v16f load_row(const T* p, float s) {
  if constexpr (kv_scaled<T>) return load_kv(p) * splat(s);
  else return load_kv(p);
}

// kt[d * kChunk + t] = key t's element d, widened (int8: times ks[t]); zero past the chunk's end (null rows).
// AVX-512: 16 x 16 tiles transposed in registers (transpose16) instead of 16 x D scalar moves per tile.
template <typename T>
void transpose_keys(const T* const* krow, const float* ks, int64_t D, float* kt) {
#if defined(__AVX512F__)
  for (int64_t tb = 0; tb < kChunk; tb += kLanes)
    for (int64_t db = 0; db < D; db += kLanes) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = krow[tb + i] ? __m512(load_row(krow[tb + i] + db, ks[tb + i])) : _mm512_setzero_ps();
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_ps(kt + (db + j) * kChunk + tb, r[j]);
    }
#elif defined(__AVX2__)
  for (int64_t tb = 0; tb < kChunk; tb += 8)  // 8 x 8 tiles: unpack, shuffle, swap 128-bit halves
    for (int64_t db = 0; db < D; db += 8) {
      __m256 r[8], t[8], u[8];
      for (int i = 0; i < 8; ++i) {
        r[i] = krow[tb + i] ? load_kv8(krow[tb + i] + db) : _mm256_setzero_ps();
        if constexpr (kv_scaled<T>) r[i] = _mm256_mul_ps(r[i], _mm256_set1_ps(ks[tb + i]));
      }
      for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int j = 0; j < 4; ++j) {
        _mm256_store_ps(kt + (db + j) * kChunk + tb, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
        _mm256_store_ps(kt + (db + j + 4) * kChunk + tb, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
      }
    }
#else
  for (int64_t t = 0; t < kChunk; ++t)
    for (int64_t d = 0; d < D; d += kLanes) {
      const v16f k = krow[t] ? load_row(krow[t] + d, ks[t]) : v16f{};
      for (int64_t j = 0; j < kLanes; ++j) kt[(d + j) * kChunk + t] = k[j];
    }
#endif
}

using ChunkRows = void (*)(const float*, int64_t, const int64_t*, const int64_t*, const float*, const float*, int64_t,
                           float* const*, float*, v16f*);
constexpr ChunkRows kChunkRows[13] = {nullptr, chunk_rows<1>, chunk_rows<2>, chunk_rows<3>, chunk_rows<4>,
                                                 chunk_rows<5>, chunk_rows<6>, chunk_rows<7>, chunk_rows<8>,
                                                 chunk_rows<9>, chunk_rows<10>, chunk_rows<11>, chunk_rows<12>};

template <typename T>
void context_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, int64_t start, float scale, int64_t window, at::Tensor& out) {
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const KvBlocks<T> L(k_cache);
  const int64_t G = Hq / Hkv, ntiles = (Tq + kQueryTile - 1) / kQueryTile;
  const float* qp = q.data_ptr<float>();
  const T *kp = kv_data<T>(k_cache), *vp = kv_data<T>(v_cache);
  const int64_t* tp = block_table.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, Hkv * ntiles, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float kt[kMaxHeadDim * kChunk];  // kt[d * kChunk + t]: the chunk's keys, transposed
    alignas(64) float vb[kChunk * kMaxHeadDim];  // vb[t * D + d]
    const T* krow[kChunk];                        // the chunk's key rows in the cache (null: past its end)
    float ks[kChunk];                             // their scales (int8 caches)
    const int64_t max_rows = kQueryTile * G;
    std::vector<float> acc(max_rows * D), mx(max_rows);
    std::vector<v16f> l(max_rows);
    std::vector<float> qt(D * max_rows);  // qt[d * rows + r]: the item's queries, scaled, transposed
    std::vector<float*> arow(max_rows);
    std::vector<int64_t> valid(max_rows), skip(max_rows);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t h = item / ntiles, first = (item % ntiles) * kQueryTile;
      const int64_t last = std::min(Tq, first + kQueryTile), rows = (last - first) * G, end = start + last;
      std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
      std::fill(mx.begin(), mx.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, v16f{});
      for (int64_t r = 0; r < rows; ++r) {  // row r = (token first + r / G, head h * G + r % G)
        const float* qrow = qp + ((first + r / G) * Hq + h * G + r % G) * D;
        for (int64_t d = 0; d < D; ++d) qt[d * rows + r] = qrow[d] * scale;
        arow[r] = acc.data() + r * D;
      }
      // a sliding window: the tile's first query sees the earliest position any of its queries sees
      for (int64_t pos = window > 0 ? std::max<int64_t>(0, start + first - window + 1) : 0; pos < end; pos += kChunk) {
        const int64_t n = std::min(kChunk, end - pos);
        for (int64_t t = 0; t < kChunk; ++t) {
          const int64_t blk = t < n ? tp[(pos + t) / bs] : 0;
          TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id out of range");
          const int64_t at = L.at(blk, (pos + t) % bs, h), sat = L.scale_at(blk, (pos + t) % bs, h);
          krow[t] = t < n ? kp + at : nullptr;
          ks[t] = kv_scaled<T> && t < n ? kv_scale(kp + sat) : 1.f;
          const float vs = kv_scaled<T> && t < n ? kv_scale(vp + sat) : 1.f;
          for (int64_t d = 0; d < D; d += kLanes) store(vb + t * D + d, t < n ? load_row(vp + at + d, vs) : v16f{}, kLanes);
        }
        transpose_keys(krow, ks, D, kt);
        // tokens before pos - start see none of this chunk (causal); the rest up to their position
        const int64_t r0 = std::max<int64_t>(0, pos - start - first) * G;
        for (int64_t r = r0; r < rows; ++r) {
          const int64_t qpos = start + first + r / G;
          valid[r] = std::min(n, qpos + 1 - pos);
          skip[r] = window > 0 ? std::max<int64_t>(0, qpos - window + 1 - pos) : 0;
        }
        for (int64_t r = r0; r < rows; r += kRowBlock) {
          const int64_t nr = std::min<int64_t>(kRowBlock, rows - r);
          kChunkRows[nr](qt.data() + r, rows, skip.data() + r, valid.data() + r, kt, vb, D, arow.data() + r,
                         mx.data() + r, l.data() + r);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / hsum(l[r]);
        float* o = op + ((first + r / G) * Hq + h * G + r % G) * D;
        for (int64_t d = 0; d < D; d += kLanes) store(o + d, load(arow[r] + d) * inv, kLanes);
      }
    }
  });
}

}  // namespace

at::Tensor paged_context_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t start, double scale, int64_t window) {
  check_caches(k_cache, v_cache);
  check_heads(q, k_cache);
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong && block_table.is_contiguous(),
              "block_table must be int64 (W,)");
  TORCH_CHECK(start >= 0 && start + q.size(0) <= block_table.size(0) * k_cache.size(1),
              "the block table does not cover the context");
  at::Tensor out = at::empty_like(q);
  with_kv_type(k_cache, [&](auto tag) {
    context_attention<decltype(tag)>(q, k_cache, v_cache, block_table, start, static_cast<float>(scale), window, out);
  });
  return out;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("paged_context_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int start, "
        "float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_context_attention", &tokenmill::paged_context_attention);
}

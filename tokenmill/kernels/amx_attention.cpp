// A prompt chunk's attention over its cached context on AMX tiles (the `amx` variant): the
// FlashAttention schedule with both products on TDPBF16PS. At a 4k-token prompt the FMA kernel
// (context_attention.cpp) spends about as long in attention as the AMX projections do in the whole
// layer; here S = Q K^T and O += P V run at the tiles' rate and only the online softmax is vector work.
//
// Work item = (KV head, tile of query tokens x the heads sharing that KV head, ~128 rows). Per step of
// kKeys context tokens the item packs K and V once into bfloat16 tile layouts (K as 32-bit pairs
// transposed, V as interleaved key pairs), then each 16-row block of queries: 4 score tiles over the
// head size, the softmax in float32 (AVX-512), P rounded to bfloat16, P V added into the rows' float32
// output through tile loads and stores. Q, K, V and P are rounded to bfloat16 (8-bit mantissa); sums
// and the softmax stay float32. The running max moves lazily (only when a score passes it by
// kLazy), so the output's rescale, a pass over D floats per row, is rare after the first steps.
//   q (T, Hq, D) float32, D a multiple of 32; block_table (W,) int64 covering start + T -> out (T, Hq, D)
#include <atomic>
#include <cstdlib>
#include <limits>
#include <memory>
#include <vector>

#include "amx.h"
#include "attention.h"

namespace tokenmill {
#ifdef TOKENMILL_AMX
namespace {

constexpr int64_t kKeys = 64;   // context tokens per step: 4 score tiles, 2 P.V steps of 32
constexpr int64_t kRows = 512;  // query rows (tokens x grouped heads) per work item, about: K/V
                                // are packed once per item and step
constexpr float kLazy = 12.f;   // 2^12: the headroom P and the sums get above the stale max

// 2^x at the precision P is rounded to (bfloat16): x = n + r, |r| <= 1/2, 2^r by a degree-4
// polynomial (relative error ~4e-5), 2^n by VSCALEFPS. Scores are in log2 units (Q carries log2 e),
// so no multiply; lanes that are -inf or NaN come out NaN: callers mask them to 0.
inline __m512 exp2_bf16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);                  // ln2^4/24
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));  // ln2^3/6
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));  // ln2^2/2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));  // ln2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The step's keys as B tiles of S = Q K^T: kp[j * kKeys + t] = the bfloat16 pair (2j, 2j + 1) of key
// t, a 32-bit word (rows of a tile: 16 pairs of head elements; columns: 16 keys). Null rows: zeros.
template <typename T>
void pack_keys(const T* const* krow, int64_t D, uint32_t* kp) {
  for (int64_t tb = 0; tb < kKeys; tb += 16)
    for (int64_t db = 0; db < D; db += 32) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const T* k = krow[tb + i];
        r[i] = k ? _mm512_castsi512_ps(row_bf16(load_kv(k + db), load_kv(k + db + 16))) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_ps(reinterpret_cast<float*>(kp + (db / 2 + j) * kKeys + tb), r[j]);
    }
}

// The step's values as B tiles of O += P V: vp[(t / 2) * 2D + 2d + t % 2] = value t's element d
// (rows: pairs of keys; columns: head elements). Null rows: zeros (P is 0 there, and 0 x NaN is not).
template <typename T>
void pack_values(const T* const* vrow, int64_t D, uint16_t* vp) {
  for (int64_t t = 0; t < kKeys; t += 2)
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 a = vrow[t] ? __m512(load_kv(vrow[t] + d)) : _mm512_setzero_ps();
      const __m512 b = vrow[t + 1] ? __m512(load_kv(vrow[t + 1] + d)) : _mm512_setzero_ps();
      _mm512_store_si512(vp + t * D + 2 * d, pairs_bf16(a, b));
    }
}

// A 64-byte aligned buffer (tile rows and vector stores on whole cache lines).
template <typename T>
struct Aligned {
  std::unique_ptr<T, decltype(&std::free)> ptr;
  explicit Aligned(int64_t n) : ptr(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64)), &std::free) {}
  T* data() const { return ptr.get(); }
};

// One 16-row block x one step: scores into s (16 x kKeys float32), the online softmax into p
// (16 x kKeys bfloat16) with each row's rescale applied to its output, then o += p V.
// lo[i], hi[i]: the step-relative key range [lo, hi) row i sees (none: lo >= hi).
void block_step(const uint16_t* qb, const uint32_t* kp, const uint16_t* vp, int64_t D, const int64_t* lo,
                const int64_t* hi, float* o, float* m, v16f* l, float* s, uint16_t* p) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t db = 0; db < D; db += 32) {
    _tile_loadd(4, qb + db, D * 2);
    const uint32_t* kb = kp + db / 2 * kKeys;
    _tile_loadd(5, kb, kKeys * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, kb + 16, kKeys * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, kb + 32, kKeys * 4);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, kb + 48, kKeys * 4);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, s, kKeys * 4);
  _tile_stored(1, s + 16, kKeys * 4);
  _tile_stored(2, s + 32, kKeys * 4);
  _tile_stored(3, s + 48, kKeys * 4);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int i = 0; i < 16; ++i) {
    uint16_t* pr = p + i * kKeys;
    if (lo[i] >= hi[i]) {  // sees nothing of this step (causal, window, padding row)
      std::memset(pr, 0, kKeys * 2);
      continue;
    }
    __m512 sv[4], mx = neg_inf;
    __mmask16 in[4] = {0xffff, 0xffff, 0xffff, 0xffff};
    for (int v = 0; v < 4; ++v) sv[v] = _mm512_load_ps(s + i * kKeys + 16 * v);
    if (lo[i] > 0 || hi[i] < kKeys) {  // the diagonal, a window's edge, the context's end
      for (int v = 0; v < 4; ++v) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * v));
        in[v] = _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lo[i]))) &
                _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(hi[i])));
        mx = _mm512_mask_max_ps(mx, in[v], mx, sv[v]);
      }
    } else {
      mx = _mm512_max_ps(_mm512_max_ps(sv[0], sv[1]), _mm512_max_ps(sv[2], sv[3]));
    }
    const float bmax = _mm512_reduce_max_ps(mx);
    if (bmax > m[i] + kLazy || m[i] == -std::numeric_limits<float>::infinity()) {
      if (m[i] != -std::numeric_limits<float>::infinity()) {
        const __m512 alpha = _mm512_set1_ps(std::exp2(m[i] - bmax));
        l[i] *= v16f(alpha);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_store_ps(o + i * D + d, _mm512_mul_ps(_mm512_load_ps(o + i * D + d), alpha));
      }
      m[i] = bmax;
    }
    const __m512 mv = _mm512_set1_ps(m[i]);
    __m512 e[4];
    for (int v = 0; v < 4; ++v) e[v] = _mm512_maskz_mov_ps(in[v], exp2_bf16(_mm512_sub_ps(sv[v], mv)));
    l[i] += v16f(_mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])));
    _mm512_store_si512(pr, row_bf16(e[0], e[1]));
    _mm512_store_si512(pr + 32, row_bf16(e[2], e[3]));
  }
  _tile_loadd(6, p, kKeys * 2);
  _tile_loadd(7, p + 32, kKeys * 2);
  for (int64_t d = 0; d < D; d += 32) {  // two 16-column output tiles at a time
    const uint16_t* v0 = vp + 2 * d;
    const uint16_t* v1 = vp + 32 * D + 2 * d;  // keys 32..63
    _tile_loadd(0, o + d, D * 4);
    _tile_loadd(1, o + d + 16, D * 4);
    _tile_loadd(2, v0, D * 4);
    _tile_loadd(3, v0 + 32, D * 4);
    _tile_loadd(4, v1, D * 4);
    _tile_loadd(5, v1 + 32, D * 4);
    _tile_dpbf16ps(0, 6, 2);
    _tile_dpbf16ps(1, 6, 3);
    _tile_dpbf16ps(0, 7, 4);
    _tile_dpbf16ps(1, 7, 5);
    _tile_stored(0, o + d, D * 4);
    _tile_stored(1, o + d + 16, D * 4);
  }
}

template <typename T>
void amx_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& block_table, int64_t start, float scale, int64_t window, at::Tensor& out) {
  const int64_t Tq = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv, row = Hkv * D;
  // tokens per item: a multiple of 16 (rows then fill whole 16-row blocks), ~kRows rows
  const int64_t tok = 16 * std::max<int64_t>(1, kRows / (16 * G)), ntiles = (Tq + tok - 1) / tok;
  const float* qp = q.data_ptr<float>();
  const T *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
  const int64_t* tp = block_table.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  // items taken from a shared counter, the latest query tiles (the most context) first, so that the
  // threads finish together
  const int64_t items = Hkv * ntiles;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items)));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    configure_tiles();
    const int64_t max_rows = tok * G;
    Aligned<uint32_t> kp(D / 2 * kKeys);
    Aligned<uint16_t> vp(kKeys * D), qb(max_rows * D), p(16 * kKeys);
    Aligned<float> o(max_rows * D), s(16 * kKeys);
    std::vector<float> m(max_rows);
    std::vector<v16f> l(max_rows);
    std::vector<int64_t> lo(max_rows), hi(max_rows);
    const T* krow[kKeys];
    const T* vrow[kKeys];
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const int64_t h = item % Hkv, first = (ntiles - 1 - item / Hkv) * tok;
      const int64_t last = std::min(Tq, first + tok), rows = (last - first) * G, end = start + last;
      const int64_t rows16 = (rows + 15) / 16 * 16;
      std::fill(o.data(), o.data() + rows16 * D, 0.f);
      std::fill(m.begin(), m.begin() + rows16, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows16, v16f{});
      for (int64_t r = 0; r < rows16; ++r) {  // row r = (token first + r / G, head h * G + r % G)
        uint16_t* qr = qb.data() + r * D;
        if (r >= rows) {
          std::memset(qr, 0, D * 2);
          continue;
        }
        const float* src = qp + ((first + r / G) * Hq + h * G + r % G) * D;
        const __m512 sc = _mm512_set1_ps(scale * 1.44269504f);  // scores in log2 units
        for (int64_t d = 0; d < D; d += 32)
          _mm512_storeu_si512(qr + d, row_bf16(_mm512_mul_ps(_mm512_loadu_ps(src + d), sc),
                                               _mm512_mul_ps(_mm512_loadu_ps(src + d + 16), sc)));
      }
      // a sliding window: the tile's first query sees the earliest position any of its queries sees
      for (int64_t pos = window > 0 ? std::max<int64_t>(0, start + first - window + 1) : 0; pos < end; pos += kKeys) {
        const int64_t n = std::min(kKeys, end - pos);
        for (int64_t t = 0; t < kKeys; ++t) {
          const int64_t blk = t < n ? tp[(pos + t) / bs] : 0;
          TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id out of range");
          const int64_t at = (blk * bs + (pos + t) % bs) * row + h * D;
          krow[t] = t < n ? kc + at : nullptr;
          vrow[t] = t < n ? vc + at : nullptr;
        }
        pack_keys(krow, D, kp.data());
        pack_values(vrow, D, vp.data());
        // tokens before pos - start see none of this step (causal)
        const int64_t r0 = std::max<int64_t>(0, pos - start - first) * G / 16 * 16;
        for (int64_t r = r0; r < rows16; ++r) {
          const int64_t qpos = start + first + r / G;
          hi[r] = r < rows ? std::min(n, qpos + 1 - pos) : 0;
          lo[r] = window > 0 ? std::max<int64_t>(0, qpos - window + 1 - pos) : 0;
        }
        for (int64_t r = r0; r < rows16; r += 16)
          block_step(qb.data() + r * D, kp.data(), vp.data(), D, lo.data() + r, hi.data() + r, o.data() + r * D,
                     m.data() + r, l.data() + r, s.data(), p.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / hsum(l[r]));
        float* dst = op + ((first + r / G) * Hq + h * G + r % G) * D;
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_load_ps(o.data() + r * D + d), inv));
      }
    }
    _tile_release();
  });
}

}  // namespace

at::Tensor amx_context_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_table, int64_t start, double scale, int64_t window) {
  TORCH_CHECK(amx_status().empty(), amx_status());
  check_caches(k_cache, v_cache);
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kHalf,
              "the AMX context kernel reads float32 and float16 caches (8-bit ones: paged_context_attention)");
  check_heads(q, k_cache);
  TORCH_CHECK(q.is_contiguous() && q.size(2) % 32 == 0, "q must be contiguous, head_dim a multiple of 32");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong && block_table.is_contiguous(),
              "block_table must be int64 (W,)");
  TORCH_CHECK(start >= 0 && start + q.size(0) <= block_table.size(0) * k_cache.size(1),
              "the block table does not cover the context");
  at::Tensor out = at::empty_like(q);
  if (k_cache.scalar_type() == at::kFloat)
    amx_attention<float>(q, k_cache, v_cache, block_table, start, static_cast<float>(scale), window, out);
  else
    amx_attention<at::Half>(q, k_cache, v_cache, block_table, start, static_cast<float>(scale), window, out);
  return out;
}
#endif

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
#ifdef TOKENMILL_AMX
  m.def("amx_context_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int start, "
        "float scale, int window=0) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
#ifdef TOKENMILL_AMX
  m.impl("amx_context_attention", &tokenmill::amx_context_attention);
#endif
}

// Bidirectional attention of an encoder (models/encoder.py): every token of an input attends to every
// token of the same input, inputs back to back. Why not SDPA's fused CPU kernel: at the 32-wide heads
// of the small embedders (bge-small, MiniLM) its flash schedule, built for keys that do not fit the
// cache, spends most of a 512-token input's time (benchmarks/RESULTS.md §6). An input's keys fit
// the cache whole (512 x 32 floats is 64 KiB), so no online softmax is needed: per (input, head) the
// keys are transposed once, then each tile of query rows computes its row of scores against all
// keys (one K^T vector load feeds a tile's FMAs), takes the softmax over the row, and multiplies it
// into V on register tiles (one V row load feeds the tile's FMAs), in the ISA's own registers
// (VecW: as arrays of v16f the AVX2 build ran several times slower than SDPA).
//   q, k, v (T, H, D) float32 (q scaled by the caller's `scale` here), starts (B + 1,) int64 -> out (T, H, D)
#include <vector>

#include "attention.h"

namespace tokenmill {
namespace {

// Register tiles of VecW (vec.h): 8 rows x 2 zmm (32 keys or outputs) on AVX-512, 6 rows x 2 ymm
// (16) on AVX2 (12 accumulators, two loaded vectors and a broadcast of 16 ymm).
constexpr int kEncRows = kW == 16 ? 8 : 6, kEncVecs = 2;
constexpr int64_t kEncChunk = kEncVecs * kW;

// One tile of `rows` query rows (copied, scaled, zero-padded to kEncRows) against one input's keys.
void attend_tile(const float (*q)[kMaxHeadDim], const float* kt, int64_t n, int64_t n_pad, const float* v,
                 int64_t v_stride, int64_t D, float* scores, float* out, int64_t out_stride, int rows) {
  // scores (kEncRows, n_pad) = q . K^T; the columns past n set to -inf
  for (int64_t j = 0; j < n_pad; j += kEncChunk) {
    VecW acc[kEncRows][kEncVecs];
    for (int r = 0; r < kEncRows; ++r)
      for (int c = 0; c < kEncVecs; ++c) acc[r][c] = zero_w();
    for (int64_t d = 0; d < D; ++d) {
      VecW kv[kEncVecs];
      for (int c = 0; c < kEncVecs; ++c) kv[c] = load_w(kt + d * n_pad + j + c * kW);
      for (int r = 0; r < kEncRows; ++r) {
        const VecW qd = splat_w(&q[r][d]);
        for (int c = 0; c < kEncVecs; ++c) acc[r][c] = fma_w(qd, kv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < kEncRows; ++r)
      for (int c = 0; c < kEncVecs; ++c) store_w(scores + r * n_pad + j + c * kW, acc[r][c]);
  }
  float inv[kEncRows];
  for (int r = 0; r < kEncRows; ++r) {
    float* s = scores + r * n_pad;
    for (int64_t j = n; j < n_pad; ++j) s[j] = -std::numeric_limits<float>::infinity();
    VecW m = load_w(s);
    for (int64_t j = kW; j < n_pad; j += kW) m = max_w(m, load_w(s + j));
    const float mx = hmax_w(m);
    const VecW mv = splat_w(&mx);
    VecW sum = zero_w();
    for (int64_t j = 0; j < n_pad; j += kW) {
      const VecW e = exp_w(sub_w(load_w(s + j), mv));
      store_w(s + j, e);
      sum = add_w(sum, e);
    }
    inv[r] = 1.f / hsum_w(sum);
  }
  // out rows = P . V, kEncChunk output columns at a time
  for (int64_t c0 = 0; c0 < D; c0 += kEncChunk) {
    const int vecs = static_cast<int>(std::min<int64_t>(kEncVecs, (D - c0) / kW));
    VecW acc[kEncRows][kEncVecs];
    for (int r = 0; r < kEncRows; ++r)
      for (int c = 0; c < kEncVecs; ++c) acc[r][c] = zero_w();
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = v + j * v_stride + c0;
      VecW vv[kEncVecs];
      for (int c = 0; c < kEncVecs; ++c) vv[c] = c < vecs ? load_w(vr + c * kW) : zero_w();
      for (int r = 0; r < kEncRows; ++r) {
        const VecW p = splat_w(scores + r * n_pad + j);
        for (int c = 0; c < kEncVecs; ++c) acc[r][c] = fma_w(p, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < vecs; ++c) store_w(out + r * out_stride + c0 + c * kW, mul_w(acc[r][c], splat_w(&inv[r])));
  }
}

at::Tensor encoder_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && q.sizes() == v.sizes(), "q, k, v must be (T, H, D) alike");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "encoder_attention takes float32");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "q, k, v must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D % kLanes == 0 && D <= kMaxHeadDim, "head size must be a multiple of 16, at most 256");
  const at::Tensor st = starts.to(at::kLong).contiguous();
  const int64_t B = st.numel() - 1;
  const int64_t* sp = st.data_ptr<int64_t>();
  TORCH_CHECK(B >= 0 && sp[0] == 0 && sp[B] == T, "starts must run from 0 to T");
  at::Tensor out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row = H * D;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> kt, scores;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / H, h = w % H, s0 = sp[b], n = sp[b + 1] - sp[b];
      if (n <= 0) continue;
      const int64_t n_pad = (n + kEncChunk - 1) / kEncChunk * kEncChunk;
      kt.assign(D * n_pad, 0.f);
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + kLanes <= n; j += kLanes)  // 16 keys x 16 dimensions at a time, in registers
        for (int64_t d = 0; d < D; d += kLanes) {
          __m512 r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(kp + (s0 + j + i) * row + h * D + d);
          transpose16(r);
          for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt.data() + (d + i) * n_pad + j, r[i]);
        }
#endif
      for (; j < n; ++j) {
        const float* kr = kp + (s0 + j) * row + h * D;
        for (int64_t d = 0; d < D; ++d) kt[d * n_pad + j] = kr[d];
      }
      scores.resize(kEncRows * n_pad);
      for (int64_t i0 = 0; i0 < n; i0 += kEncRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kEncRows, n - i0));
        float qt[kEncRows][kMaxHeadDim];
        for (int r = 0; r < kEncRows; ++r)
          for (int64_t d = 0; d < D; ++d) qt[r][d] = r < rows ? qp[(s0 + i0 + r) * row + h * D + d] * sc : 0.f;
        attend_tile(qt, kt.data(), n, n_pad, vp + s0 * row + h * D, row, D, scores.data(),
                    op + (s0 + i0) * row + h * D, row, rows);
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("encoder_attention(Tensor q, Tensor k, Tensor v, Tensor starts, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("encoder_attention", &tokenmill::encoder_attention); }

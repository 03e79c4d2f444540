// Row-wise float32 ops that PyTorch runs as several kernels each on CPU (RMSNorm: pow, mean, add,
// rsqrt, mul, mul; rotary: chunk, four muls, add, sub, cat; SiLU-and-multiply; argmax), each one pass here. At batch 1 the
// per-op dispatch, not the arithmetic, is their cost.
#include "ops.h"

namespace tokenmill {

// y = x / sqrt(mean(x^2) + eps) * w, per row; x (T, H) with contiguous rows.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float (T, H)");
  const int64_t T = x.size(0), H = x.size(1), ld = x.stride(0);
  TORCH_CHECK(w.numel() == H && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be float (H,)");
  at::Tensor y = at::empty({T, H}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = xp + t * ld;
      double ss = 0.0;  // as the reference: accumulate in high precision, then one rsqrt
      for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / H + eps));
      float* yr = yp + t * H;
      for (int64_t i = 0; i < H; ++i) yr[i] = xr[i] * inv * wp[i];
    }
  });
  return y;
}

// Rotate-half (NeoX) rotary embedding of x (T, Hx, D), any strides with contiguous last dimension,
// cos/sin (T, R/2) for the first R <= D dimensions: out[..., i] = x1 cos - x2 sin,
// out[..., i + R/2] = x2 cos + x1 sin for i < R/2; dimensions past R (partial rotary) are copied.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "x must be float (T, H, D)");
  const int64_t T = x.size(0), Hx = x.size(1), D = x.size(2);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.sizes() == sin.sizes() && 2 * cos.size(1) <= D &&
              cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat, "cos/sin must be float (T, R/2) with R <= D");
  const int64_t half = cos.size(1);
  at::Tensor out = at::empty({T, Hx, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, T * Hx, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / Hx, h = i % Hx;
      const float* xr = xp + t * st + h * sh;
      const float *c = cp + t * half, *s = sp + t * half;
      float* o = op + i * D;
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = xr[j], x2 = xr[j + half];
        o[j] = x1 * c[j] - x2 * s[j];
        o[j + half] = x2 * c[j] + x1 * s[j];
      }
      for (int64_t j = 2 * half; j < D; ++j) o[j] = xr[j];
    }
  });
  return out;
}

// RMSNorm of every head of x (T, H, D) (strided rows: a view into the fused qkv output) with one
// weight (D,) shared by the heads, in place: Qwen3's and Gemma 3's q/k norms. The same arithmetic
// as rms_norm above, row by row.
void head_rms_norm_(at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1, "x must be float (T, H, D)");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), st = x.stride(0), sh = x.stride(1);
  TORCH_CHECK(w.numel() == D && w.scalar_type() == at::kFloat && w.is_contiguous(), "w must be float (D,)");
  float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, T * H, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* xr = xp + (i / H) * st + (i % H) * sh;
      double ss = 0.0;
      for (int64_t j = 0; j < D; ++j) ss += static_cast<double>(xr[j]) * xr[j];
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / D + eps));
      for (int64_t j = 0; j < D; ++j) xr[j] = xr[j] * inv * wp[j];
    }
  });
}

// The gated MLP's middle: gu (T, 2I) = [gate | up] -> silu(gate) * up (T, I), in one pass
// instead of PyTorch's silu, then mul (each a kernel launch and a pass over memory).
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.stride(1) == 1 && gu.size(1) % 2 == 0,
              "gate_up must be float (T, 2I)");
  const int64_t T = gu.size(0), I = gu.size(1) / 2, ld = gu.stride(0);
  at::Tensor y = at::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *g = gp + t * ld, *u = g + I;
      float* o = yp + t * I;
      int64_t i = 0;
      for (; i + kLanes <= I; i += kLanes) {
        const v16f x = load(g + i);
        store(o + i, x / (1.f + exp16(v16f{} - x)) * load(u + i), kLanes);
      }
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

// Index of each row's largest value, as torch.argmax: the first of equal maxima, the first NaN if
// there is one. Two vector passes (max, then where it is) instead of PyTorch's scalar-ish CPU
// reduction (a noticeable part of a batched decode step at a vocabulary's width).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "x must be float (N, V) with contiguous rows");
  const int64_t N = x.size(0), V = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({N}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * ld;
      float m = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t i = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
      // GCC scalarizes the 64-byte compares and selects below on AVX2: two 8-lane chains instead
      __m256 m0 = _mm256_set1_ps(m), m1 = m0, u0 = _mm256_setzero_ps(), u1 = u0;
      for (; i + kLanes <= V; i += kLanes) {
        const __m256 a = _mm256_loadu_ps(row + i), b = _mm256_loadu_ps(row + i + 8);
        m0 = _mm256_max_ps(m0, a), m1 = _mm256_max_ps(m1, b);  // m is not used where a NaN is
        u0 = _mm256_or_ps(u0, _mm256_cmp_ps(a, a, _CMP_UNORD_Q)), u1 = _mm256_or_ps(u1, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
      }
      m = hmax8(_mm256_max_ps(m0, m1));
      nan = _mm256_movemask_ps(_mm256_or_ps(u0, u1)) != 0;
#else
      v16f vmax = v16f{} - std::numeric_limits<float>::infinity();
      v16si nans{};
      for (; i + kLanes <= V; i += kLanes) {
        const v16f v = load(row + i);
        vmax = v > vmax ? v : vmax;
        nans |= v != v;
      }
      for (int t = 0; t < kLanes; ++t) {
        m = std::max(m, vmax[t]);
        nan |= nans[t] != 0;
      }
#endif
      for (; i < V; ++i) {
        nan |= std::isnan(row[i]);
        m = std::max(m, row[i]);
      }
      int64_t at = 0;
      if (nan) {
        while (!std::isnan(row[at])) ++at;
      } else {
        while (row[at] != m) ++at;
      }
      op[r] = at;
    }
  });
  return out;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("head_rms_norm_(Tensor(a!) x, Tensor w, float eps) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rms_norm", &tokenmill::rms_norm);
  m.impl("rotary", &tokenmill::rotary);
  m.impl("head_rms_norm_", &tokenmill::head_rms_norm_);
  m.impl("silu_mul", &tokenmill::silu_mul);
  m.impl("argmax_rows", &tokenmill::argmax_rows);
}

// The kernels' entry points, callable from C++ too: the decode stack (stack.cpp) chains them
// without a trip through Python or the dispatcher.
#pragma once
#include "vec.h"

// The dot layout (integer products, linear.cpp) on every variant: 512-bit VPDPBUSD with
// AVX512-VNNI, 256-bit VPDPBUSD with AVX-VNNI, VPMADDUBSW/VPMADDWD with AVX2.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TOKENMILL_DOT 1
#define TOKENMILL_DOT512 1
#elif defined(__AVX2__)
#define TOKENMILL_DOT 1
#endif
// The variant's name (build.py passes -DTOKENMILL_ISA_NAME=avx2 etc.), as a string.
#define TOKENMILL_STR2(x) #x
#define TOKENMILL_STR(x) TOKENMILL_STR2(x)
#ifdef TOKENMILL_ISA_NAME
#define TOKENMILL_ISA TOKENMILL_STR(TOKENMILL_ISA_NAME)
#else
#define TOKENMILL_ISA "unknown"
#endif

namespace tokenmill {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const at::Tensor& m, int64_t N);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t N);
#ifdef TOKENMILL_DOT
// segment: inputs per float32 partial sum (0: all), summed in float64 (linear.cpp); partial: return
// those float64 sums (a row-parallel rank's share, added over the ranks before rounding)
// qh: the fifth bits of 5-bit weights (GGUF Q5_0/Q5_1 with int4_linear_dot, Q5_K with q4k_linear_dot)
// m: float16 minimums, or none for symmetric weights (w = s (q - 8), s (q - 16) with qh)
at::Tensor int4_linear_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const c10::optional<at::Tensor>& m,
                           int64_t N, int64_t bits, int64_t segment = 0, bool partial = false,
                           const c10::optional<at::Tensor>& qh = c10::nullopt);
at::Tensor int8_linear_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, int64_t N, int64_t bits,
                           int64_t segment = 0, bool partial = false);
// GGUF K-quants at their own width (Q4_K: linear.cpp, Q6_K, Q3_K, Q2_K: kquant.cpp, with the layouts)
at::Tensor q4k_linear_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sm, const at::Tensor& dd,
                          int64_t N, int64_t bits, int64_t segment = 0, bool partial = false,
                          const c10::optional<at::Tensor>& qh = c10::nullopt);
at::Tensor q6k_linear_dot(const at::Tensor& x, const at::Tensor& ql, const at::Tensor& qh, const at::Tensor& sc,
                          const at::Tensor& d, int64_t N, int64_t bits, int64_t segment = 0, bool partial = false);
// hb: Q3_K's third bits; without it the weight is Q2_K
at::Tensor q23k_linear_dot(const at::Tensor& x, const at::Tensor& q2, const at::Tensor& sc, const at::Tensor& d,
                           const c10::optional<at::Tensor>& hb, int64_t N, int64_t bits, int64_t segment = 0,
                           bool partial = false);
// GGUF IQ4_NL, IQ4_XS, MXFP4: 4-bit indices into a table, the scales' dtype names the type (lut.cpp)
at::Tensor lut_linear_dot(const at::Tensor& x, const at::Tensor& q, const at::Tensor& s, const c10::optional<at::Tensor>& d,
                          int64_t N, int64_t bits, int64_t segment = 0, bool partial = false);
#endif
// K/V caches the paged kernels read: contiguous float32/float16 (num_blocks, block_size, Hkv, D), same shape.
void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache);
// window > 0: a query attends to its `window` latest positions only (sliding-window layers); 0: all.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window);
at::Tensor paged_context_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table, int64_t start, double scale, int64_t window);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void head_rms_norm_(at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
// y (T, N) += each row's LoRA delta under its adapter slot (lora.cpp)
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const at::Tensor& ranks,
               const at::Tensor& slots, at::IntArrayRef offsets);

}  // namespace tokenmill

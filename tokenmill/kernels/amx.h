// What the bfloat16 matrix kernels share (amx.cpp: projections, amx_attention.cpp: prompt
// attention): the guards that compile them into the `amx` variant (AMX tiles) and the `avx512bf16`
// one (VDPBF16PS in zmm registers: AMD Zen 4/5), the tile configuration, the bfloat16 pair layout.
#pragma once
#include <string>

#include "ops.h"

#if defined(__AVX512BF16__) && defined(TOKENMILL_DOT512)
#define TOKENMILL_BF16MM 1  // amx_linear: prompt chunks in bfloat16 (tiles, or VDPBF16PS without them)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENMILL_AMX 1
#endif

namespace tokenmill {

// "" once this process may use the bfloat16 products (AMX: tile state asked of the OS once,
// amx.cpp; VDPBF16PS: always), else why not.
std::string amx_status();

// x (M, K) float32 times a dot-layout weight (amx.cpp; the decode stack's projections call it too).
at::Tensor amx_linear(const at::Tensor& x, int64_t kind, const at::Tensor& a, const c10::optional<at::Tensor>& b,
                      const c10::optional<at::Tensor>& c, const c10::optional<at::Tensor>& d, int64_t N);

#ifdef TOKENMILL_AMX

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes (16 float32, or 32 bfloat16 = 16 pairs); per thread, before its
// first tile instruction.
inline void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}
#endif

// a, b (16 float32 each) -> 32 bfloat16 (a0, b0, a1, b1, ...): one row of a TDPBF16PS B tile, whose
// rows hold pairs of consecutive inputs k, k + 1 for each of 16 outputs. Round to nearest even.
inline __m512i pairs_bf16(__m512 a, __m512 b) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512bh both = _mm512_cvtne2ps_pbh(b, a);  // low half: a
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), reinterpret_cast<const __m512i&>(both));
}

// a, b (16 float32 each) -> 32 bfloat16 (a0..a15, b0..b15): 32 consecutive inputs of a row, as an A tile holds them.
inline __m512i row_bf16(__m512 a, __m512 b) {
  const __m512bh both = _mm512_cvtne2ps_pbh(b, a);
  return reinterpret_cast<const __m512i&>(both);
}

}  // namespace tokenmill
#endif

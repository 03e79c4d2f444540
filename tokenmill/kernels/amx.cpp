// Prompt chunks on AMX tiles (the `amx` variant: Xeon 4th generation and later), or, on CPUs with
// AVX512-BF16 but no AMX (the `avx512bf16` variant: AMD Zen 4/5), the same bfloat16 products with
// VDPBF16PS in zmm registers (bf16_rows below).
//
// A projection with many rows is a GEMM whose weights are read once per chunk but multiplied by
// every row; AMX's TDPBF16PS does 16x16x32 bfloat16 products per instruction into float32 tiles, several
// times the VPDPBUSD path's rate. The weights stay in their dot-layout panels (linear.cpp, kquant.cpp)
// and are decoded per block of 32 inputs to float32 (scales, minimums, lookup tables applied), then rounded to
// bfloat16 into a tile buffer that the rows of a block of x reuse: no bfloat16 copy of a layer, and
// no per-block scaling inside the tile loop (the integer tiles would need one per 32 inputs, the
// formats' scale granularity, costing more vector work than the tiles save).
// Activations: x rounded to bfloat16 once per chunk (8 bits of mantissa, round to nearest even).
//
// Blocking: threads take groups of panel pairs (32 outputs); a group's decoded weights (a few
// hundred KiB) stay in L2 while x streams 32 rows at a time through 2 x 2 accumulator tiles.
// Tile permission: Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), once
// per process; amx_status says whether it was granted, and the Python side keeps the VNNI path if not.
#include <mutex>
#include <string>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "dot.h"

namespace tokenmill {
#ifdef TOKENMILL_BF16MM
namespace {

#ifdef TOKENMILL_AMX
constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;

std::string request_tiles() {
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
    return "the Linux kernel refused AMX tile state to this process (arch_prctl ARCH_REQ_XCOMP_PERM failed; "
           "Linux 5.16 or later is needed)";
  return "";
}
#else
std::string request_tiles() { return ""; }  // VDPBF16PS needs no permission
#endif

const std::string& tile_status() {
  static const std::string status = request_tiles();
  return status;
}

// tmm0-3: the 2 x 2 float32 accumulators; tmm4-5: two 16-row blocks of x; tmm6-7: two panels' weights.

// One block of 32 inputs of one panel, as 32 vectors of its 16 outputs' weights: w[k][lane].
// The decoders below read the panels' byte layouts (linear.cpp, kquant.cpp).
inline __m512i field(__m512i v, int shift, int mask) {
  return _mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(mask));
}
inline v16f as_float(__m512i v) { return _mm512_cvtepi32_ps(v); }
inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(p); }

// int4 dot layout (byte [o, i*4 + j] = q[8o + j] | q[8o + 4 + j] << 4), w = q s + m; H: fifth bits (qh).
template <class S, bool H>
struct Int4Decoder {
  const uint8_t *q, *qh;
  S sc;
  int64_t K, group, qstride, hstride;  // per panel
  void operator()(int64_t p, int64_t b, v16f* w) const {
    const int64_t g = b * 32 / group;
    const v16f s = sc.scale(static_cast<int>(p), g), m = sc.min(static_cast<int>(p), g);
    const __m512i h = H ? load64(qh + p * hstride + b * 64) : _mm512_setzero_si512();
    for (int o = 0; o < 4; ++o) {
      const __m512i v = load64(q + p * qstride + (b * 4 + o) * 64);
      for (int j = 0; j < 4; ++j) {
        __m512i lo = field(v, 8 * j, 15), hi = field(v, 8 * j + 4, 15);
        if constexpr (H) {
          lo = _mm512_or_si512(lo, _mm512_slli_epi32(field(h, 8 * j + o, 1), 4));
          hi = _mm512_or_si512(hi, _mm512_slli_epi32(field(h, 8 * j + o + 4, 1), 4));
        }
        w[8 * o + j] = as_float(lo) * s + m;
        w[8 * o + 4 + j] = as_float(hi) * s + m;
      }
    }
  }
};

// int8 dot layout (byte [o, i*4 + j] = q[4o + j] + 128): a float32 scale per output, or (GGUF Q8_0)
// a float16 one per block of 32 inputs.
struct Int8Decoder {
  const uint8_t* q;
  const float* s_row;
  const at::Half* s_block;
  int64_t K;
  void operator()(int64_t p, int64_t b, v16f* w) const {
    const v16f s = s_row ? load(s_row + p * kLanes) : load_half(s_block + (p * (K / 32) + b) * kLanes);
    const __m512i bias = _mm512_set1_epi32(128);
    for (int o = 0; o < 8; ++o) {
      const __m512i v = load64(q + p * K * 16 + (b * 8 + o) * 64);
      for (int j = 0; j < 4; ++j) w[4 * o + j] = as_float(_mm512_sub_epi32(field(v, 8 * j, 255), bias)) * s;
    }
  }
};

// GGUF Q6_K (kquant.cpp): w = d sc (q - 32), q = lo | hi << 4, sc per 16 inputs, d per 256.
struct Q6KDecoder {
  const uint8_t *ql, *qh;
  const int8_t* sc;
  const at::Half* d;
  int64_t K;
  void operator()(int64_t p, int64_t b, v16f* w) const {
    const v16f dv = load_half(d + (p * (K / 256) + (b >> 3)) * kLanes);
    const int8_t* scp = sc + (p * (K / 16) + 2 * b) * kLanes;
    const v16f s[2] = {dv * as_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scp)))),
                       dv * as_float(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scp + 16))))};
    const uint8_t* hp = qh + p * K * 4 + b * 128;
    const __m512i h0 = load64(hp), h1 = load64(hp + 64);
    const v16f off = v16f{} + 32.f;
    for (int o = 0; o < 4; ++o) {
      const __m512i v = load64(ql + p * K * 8 + (b * 4 + o) * 64);
      for (int j = 0; j < 4; ++j) {
        const __m512i lo = _mm512_or_si512(field(v, 8 * j, 15), _mm512_slli_epi32(field(h0, 8 * j + 2 * o, 3), 4));
        const __m512i hi = _mm512_or_si512(field(v, 8 * j + 4, 15), _mm512_slli_epi32(field(h1, 8 * j + 2 * o, 3), 4));
        w[8 * o + j] = (as_float(lo) - off) * s[o >> 1];
        w[8 * o + 4 + j] = (as_float(hi) - off) * s[o >> 1];
      }
    }
  }
};

// GGUF Q3_K / Q2_K (kquant.cpp): 2-bit fields (Q3_K: and a third bit), w = q s + m per 16 inputs with
// s = d sc, m = -4 s (Q3_K) or s = d sc, m = -dmin mn (Q2_K).
template <bool THREE>
struct Q23KDecoder {
  const uint8_t *q2, *hb, *sc;
  const at::Half* d;
  int64_t K;
  void operator()(int64_t p, int64_t b, v16f* w) const {
    const int64_t dl = THREE ? 16 : 32;
    const at::Half* dp = d + (p * (K / 256) + (b >> 3)) * dl;
    const v16f dv = load_half(dp), mv = THREE ? v16f{} : load_half(dp + 16);
    const uint8_t* scp = sc + (p * (K / 16) + 2 * b) * kLanes;
    v16f s[2], m[2];
    for (int h = 0; h < 2; ++h) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scp + h * kLanes));
      if constexpr (THREE) {
        s[h] = dv * as_float(_mm512_cvtepi8_epi32(raw)), m[h] = s[h] * -4.f;
      } else {
        const __m512i sm = _mm512_cvtepu8_epi32(raw);
        s[h] = dv * as_float(_mm512_and_si512(sm, _mm512_set1_epi32(15)));
        m[h] = mv * as_float(_mm512_srli_epi32(sm, 4));
      }
    }
    const uint8_t* hp = q2 + p * K * 4 + b * 128;
    const __m512i h0 = load64(hp), h1 = load64(hp + 64);
    const __m512i third = THREE ? load64(hb + p * K * 2 + b * 64) : _mm512_setzero_si512();
    for (int o = 0; o < 4; ++o)
      for (int j = 0; j < 4; ++j) {
        __m512i lo = field(h0, 8 * j + 2 * o, 3), hi = field(h1, 8 * j + 2 * o, 3);
        if constexpr (THREE) {
          lo = _mm512_or_si512(lo, _mm512_slli_epi32(field(third, 8 * j + o, 1), 2));
          hi = _mm512_or_si512(hi, _mm512_slli_epi32(field(third, 8 * j + 4 + o, 1), 2));
        }
        w[8 * o + j] = as_float(lo) * s[o >> 1] + m[o >> 1];
        w[8 * o + 4 + j] = as_float(hi) * s[o >> 1] + m[o >> 1];
      }
  }
};

// GGUF IQ4_NL / IQ4_XS / MXFP4 (lut.cpp): 4-bit indices (int4 dot layout) into a 16-entry table,
// times the block's scale (dot.h LutScales).
struct LutDecoder {
  const uint8_t* q;
  LutScales sc;
  v16f table;
  int64_t K;
  void operator()(int64_t p, int64_t b, v16f* w) const {
    const v16f s = sc.at(static_cast<int>(p), b);
    for (int o = 0; o < 4; ++o) {
      const __m512i v = load64(q + p * K * 8 + (b * 4 + o) * 64);
      for (int j = 0; j < 4; ++j) {
        w[8 * o + j] = v16f(_mm512_permutexvar_ps(field(v, 8 * j, 15), table)) * s;
        w[8 * o + 4 + j] = v16f(_mm512_permutexvar_ps(field(v, 8 * j + 4, 15), table)) * s;
      }
    }
  }
};

// w[32] (input k, 16 outputs) -> one weight tile: row t holds the pairs (w[2t][i], w[2t+1][i]) of
// every output i, the layout TDPBF16PS reads.
inline void to_tile(const v16f* w, uint16_t* tile) {
  for (int t = 0; t < 16; ++t) _mm512_store_si512(tile + t * 32, pairs_bf16(w[2 * t], w[2 * t + 1]));
}

constexpr int64_t kTileWords = 16 * 32;  // one weight tile: 16 rows of 32 bfloat16
constexpr int64_t kL2Budget = 1 << 20;   // bytes of decoded weights a thread keeps per group of panels

#ifndef TOKENMILL_AMX
// Without tiles: row t of a weight tile (64 bytes, the pairs k = 2t, 2t + 1 of 16 outputs) is
// VDPBF16PS's weight operand as it is, x's pair broadcast to all 16 lanes. kBf16Rows rows x the two
// panels of a pair in 16 float32 accumulators: each weight vector read feeds 8 rows, each
// broadcast 2 panels. (An 8 x 2 block ran as fast as 12 x 2 and faster than 4 x 2 on Zen 5.)
constexpr int64_t kBf16Rows = 8;

template <bool Two>
void bf16_rows(const at::BFloat16* x, int64_t ldx, const uint16_t* wt, int64_t nb, float* y, int64_t ldy) {
  __m512 acc[kBf16Rows][2];
  for (int r = 0; r < kBf16Rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint16_t* w0 = wt + b * 2 * kTileWords;
    for (int t = 0; t < 16; ++t) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_load_si512(w0 + t * 32));
      const __m512bh c = Two ? reinterpret_cast<__m512bh>(_mm512_load_si512(w0 + kTileWords + t * 32)) : a;
      for (int r = 0; r < kBf16Rows; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + b * 32 + 2 * t, 4);
        const __m512bh xp = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, xp);
        if constexpr (Two) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], c, xp);
      }
    }
  }
  for (int r = 0; r < kBf16Rows; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc[r][0]);
    if constexpr (Two) _mm512_storeu_ps(y + r * ldy + kLanes, acc[r][1]);
  }
}
#endif

// y (Mp, P*16) = xb (Mp, K) bfloat16 times the decoded panels; Mp a multiple of 16.
template <class Decoder>
void amx_gemm(const Decoder& dec, const at::BFloat16* xb, int64_t ldx, int64_t Mp, int64_t K, int64_t P, float* y) {
  const int64_t nb = K / 32, ldy = P * kLanes, pairs = (P + 1) / 2;
  const int64_t per_group = std::max<int64_t>(1, kL2Budget / (nb * 2 * kTileWords * 2));
  const int64_t groups = (pairs + per_group - 1) / per_group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
#ifdef TOKENMILL_AMX
    configure_tiles();
#endif
    uint16_t* buf = static_cast<uint16_t*>(aligned_alloc(64, per_group * nb * 2 * kTileWords * 2));
    alignas(64) v16f w[32];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t0 = g * per_group, t1 = std::min(pairs, t0 + per_group);
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t j = 0; j < 2; ++j) {
          const int64_t p = 2 * t + j;
          if (p >= P) break;
          for (int64_t b = 0; b < nb; ++b) {
            dec(p, b, w);
            to_tile(w, buf + (((t - t0) * nb + b) * 2 + j) * kTileWords);
          }
        }
#ifndef TOKENMILL_AMX
      for (int64_t m = 0; m < Mp; m += kBf16Rows)
        for (int64_t t = t0; t < t1; ++t) {
          const uint16_t* wt = buf + (t - t0) * nb * 2 * kTileWords;
          float* yt = y + m * ldy + 2 * t * kLanes;
          if (2 * t + 1 < P) bf16_rows<true>(xb + m * ldx, ldx, wt, nb, yt, ldy);
          else bf16_rows<false>(xb + m * ldx, ldx, wt, nb, yt, ldy);
        }
#else
      for (int64_t m = 0; m < Mp; m += 32) {
        const bool two_rows = m + 16 < Mp;
        const at::BFloat16* x0 = xb + m * ldx;
        const at::BFloat16* x1 = x0 + 16 * ldx;
        for (int64_t t = t0; t < t1; ++t) {
          const bool two_panels = 2 * t + 1 < P;
          const uint16_t* wt = buf + (t - t0) * nb * 2 * kTileWords;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          // the next 32 rows of x into L2 meanwhile, a share per panel pair: x is read once per
          // group of pairs, and tile loads that miss L2 cost several times those that hit
          const int64_t ngroup = t1 - t0, r0 = (t - t0) * 32 / ngroup, r1 = (t - t0 + 1) * 32 / ngroup;
          const at::BFloat16* next = m + 32 < Mp ? x0 + 32 * ldx : nullptr;
          for (int64_t b = 0; b < nb; ++b) {
            if (next)
              for (int64_t r = r0; r < r1; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * ldx + b * 32), _MM_HINT_T1);
            _tile_loadd(4, x0 + b * 32, ldx * 2);
            _tile_loadd(6, wt + b * 2 * kTileWords, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two_panels) {
              _tile_loadd(7, wt + (b * 2 + 1) * kTileWords, 64);
              _tile_dpbf16ps(1, 4, 7);
            }
            if (two_rows) {
              _tile_loadd(5, x1 + b * 32, ldx * 2);
              _tile_dpbf16ps(2, 5, 6);
              if (two_panels) _tile_dpbf16ps(3, 5, 7);
            }
          }
          float* yt = y + m * ldy + 2 * t * kLanes;
          _tile_stored(0, yt, ldy * 4);
          if (two_panels) _tile_stored(1, yt + kLanes, ldy * 4);
          if (two_rows) {
            _tile_stored(2, yt + 16 * ldy, ldy * 4);
            if (two_panels) _tile_stored(3, yt + 16 * ldy + kLanes, ldy * 4);
          }
        }
      }
#endif
    }
    free(buf);
#ifdef TOKENMILL_AMX
    _tile_release();
#endif
  });
}

// x (M, K) float32 -> the first K columns of xb (Mp, ldx) bfloat16, round to nearest even; rows
// M..Mp zero. Threaded over rows (ATen's copy_ ran on one thread, a visible share of a prompt chunk).
void to_bf16(const at::Tensor& x, at::Tensor& xb, int64_t Mp) {
  const int64_t M = x.size(0), K = x.size(1), ldx = xb.size(1);
  const float* src = x.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  at::parallel_for(0, Mp, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* d = dst + r * ldx;
      if (r >= M) {
        std::memset(d, 0, K * 2);
        continue;
      }
      for (int64_t k = 0; k < K; k += 32)
        _mm512_storeu_si512(d + k, row_bf16(_mm512_loadu_ps(src + r * K + k), _mm512_loadu_ps(src + r * K + k + 16)));
    }
  });
}

const at::Tensor& need(const c10::optional<at::Tensor>& t, const char* what) {
  TORCH_CHECK(t.has_value() && t->defined(), what, " is required for this kind");
  return *t;
}

}  // namespace

std::string amx_status() { return tile_status(); }

// x (M, K) float32 times a dot-layout weight of stack.cpp's kind (panels.StackKind: 3 int4, 4 int8,
// 5 Q4_K/Q5_K, 6 Q6_K, 8 IQ4_NL/IQ4_XS/MXFP4, 9 Q3_K/Q2_K) with its four tensors, as panels.stack_args() hands them -> (M, N) float32.
at::Tensor amx_linear(const at::Tensor& x, int64_t kind, const at::Tensor& a, const c10::optional<at::Tensor>& b,
                      const c10::optional<at::Tensor>& c, const c10::optional<at::Tensor>& d, int64_t N) {
  TORCH_CHECK(tile_status().empty(), tile_status());
  TORCH_CHECK(a.dim() == 3 && a.scalar_type() == at::kByte && a.is_contiguous() && a.size(2) == 64,
              "panel bytes must be uint8 (P, rows, 64)");
  const int64_t P = a.size(0), M = x.size(0);
  const int64_t K = a.size(1) * (kind == 4 ? 4 : kind == 9 ? 16 : 8);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  check_x(x, K);
  check_n(N, P);
  const int64_t Mp = (M + 15) / 16 * 16;
  // rows 64 bytes longer than K: at a power-of-two stride the 16 rows of an x tile share one L1 set
  const int64_t ldx = K + 32;
  at::Tensor xb = at::empty({Mp, ldx}, x.options().dtype(at::kBFloat16));
  to_bf16(x, xb, Mp);
  at::Tensor y = at::empty({Mp, P * kLanes}, x.options());
  const at::BFloat16* xp = xb.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  const uint8_t* q = a.data_ptr<uint8_t>();
  if (kind == 3 || kind == 5) {
    const at::Tensor& t1 = need(b, "scales");
    const bool five = d.has_value() && d->defined();
    const uint8_t* qh = five ? d->data_ptr<uint8_t>() : nullptr;
    if (five) check_panel(*d, {P, K / 32, 64}, at::kByte, "fifth bits");
    auto run = [&](auto scales, int64_t group) {
      if (five) amx_gemm(Int4Decoder<decltype(scales), true>{q, qh, scales, K, group, K * 8, K * 2}, xp, ldx, Mp, K, P, yp);
      else amx_gemm(Int4Decoder<decltype(scales), false>{q, qh, scales, K, group, K * 8, K * 2}, xp, ldx, Mp, K, P, yp);
    };
    if (kind == 3) {
      const int64_t G = t1.size(1);
      check_panel(t1, {P, G, kLanes}, at::kHalf, "int4 scales");
      const bool sym = !c.has_value() || !c->defined();  // symmetric: m = -8 s (-16 s with fifth bits)
      if (!sym) check_panel(*c, {P, G, kLanes}, at::kHalf, "int4 minimums");
      TORCH_CHECK(K % G == 0 && (K / G) % 32 == 0, "int4 groups must be whole blocks of 32");
      run(HalfScales{t1.data_ptr<at::Half>(), sym ? nullptr : c->data_ptr<at::Half>(), G * kLanes, five ? 16.f : 8.f}, K / G);
    } else {
      const at::Tensor& t2 = need(c, "minimums");
      TORCH_CHECK(K % 256 == 0, "Q4_K needs K a multiple of 256");
      check_panel(t1, {P, K / 32, 32}, at::kByte, "Q4_K scales");
      check_panel(t2, {P, K / 256, 32}, at::kHalf, "Q4_K super-block scales");
      run(KScales{t1.data_ptr<uint8_t>(), t2.data_ptr<at::Half>(), K / 32 * 32, K / 256 * 32}, 32);
    }
  } else if (kind == 4) {
    const at::Tensor& s = need(b, "scales");
    if (s.dim() == 3) {
      check_panel(s, {P, K / 32, kLanes}, at::kHalf, "int8 block scales");
      amx_gemm(Int8Decoder{q, nullptr, s.data_ptr<at::Half>(), K}, xp, ldx, Mp, K, P, yp);
    } else {
      TORCH_CHECK(s.numel() == P * kLanes && s.scalar_type() == at::kFloat && s.is_contiguous(), "int8 scales must be float (P*16,)");
      amx_gemm(Int8Decoder{q, s.data_ptr<float>(), nullptr, K}, xp, ldx, Mp, K, P, yp);
    }
  } else if (kind == 6) {
    TORCH_CHECK(K % 256 == 0, "Q6_K needs K a multiple of 256");
    const at::Tensor& qh = need(b, "Q6_K highs");
    const at::Tensor& sc = need(c, "Q6_K scales");
    const at::Tensor& dd = need(d, "Q6_K d");
    check_panel(qh, {P, K / 32, 128}, at::kByte, "Q6_K highs");
    check_panel(sc, {P, K / 16, kLanes}, at::kChar, "Q6_K scales");
    check_panel(dd, {P, K / 256, kLanes}, at::kHalf, "Q6_K d");
    amx_gemm(Q6KDecoder{q, qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), dd.data_ptr<at::Half>(), K}, xp, ldx, Mp, K, P, yp);
  } else if (kind == 9) {
    TORCH_CHECK(K % 256 == 0, "Q2_K/Q3_K need K a multiple of 256");
    const at::Tensor& sc = need(b, "Q2_K/Q3_K scales");
    const at::Tensor& dd = need(c, "Q2_K/Q3_K d");
    const bool three = d.has_value() && d->defined();
    if (three) check_panel(*d, {P, K / 32, 64}, at::kByte, "Q3_K third bits");
    check_panel(sc, {P, K / 16, kLanes}, three ? at::kChar : at::kByte, "Q2_K/Q3_K scales");
    check_panel(dd, {P, K / 256, three ? kLanes : 2 * kLanes}, at::kHalf, "Q2_K/Q3_K d");
    const uint8_t* scp = static_cast<const uint8_t*>(sc.data_ptr());
    if (three) amx_gemm(Q23KDecoder<true>{q, d->data_ptr<uint8_t>(), scp, dd.data_ptr<at::Half>(), K}, xp, ldx, Mp, K, P, yp);
    else amx_gemm(Q23KDecoder<false>{q, nullptr, scp, dd.data_ptr<at::Half>(), K}, xp, ldx, Mp, K, P, yp);
  } else if (kind == 8) {
    const at::Tensor& s = need(b, "lookup-type scales");
    const int lut = s.scalar_type() == at::kHalf ? 0 : s.scalar_type() == at::kChar ? 1 : 2;
    check_panel(s, {P, K / 32, kLanes}, lut == 0 ? at::kHalf : lut == 1 ? at::kChar : at::kByte, "lookup-type scales");
    const at::Half* dp = nullptr;
    if (lut == 1) {
      const at::Tensor& dd = need(c, "IQ4_XS d");
      TORCH_CHECK(K % 256 == 0, "IQ4_XS needs K a multiple of 256");
      check_panel(dd, {P, K / 256, kLanes}, at::kHalf, "IQ4_XS d");
      dp = dd.data_ptr<at::Half>();
    }
    alignas(64) float table[16];
    for (int i = 0; i < 16; ++i) table[i] = (lut == 2 ? kFP4 : kIQ4)[i];
    const LutScales sc{s.data_ptr(), dp, lut, K / 32 * kLanes, K / 256 * kLanes};
    amx_gemm(LutDecoder{q, sc, load(table), K}, xp, ldx, Mp, K, P, yp);
  } else {
    TORCH_CHECK(false, "amx_linear: no AMX path for weight kind ", kind);
  }
  y = y.narrow(0, 0, M);
  return N == P * kLanes ? y : y.narrow(1, 0, N).contiguous();
}
#endif

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
#ifdef TOKENMILL_BF16MM
  m.def("amx_status", &tokenmill::amx_status);
  m.def("amx_linear(Tensor x, int kind, Tensor a, Tensor? b, Tensor? c, Tensor? d, int N) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
#ifdef TOKENMILL_BF16MM
  m.impl("amx_linear", &tokenmill::amx_linear);
#endif
}

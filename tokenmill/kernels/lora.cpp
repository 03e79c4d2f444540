// LoRA deltas for a batch whose rows run under different adapters (tokenmill/layers/lora.py).
//
// A projection keeps S adapter slots beside its base weight, which is never merged or copied:
// A (S, K, P R), float32 or float16 — per slot, for each input, the down-projection's R rows of every output part
// (q/k/v of a fused projection, or the one part), transposed so that a slot's adapter rows are
// contiguous lanes — and B (S, R, N), the up-projection with the adapter's scale folded in; part p
// owns output columns [offsets[p], offsets[p+1]); ranks (S, P) says how many of the R rows a slot's
// part uses (0: the adapter leaves that part alone). Row t of the batch runs under slot slots[t]
// (-1: the base alone) and gets  y[t, part p] += sum_j (x[t] . A[s, :, p R + j]) B[s, j, part p].
//
// Rows are grouped by slot, whatever the mix, into blocks of up to kLoraBlock rows, and the delta
// takes two passes, each a small register-tiled product (up to 12 rows by two vectors of columns):
// shrink, per (block, columns of A), tmp = x A; expand, per (block, columns of one part), y += tmp B.
// With blocks enough for every thread (a decode step mixing adapters) each block runs both passes
// in one parallel region; otherwise (one adapter, or a prompt chunk) each pass is a parallel region
// over its work items. One or two regions per projection and step, however many adapters the step
// mixes. A row's arithmetic never depends on the other rows (no BLAS, whose kernels vary with
// shapes and alignment): a request's outputs are the same alone or in any batch.
#include "attention.h"  // load_kv: 16 float32 or float16 values as floats

#include <vector>

namespace tokenmill {
namespace {

constexpr int64_t kLoraBlock = 32;  // rows per work item: a prompt chunk's rows share each adapter read

#if defined(__AVX2__)
constexpr int64_t kLoraRows = kW == 16 ? 12 : 6;  // x 2 vectors: 24 of 32 zmm; on AVX2 12 + 2 weights + 1 = 15 ymm
constexpr int64_t kLoraCols = 2 * kW;  // columns per work item: two vectors

// out[i][0:n] (+)= sum_k in[i][k] w[k][0:n] for kt rows (row i at in[i], out[i]); w row stride ldw;
// n <= nv vectors, all of them when full; accumulate: out starts from its values (else from zero).
// Each output is the same chain of FMAs over k whatever the tile: a row's result never depends on
// the other rows.
template <int64_t kt, int nv, bool full, typename W>
inline void lora_tile(const float* const* in, float* const* out, const W* w, int64_t ldw, int64_t depth, int64_t n,
                      bool accumulate) {
  VecW acc[kt][nv];
  for (int64_t i = 0; i < kt; ++i)
    for (int v = 0; v < nv; ++v) acc[i][v] = accumulate ? load_w_n(out[i] + kW * v, n - kW * v) : zero_w();
  for (int64_t k = 0; k < depth; ++k) {
    const W* wk = w + k * ldw;
    VecW wv[nv];
    for (int v = 0; v < nv; ++v) wv[v] = full ? load_w(wk + kW * v) : load_w_n(wk + kW * v, n - kW * v);
    for (int64_t i = 0; i < kt; ++i) {
      const VecW xi = splat_w(in[i] + k);
      for (int v = 0; v < nv; ++v) acc[i][v] = fma_w(xi, wv[v], acc[i][v]);
    }
  }
  for (int64_t i = 0; i < kt; ++i)
    for (int v = 0; v < nv; ++v) store_w_n(out[i] + kW * v, acc[i][v], n - kW * v);
}

template <int64_t kt, typename W>
inline void lora_tile_any(const float* const* in, float* const* out, const W* w, int64_t ldw, int64_t depth, int64_t n,
                          bool accumulate) {
  if (n == 2 * kW) lora_tile<kt, 2, true, W>(in, out, w, ldw, depth, n, accumulate);
  else if (n == kW) lora_tile<kt, 1, true, W>(in, out, w, ldw, depth, n, accumulate);
  else if (n > kW) lora_tile<kt, 2, false, W>(in, out, w, ldw, depth, n, accumulate);
  else lora_tile<kt, 1, false, W>(in, out, w, ldw, depth, n, accumulate);
}
#else
// Without AVX2: the same tile on 16-lane vector values, one vector of columns.
constexpr int64_t kLoraCols = kLanes, kLoraRows = kRowTile;
template <typename W>
inline v16f load_n(const W* p, int64_t n) {
  if (n >= kLanes) return load_kv(p);
  W buf[kLanes] = {};
  std::memcpy(buf, p, sizeof(W) * n);
  return load_kv(buf);
}
template <int64_t kt, typename W>
inline void lora_tile_any(const float* const* in, float* const* out, const W* w, int64_t ldw, int64_t depth, int64_t n,
                          bool accumulate) {
  v16f acc[kt];
  for (int64_t i = 0; i < kt; ++i) acc[i] = accumulate ? load_n(out[i], n) : v16f{};
  for (int64_t k = 0; k < depth; ++k) {
    const v16f wv = load_n(w + k * ldw, n);
    for (int64_t i = 0; i < kt; ++i) acc[i] += splat(in[i][k]) * wv;
  }
  for (int64_t i = 0; i < kt; ++i) store(out[i], acc[i], static_cast<int>(n));
}
#endif

// the tile over `rows` rows in tiles of kLoraRows, then 8, 4, 2 and 1 for the rest
template <typename W>
inline void lora_rows(const float* const* in, float* const* out, int64_t rows, const W* w, int64_t ldw,
                      int64_t depth, int64_t n, bool accumulate) {
  int64_t i = 0;
  for (; i + kLoraRows <= rows; i += kLoraRows) lora_tile_any<kLoraRows, W>(in + i, out + i, w, ldw, depth, n, accumulate);
  if (kLoraRows > 8 && i + 8 <= rows) lora_tile_any<8, W>(in + i, out + i, w, ldw, depth, n, accumulate), i += 8;
  if (kLoraRows > 4 && i + 4 <= rows) lora_tile_any<4, W>(in + i, out + i, w, ldw, depth, n, accumulate), i += 4;
  if (i + 2 <= rows) lora_tile_any<2, W>(in + i, out + i, w, ldw, depth, n, accumulate), i += 2;
  if (i < rows) lora_tile_any<1, W>(in + i, out + i, w, ldw, depth, n, accumulate);
}

}  // namespace

namespace {

template <typename W>
void lora_add_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const at::Tensor& ranks,
                   const at::Tensor& slots, at::IntArrayRef offsets) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float (T, K)");
  TORCH_CHECK(ranks.dim() == 2 && ranks.scalar_type() == at::kLong && ranks.is_contiguous(), "ranks must be int64 (S, P)");
  const int64_t T = x.size(0), K = x.size(1), S = ranks.size(0), P = ranks.size(1);
  TORCH_CHECK(A.dim() == 3 && A.is_contiguous() && A.size(0) == S && A.size(1) == K && A.size(2) % P == 0,
              "A must be (S, K, P R)");
  const int64_t U = A.size(2), R = U / P, N = B.size(2);
  TORCH_CHECK(B.dim() == 3 && B.is_contiguous() && B.scalar_type() == A.scalar_type() && B.size(0) == S &&
              B.size(1) == R, "B must be (S, R, N) of A's dtype beside A (S, K, P R)");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == T && y.size(1) == N && y.stride(1) == 1 && y.scalar_type() == at::kFloat,
              "y must be float (T, N)");
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == T && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "one int64 slot per row");
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == P + 1 && offsets[0] == 0 && offsets[P] == N,
              "offsets: P + 1 column bounds from 0 to N");
  const int64_t *sp = slots.data_ptr<int64_t>(), *rp = ranks.data_ptr<int64_t>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  const float* xp = x.data_ptr<float>();
  const W *ap = A.data_ptr<W>(), *bp = B.data_ptr<W>();
  float* yp = y.data_ptr<float>();

  // blocks of rows of one slot, as row pointers: x rows in, tmp rows (shrink's out, expand's in), y rows out
  std::vector<std::vector<int64_t>> rows(S);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= -1 && sp[t] < S, "slot ", sp[t], " outside [-1, ", S, ")");
    if (sp[t] >= 0) rows[sp[t]].push_back(t);
  }
  std::vector<float> tmp(static_cast<size_t>(T) * U);
  std::vector<const float*> xr(T), tr(T);
  std::vector<float*> tw(T), yr(T);
  struct Block { int64_t s, first, n; };  // rows first .. first + n of the pointer arrays
  std::vector<Block> blocks;
  int64_t at = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (size_t i = 0; i < rows[s].size(); ++i, ++at) {
      const int64_t t = rows[s][i];
      xr[at] = xp + t * ldx, tr[at] = tw[at] = tmp.data() + t * U, yr[at] = yp + t * ldy;
      if (i % kLoraBlock == 0) blocks.push_back({s, at, std::min<int64_t>(kLoraBlock, rows[s].size() - i)});
    }
  }
  if (blocks.empty()) return;
  // shrink: per (block, kLoraCols columns of A that some part of its slot uses)
  struct Item { int64_t block, p, col, n; };
  std::vector<Item> shrinks, expands;
  std::vector<int64_t> shrink_end, expand_end;  // per block: where its items end
  for (int64_t b = 0; b < static_cast<int64_t>(blocks.size()); ++b) {
    for (int64_t c = 0; c < U; c += kLoraCols) {
      bool used = false;
      for (int64_t p = c / R; p <= std::min(P - 1, (c + kLoraCols - 1) / R); ++p) used |= rp[blocks[b].s * P + p] > 0;
      if (used) shrinks.push_back({b, 0, c, std::min(kLoraCols, U - c)});
    }
    // expand: per (block, kLoraCols columns of one part its slot's adapter changes)
    for (int64_t p = 0; p < P; ++p)
      if (rp[blocks[b].s * P + p])
        for (int64_t c = offsets[p]; c < offsets[p + 1]; c += kLoraCols)
          expands.push_back({b, p, c, std::min(kLoraCols, offsets[p + 1] - c)});
    shrink_end.push_back(static_cast<int64_t>(shrinks.size()));
    expand_end.push_back(static_cast<int64_t>(expands.size()));
  }
  if (shrinks.empty()) return;
  const auto shrink = [&](const Item& it) {
    const Block& bl = blocks[it.block];
    float* out[kLoraBlock];
    for (int64_t i = 0; i < bl.n; ++i) out[i] = tw[bl.first + i] + it.col;
    lora_rows(xr.data() + bl.first, out, bl.n, ap + bl.s * K * U + it.col, U, K, it.n, false);
  };
  const auto expand = [&](const Item& it) {
    const Block& bl = blocks[it.block];
    const float* in[kLoraBlock];
    float* out[kLoraBlock];
    for (int64_t i = 0; i < bl.n; ++i) in[i] = tr[bl.first + i] + it.p * R, out[i] = yr[bl.first + i] + it.col;
    lora_rows(in, out, bl.n, bp + bl.s * R * N + it.col, N, rp[bl.s * P + it.p], it.n, true);
  };
  const int64_t nb = static_cast<int64_t>(blocks.size());
  if (nb >= 2 * at::get_num_threads()) {  // blocks enough to share out: each whole, one parallel region
    at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        for (int64_t w = b ? shrink_end[b - 1] : 0; w < shrink_end[b]; ++w) shrink(shrinks[w]);
        for (int64_t w = b ? expand_end[b - 1] : 0; w < expand_end[b]; ++w) expand(expands[w]);
      }
    });
    return;
  }
  at::parallel_for(0, static_cast<int64_t>(shrinks.size()), 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) shrink(shrinks[w]);
  });
  at::parallel_for(0, static_cast<int64_t>(expands.size()), 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) expand(expands[w]);
  });
}

}  // namespace

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const at::Tensor& ranks,
               const at::Tensor& slots, at::IntArrayRef offsets) {
  if (A.scalar_type() == at::kHalf) return lora_add_impl<at::Half>(y, x, A, B, ranks, slots, offsets);
  TORCH_CHECK(A.scalar_type() == at::kFloat, "LoRA slots must be float32 or float16");
  lora_add_impl<float>(y, x, A, B, ranks, slots, offsets);
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor A, Tensor B, Tensor ranks, Tensor slots, int[] offsets) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("lora_add_", [](at::Tensor y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                         const at::Tensor& ranks, const at::Tensor& slots, at::IntArrayRef offsets) {
    tokenmill::lora_add_(y, x, A, B, ranks, slots, offsets);
  });
}

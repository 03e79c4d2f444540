// LoRA deltas for a batch whose rows run under different adapters (tokenmill/layers/lora.py).
//
// A projection keeps S adapter slots beside its base weight, which is never merged or copied:
// A (S, P, R, K) — per slot and output part (q/k/v of a fused projection, or the one part) up to R
// rows of the down-projection — and B (S, R, N), the up-projection with the adapter's scale folded
// in; part p owns output columns [offsets[p], offsets[p+1]); ranks (S, P) says how many of the R rows
// a slot's part uses (0: the adapter leaves that part alone). Row t of the batch runs under slot
// slots[t] (-1: the base alone) and gets  y[t, part p] += (x[t] . A[s, p, j]) B[s, j, part p].
//
// Rows are grouped by slot, whatever the mix, into blocks of up to kLoraBlock rows, and the delta
// takes two parallel passes: shrink, per (block, run of adapter rows), one dot product per row and
// adapter row, each adapter row read once per block; expand, per (block, column chunk), each chunk
// of B read once per block. Two parallel regions per projection and step, however many adapters
// the step mixes. A row's arithmetic never depends on the other rows (no BLAS, whose kernels vary
// with shapes and alignment): a request's outputs are the same alone or in any batch.
#include "ops.h"

#include <vector>

namespace tokenmill {
namespace {

constexpr int64_t kLoraBlock = 16;  // rows per work item (a prompt chunk's rows share adapter reads)
constexpr int64_t kLoraUnits = 16;  // adapter rows per shrink work item
constexpr int64_t kLoraChunk = 128; // output columns per expand work item

inline float lora_dot(const float* a, const float* b, int64_t k) {
  v16f s0 = {}, s1 = {};
  int64_t i = 0;
  for (; i + 2 * kLanes <= k; i += 2 * kLanes) {
    s0 += load(a + i) * load(b + i);
    s1 += load(a + i + kLanes) * load(b + i + kLanes);
  }
  for (; i + kLanes <= k; i += kLanes) s0 += load(a + i) * load(b + i);
  float s = hsum(s0 + s1);
  for (; i < k; ++i) s += a[i] * b[i];
  return s;
}

inline void lora_axpy(float* y, const float* b, float c, int64_t n) {
  const v16f cv = splat(c);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(y + i, load(y + i) + cv * load(b + i), kLanes);
  for (; i < n; ++i) y[i] += c * b[i];
}

}  // namespace

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, const at::Tensor& ranks,
               const at::Tensor& slots, at::IntArrayRef offsets) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float (T, K)");
  TORCH_CHECK(A.dim() == 4 && A.is_contiguous() && A.scalar_type() == at::kFloat, "A must be float (S, P, R, K)");
  const int64_t T = x.size(0), K = x.size(1), S = A.size(0), P = A.size(1), R = A.size(2), N = B.size(2);
  TORCH_CHECK(A.size(3) == K && B.dim() == 3 && B.is_contiguous() && B.scalar_type() == at::kFloat && B.size(0) == S &&
              B.size(1) == R, "B must be float (S, R, N) beside A (S, P, R, K)");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == T && y.size(1) == N && y.stride(1) == 1 && y.scalar_type() == at::kFloat,
              "y must be float (T, N)");
  TORCH_CHECK(ranks.dim() == 2 && ranks.size(0) == S && ranks.size(1) == P && ranks.scalar_type() == at::kLong &&
              ranks.is_contiguous(), "ranks must be int64 (S, P)");
  TORCH_CHECK(slots.dim() == 1 && slots.numel() == T && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "one int64 slot per row");
  TORCH_CHECK(static_cast<int64_t>(offsets.size()) == P + 1 && offsets[0] == 0 && offsets[P] == N,
              "offsets: P + 1 column bounds from 0 to N");
  const int64_t *sp = slots.data_ptr<int64_t>(), *rp = ranks.data_ptr<int64_t>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  const float *xp = x.data_ptr<float>(), *ap = A.data_ptr<float>(), *bp = B.data_ptr<float>();
  float* yp = y.data_ptr<float>();

  // blocks of rows of one slot
  std::vector<std::vector<int64_t>> rows(S);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= -1 && sp[t] < S, "slot ", sp[t], " outside [-1, ", S, ")");
    if (sp[t] >= 0) rows[sp[t]].push_back(t);
  }
  struct Block { int64_t s; const int64_t* rows; int64_t n; };
  std::vector<Block> blocks;
  for (int64_t s = 0; s < S; ++s)
    for (size_t i = 0; i < rows[s].size(); i += kLoraBlock)
      blocks.push_back({s, rows[s].data() + i, std::min<int64_t>(kLoraBlock, rows[s].size() - i)});
  if (blocks.empty()) return;
  // shrink: tmp[row][p * R + j] = x[row] . A[s, p, j]; work items (block, run of the slot's adapter rows)
  std::vector<float> tmp(static_cast<size_t>(T) * P * R);
  struct Shrink { int64_t block, p, j0, j1; };
  std::vector<Shrink> shrinks;
  for (int64_t b = 0; b < static_cast<int64_t>(blocks.size()); ++b)
    for (int64_t p = 0; p < P; ++p)
      for (int64_t j = 0, r = rp[blocks[b].s * P + p]; j < r; j += kLoraUnits)
        shrinks.push_back({b, p, j, std::min(r, j + kLoraUnits)});
  if (shrinks.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(shrinks.size()), 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const Shrink& u = shrinks[w];
      const Block& bl = blocks[u.block];
      for (int64_t j = u.j0; j < u.j1; ++j) {
        const float* a = ap + ((bl.s * P + u.p) * R + j) * K;
        for (int64_t i = 0; i < bl.n; ++i) tmp[(bl.rows[i] * P + u.p) * R + j] = lora_dot(xp + bl.rows[i] * ldx, a, K);
      }
    }
  });
  // expand: work items (block, column chunk of one part)
  struct Expand { int64_t block, p, col; };
  std::vector<Expand> expands;
  for (int64_t b = 0; b < static_cast<int64_t>(blocks.size()); ++b)
    for (int64_t p = 0; p < P; ++p)
      if (rp[blocks[b].s * P + p])
        for (int64_t c = offsets[p]; c < offsets[p + 1]; c += kLoraChunk) expands.push_back({b, p, c});
  at::parallel_for(0, static_cast<int64_t>(expands.size()), 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const Expand& u = expands[w];
      const Block& bl = blocks[u.block];
      const int64_t width = std::min(kLoraChunk, offsets[u.p + 1] - u.col);
      for (int64_t j = 0, r = rp[bl.s * P + u.p]; j < r; ++j) {
        const float* b = bp + (bl.s * R + j) * N + u.col;
        for (int64_t i = 0; i < bl.n; ++i)
          lora_axpy(yp + bl.rows[i] * ldy + u.col, b, tmp[(bl.rows[i] * P + u.p) * R + j], width);
      }
    }
  });
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

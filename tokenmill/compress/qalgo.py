"""The quantization algorithms, on plain tensors: round-to-nearest, GPTQ (Frantar et al. 2022)
and AWQ's activation-aware scale and clipping search (Lin et al. 2023).

All produce integer weights on one grid: w ~ (q - zero) * scale per group of `group_size`
consecutive inputs (-1: one group per row; when the size does not divide K the last group is
shorter), zero an integer, scale rounded to float16 — exactly what the AWQ and GPTQ checkpoint
layouts store, so what is measured here is what is served.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.quant.packed import default_g_idx


@dataclass
class QuantizedWeight:
    q: torch.Tensor        # (N, K) int64, 0..2^bits-1
    zeros: torch.Tensor    # (N, G) int64
    scales: torch.Tensor   # (N, G) float32 holding float16 values
    g_idx: torch.Tensor    # (K,) group of each input
    bits: int
    # the float values that were rounded: q = clamp(round(source / scale) + zero), column by column
    # (GPTQ: after the error feedback of the columns before). QAT's latent weights start here.
    source: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        out = self.q.float()
        step = torch.diff(self.g_idx)
        if bool((step >= 0).all()):  # contiguous groups: in place, group by group
            cuts = (torch.nonzero(step).flatten() + 1).tolist()
            for s, e in zip([0, *cuts], [*cuts, out.shape[1]]):
                g = int(self.g_idx[s])
                out[:, s:e].sub_(self.zeros[:, g:g + 1].float()).mul_(self.scales[:, g:g + 1])
            return out
        return (out - self.zeros.float()[:, self.g_idx]) * self.scales[:, self.g_idx]


def group_bounds(k: int, group_size: int) -> list[tuple[int, int]]:
    size = k if group_size == -1 else group_size
    return [(s, min(s + size, k)) for s in range(0, k, size)]


def grid(w: torch.Tensor, bits: int, sym: bool, clip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero per row of `w` (rows x group inputs); `clip` shrinks the range."""
    maxq = 2 ** bits - 1
    if sym:
        amax = w.abs().amax(dim=1) * (1 if clip is None else clip)
        scale = amax / ((maxq - 1) / 2)
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
        if clip is not None:
            lo, hi = lo * clip, hi * clip
        scale = (hi - lo) / maxq
    scale = scale.clamp(min=2 ** -20).half().float()  # the stored precision, and never 0
    if not sym:
        zero = (-lo / scale).round().clamp(0, maxq)
    return scale, zero


def quantize_cols(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return ((w / scale[:, None]).round() + zero[:, None]).clamp(0, 2 ** bits - 1)


def rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool = False,
        clip: torch.Tensor | None = None, keep_source: bool = True) -> QuantizedWeight:
    """Round-to-nearest; `clip` (N, G) optional range shrink factors per group. `keep_source`:
    record the rounded float values (QAT's start; a copy of the weight)."""
    given, w = w, w.float()
    n, k = w.shape
    bounds = group_bounds(k, group_size)
    q = torch.empty(n, k, dtype=torch.long)
    scales, zeros = torch.empty(n, len(bounds)), torch.empty(n, len(bounds))
    for g, (s, e) in enumerate(bounds):
        scales[:, g], zeros[:, g] = grid(w[:, s:e], bits, sym, None if clip is None else clip[:, g])
        q[:, s:e] = quantize_cols(w[:, s:e], scales[:, g], zeros[:, g], bits)
    # `source` must outlive the caller's tensor, which quantize writes the dequantized values into;
    # a search's temporary (AWQ's scaled candidates) needs no copy
    source = None if not keep_source else w.clone() if w is given else w
    return QuantizedWeight(q, zeros.long(), scales, default_g_idx(k, group_size), bits, source)


def gptq(w: torch.Tensor, xtx: torch.Tensor, bits: int, group_size: int, sym: bool = False,
         act_order: bool = False, damp: float = 0.01, shrink: float = 0.0, keep_source: bool = True) -> QuantizedWeight:
    """Quantize columns one at a time, spreading each column's rounding error over the columns not
    yet quantized through the Hessian H = X^T X of the layer's inputs (`_feedback`; lazy batch
    updates in blocks; group scales fixed when a group's first column is reached). `act_order` handles
    columns by decreasing activation energy first while the groups stay contiguous runs of
    inputs, their scales fixed from the weights before any error feedback (GPTQModel's "static
    groups"): `g_idx` stays the natural one, so every layout and kernel (and GGUF) holds it.
    `shrink` pulls H toward its diagonal, H' = (1 - shrink) H + shrink diag(H): the error feedback
    exploits the calibration inputs' correlations between channels, which another text does not
    share; with a diagonal H, GPTQ is RTN (benchmarks/quantize_ood.sh measures the trade)."""
    w = w.float().clone()
    n, k = w.shape
    h = xtx.float().clone()
    if shrink:
        h.mul_(1 - shrink).diagonal().add_(shrink * xtx.float().diagonal())
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    size = k if group_size == -1 else group_size
    num_groups = math.ceil(k / size)
    scales, zeros = torch.zeros(n, num_groups), torch.zeros(n, num_groups)
    static = act_order or group_size == -1
    if static:
        for g, (s, e) in enumerate(group_bounds(k, group_size)):
            scales[:, g], zeros[:, g] = grid(w[:, s:e], bits, sym)
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(k)
    group_of = perm // size  # the (static) group of each column in processing order
    back = perm.flip(0)  # H permuted and order-reversed at once: the copy `_feedback` damps and takes over
    w, h = w[:, perm], h[back][:, back]
    if not bool(torch.isfinite(h).all()):
        raise ValueError("the layer's inputs overflowed (non-finite X^T X); the model's activations are too large "
                         "for the calibration dtype: try --compute-dtype float32.")
    feed = _feedback(h, damp)
    # columns as rows (w transposed): a column's update is one contiguous row, the updates inside
    # a block are BLAS rank-1 updates on small sub-blocks, the rest matrix products
    orig = w.t().contiguous()
    wt = orig.clone()
    scales_t, zeros_t = scales.t().contiguous(), zeros.t().contiguous()
    qt = torch.zeros(k, n)
    source_t = torch.zeros(k, n) if keep_source else None
    block = size * max(1, 128 // size) if group_size != -1 else 128
    maxq = 2 ** bits - 1
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1 = wt[i1:i2], torch.zeros(i2 - i1, n)
        for j1 in range(0, i2 - i1, _SUB):
            j2 = min(j1 + _SUB, i2 - i1)
            for i in range(j1, j2):
                col = i1 + i
                g = int(group_of[col])
                if not static and col % size == 0:
                    scales_t[g], zeros_t[g] = grid(_compensated(orig, w1, feed, col, i, size).t(), bits, sym)
                row = w1[i]
                qc = (row / scales_t[g]).round_().add_(zeros_t[g]).clamp_(0, maxq)
                qt[col] = qc
                if source_t is not None:
                    source_t[col] = row
                err = torch.sub(orig[col], (qc - zeros_t[g]).mul_(scales_t[g]), out=err1[i])
                if i + 1 < j2:
                    w1[i + 1:j2].addr_(feed[col, col + 1:i1 + j2], err)
            if j2 < i2 - i1:
                w1[j2:].addmm_(feed[i1 + j1:i1 + j2, i1 + j2:i2].t(), err1[j1:j2])
        if i2 < k:
            wt[i2:].addmm_(feed[i1:i2, i2:].t(), err1)
    scales, zeros = scales_t.t().contiguous(), zeros_t.t().contiguous()
    q = qt.t().long()
    source = None if source_t is None else source_t.t().contiguous()
    inv = torch.argsort(perm)
    return QuantizedWeight(q if not act_order else q[:, inv], zeros.long(), scales, default_g_idx(k, group_size), bits,
                           None if source is None else source if not act_order else source[:, inv])


def _compensated(orig: torch.Tensor, w1: torch.Tensor, feed: torch.Tensor, col: int, i: int, size: int
                 ) -> torch.Tensor:
    """A group's values compensated for every column before it, which GPTQ's grid is drawn from
    when groups are not static (AutoGPTQ's values at the group's first column). The nearest-plane
    sums hold only part of that yet; the rest solves V_gg^T D = w_g - partial (unit triangular)."""
    e = min(col + size, feed.shape[0])
    part = w1[i:i + e - col]
    d = torch.linalg.solve_triangular(feed[col:e, col:e].t(), orig[col:e] - part, upper=False,
                                      unitriangular=True)
    return orig[col:e] - d


_SUB = 32  # GPTQ: columns per rank-1 sub-block inside a lazy-update block


def _feedback(flipped: torch.Tensor, damp: float) -> torch.Tensor:
    """GPTQ's error feedback without the inverse Hessian. With J the order reversal and
    `flipped` = J H J = L L^T (damped in place: the caller's scratch copy), the upper factor
    V = J L J has H = V^T V, and V^-1 is the upper Cholesky factor of H^-1 that AutoGPTQ gets from
    three factorizations; column j's value before rounding is w_j + sum_{i<j} (w_i - deq_i) V_ij /
    V_jj in the original weights w (the nearest-plane form of GPTQ): one factorization and no
    inverse. Returned with its columns divided by
    the diagonal. Float32, as AutoGPTQ (float64 doubles the time). H is damped by `damp` * its
    mean diagonal; rounding in the sums of X^T X can leave it a hair from positive definite on
    nearly collinear inputs, and the damping then grows 10x at a time up to the mean diagonal
    itself (GPTQModel's auto-increment) rather than fail."""
    diag = flipped.diagonal()
    mean, added = diag.mean(), 0.0
    while True:
        diag.add_(damp * mean - added)  # damped in place: `flipped` is the caller's scratch copy
        added = damp * mean
        lower, info = torch.linalg.cholesky_ex(flipped)
        if int(info) == 0:
            del flipped, diag
            v = lower.flip(0, 1)
            del lower
            return v.div_(v.diagonal().clone()[None, :])
        if damp >= 1.0:
            raise ValueError("the layer's input Hessian is not positive definite even with damping equal to its "
                             "mean diagonal; use more calibration samples.")
        damp = min(1.0, damp * 10)


def output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """Mean squared error of the layer's outputs on inputs x: what AWQ and GPTQ minimise."""
    return float(((x @ (w_hat - w).t()) ** 2).mean())


def hessian_error(w: torch.Tensor, w_hat: torch.Tensor, xtx: torch.Tensor, rows: int) -> float:
    """`output_error` over every calibration row at once from H = X^T X (rows of X: `rows`):
    mean((X dW^T)^2) = tr(dW H dW^T) / (rows * N). Costs N K^2 however many rows calibrated."""
    return _trace_error(w_hat.float() - w.float(), xtx, rows)


def _trace_error(d: torch.Tensor, xtx: torch.Tensor, rows: int) -> float:
    """tr(d H d^T) / (rows * N), in H's dtype (bfloat16 products and elementwise terms where the
    searches run in it, each rounding unbiased; the sum in float32)."""
    d = d.to(xtx.dtype)
    return float((d @ xtx).mul_(d).sum(dtype=torch.float32)) / (rows * d.shape[0])


def _even_runs(k: int, group_size: int) -> list[tuple[int, int, int, slice]]:
    """(start, end, width, groups) of the runs of equally wide groups: the full groups, then the
    shorter last one if the size does not divide k; each run reshapes to (N, groups, width)."""
    size = k if group_size == -1 else group_size
    full = k // size
    return [(0, full * size, size, slice(0, full))] + ([(full * size, k, k - full * size, slice(full, full + 1))]
                                                        if k % size else [])


def fake_quant(w: torch.Tensor, bits: int, group_size: int, clip: torch.Tensor | None = None) -> torch.Tensor:
    """`rtn(...).dequantize()` for every group at once (the searches' inner loop): asymmetric,
    `clip` (N, G) shrinking each group's range. One new tensor, the rest in place."""
    n, k = w.shape
    maxq = 2 ** bits - 1
    runs = _even_runs(k, group_size)
    out = torch.empty(n, k) if len(runs) > 1 else None
    for s, e, width, groups in runs:
        wg = w[:, s:e].float().reshape(n, -1, width)
        lo, hi = torch.aminmax(wg, dim=-1)
        lo, hi = lo.clamp_(max=0), hi.clamp_(min=0)
        if clip is not None:
            lo, hi = lo.mul_(clip[:, groups]), hi.mul_(clip[:, groups])
        scale = hi.sub_(lo).div_(maxq).clamp_(min=2 ** -20).half().float()[..., None]
        zero = lo[..., None].div(scale).neg_().round_().clamp_(0, maxq)
        q = torch.div(wg, scale).round_().add_(zero).clamp_(0, maxq).sub_(zero).mul_(scale).reshape(n, e - s)
        if out is None:
            return q
        out[:, s:e] = q
    return out


def awq_scales(w: torch.Tensor, xtx: torch.Tensor, x_mag: torch.Tensor, rows: int, bits: int, group_size: int,
               steps: int = 20) -> tuple[torch.Tensor, float, float]:
    """Search per-input-channel scales s = mean|x|^a (normalised), a in [0, 1): quantize W*diag(s)
    and run it on x/s, the error measured on every calibration row through H = X^T X. a = 0 is
    plain RTN and is always a candidate, so the chosen loss is never above RTN's. Returns
    (s, loss of RTN, loss with s)."""
    w = w.float()
    x_mag = x_mag.float().clamp(min=1e-8)
    best = (torch.ones(w.shape[1]), float("inf"))
    rtn_loss = float("nan")
    for i in range(steps):
        s = x_mag.pow(i / steps)
        s = s / (s.max() * s.min()).sqrt()
        loss = _trace_error(fake_quant(w * s, bits, group_size).div_(s).sub_(w), xtx, rows)
        if i == 0:
            rtn_loss = loss
        if loss < best[1]:
            best = (s, loss)
    return best[0], rtn_loss, best[1]


def awq_clip(w: torch.Tensor, xtx: torch.Tensor, bits: int, group_size: int, steps: int = 20,
             max_shrink: float = 0.5) -> torch.Tensor:
    """Per (row, group) range shrink factor in [1 - max_shrink, 1] minimising the row's output
    error tr(dW H dW^T) when that group alone changes from plain rounding: its own block
    d_g H_gg d_g^T plus twice its cross term with the other groups' rounding errors. Clipping
    errors are not zero-mean like rounding errors: on inputs with a large mean (massive
    activations) a group-alone objective let them add up across groups. Then, per row, the
    clipped row is kept only where its whole error is below plain rounding's. Factor 1 (no
    clipping) is a candidate. All groups of a width at once (a batched product). Returns (N, G)."""
    w = w.float()
    n, k = w.shape
    best = torch.ones(n, len(group_bounds(k, group_size)))
    e0 = fake_quant(w, bits, group_size).sub_(w).to(xtx.dtype)              # rounding errors (N, K)
    e0h = e0 @ xtx                                                            # (N, K)
    for s, e, width, groups in _even_runs(k, group_size):
        gcount = (e - s) // width
        hb = torch.stack([xtx[s + g * width:s + (g + 1) * width, s + g * width:s + (g + 1) * width]
                          for g in range(gcount)])                                   # (G, gs, gs)
        own = e0[:, s:e].reshape(n, gcount, width).transpose(0, 1)                   # (G, N, gs)
        cross = e0h[:, s:e].reshape(n, gcount, width).transpose(0, 1) - torch.bmm(own, hb)  # the others' share
        wg = w[:, s:e]
        best_err = torch.full((n, gcount), float("inf"))
        for i in range(steps):
            f = torch.full((n, gcount), 1.0 - max_shrink * i / steps)
            d = fake_quant(wg, bits, width, f).sub_(wg).reshape(n, gcount, width).transpose(0, 1).to(hb.dtype)
            err = (torch.bmm(d, hb).add_(cross, alpha=2)).mul_(d).sum(-1, dtype=torch.float32).t()   # (N, G)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best[:, groups] = torch.where(better, f, best[:, groups])
    clipped = fake_quant(w, bits, group_size, best).sub_(w).to(xtx.dtype)
    worse = (clipped @ xtx).mul_(clipped).sum(-1, dtype=torch.float32) >= e0h.mul(e0).sum(-1, dtype=torch.float32)
    best[worse] = 1.0
    return best

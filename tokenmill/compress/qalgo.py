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
    yet quantized through the inverse Hessian H = X^T X of the layer's inputs (lazy batch updates
    in blocks; group scales fixed when a group's first column is reached). `act_order` handles
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
    w, h = w[:, perm], h[perm][:, perm]
    if not bool(torch.isfinite(h).all()):
        raise ValueError("the layer's inputs overflowed (non-finite X^T X); the model's activations are too large "
                         "for the calibration dtype: try --compute-dtype float32.")
    hinv = _inverse_cholesky(h, damp)
    block = size * max(1, 128 // size) if group_size != -1 else 128
    q = torch.zeros(n, k, dtype=torch.long)
    source = torch.zeros(n, k) if keep_source else None
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros(n, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = int(group_of[col])
            if not static and col % size == 0:
                scales[:, g], zeros[:, g] = grid(w1[:, i:i + size], bits, sym)
            qc = quantize_cols(w1[:, i:i + 1], scales[:, g], zeros[:, g], bits)[:, 0]
            q[:, col] = qc.long()
            if source is not None:
                source[:, col] = w1[:, i]
            err = (w1[:, i] - (qc - zeros[:, g]) * scales[:, g]) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    return QuantizedWeight(q if not act_order else q[:, inv], zeros.long(), scales, default_g_idx(k, group_size), bits,
                           None if source is None else source if not act_order else source[:, inv])


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, in float32 (as AutoGPTQ; float64
    doubles the time of an 8192-input layer's factorizations). Rounding in the sums of X^T X can
    leave H a hair from positive definite on nearly collinear inputs; the damping then grows 10x
    at a time up to the mean diagonal itself (GPTQModel's auto-increment) rather than fail."""
    k, mean = h.shape[0], torch.diagonal(h).mean()
    while True:
        try:
            damped = h + damp * mean * torch.eye(k, dtype=h.dtype)
            return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True).float()
        except torch.linalg.LinAlgError:
            if damp >= 1.0:
                raise ValueError("the layer's input Hessian is not positive definite even with damping equal to its "
                                 "mean diagonal; use more calibration samples.") from None
            damp = min(1.0, damp * 10)


def output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """Mean squared error of the layer's outputs on inputs x: what AWQ and GPTQ minimise."""
    return float(((x @ (w_hat - w).t()) ** 2).mean())


def hessian_error(w: torch.Tensor, w_hat: torch.Tensor, xtx: torch.Tensor, rows: int) -> float:
    """`output_error` over every calibration row at once from H = X^T X (rows of X: `rows`):
    mean((X dW^T)^2) = tr(dW H dW^T) / (rows * N). Costs N K^2 however many rows calibrated;
    `xtx` may be bfloat16 (the product's sums stay float32 up to its rounding)."""
    d = w_hat.float() - w.float()
    return float(((d.to(xtx.dtype) @ xtx).float() * d).sum()) / (rows * w.shape[0])


def _even_runs(k: int, group_size: int) -> list[tuple[int, int, int, slice]]:
    """(start, end, width, groups) of the runs of equally wide groups: the full groups, then the
    shorter last one if the size does not divide k; each run reshapes to (N, groups, width)."""
    size = k if group_size == -1 else group_size
    full = k // size
    return [(0, full * size, size, slice(0, full))] + ([(full * size, k, k - full * size, slice(full, full + 1))]
                                                        if k % size else [])


def fake_quant(w: torch.Tensor, bits: int, group_size: int, clip: torch.Tensor | None = None) -> torch.Tensor:
    """`rtn(...).dequantize()` for every group at once (the searches' inner loop): asymmetric,
    `clip` (N, G) shrinking each group's range."""
    n, k = w.shape
    maxq = 2 ** bits - 1
    out = torch.empty(n, k)
    for s, e, width, groups in _even_runs(k, group_size):
        wg = w[:, s:e].float().reshape(n, -1, width)
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        if clip is not None:
            lo, hi = lo * clip[:, groups], hi * clip[:, groups]
        scale = ((hi - lo) / maxq).clamp(min=2 ** -20).half().float()[..., None]
        zero = (-lo[..., None] / scale).round().clamp(0, maxq)
        q = ((wg / scale).round() + zero).clamp(0, maxq)
        out[:, s:e] = ((q - zero) * scale).reshape(n, e - s)
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
        loss = hessian_error(w, fake_quant(w * s, bits, group_size) / s, xtx, rows)
        if i == 0:
            rtn_loss = loss
        if loss < best[1]:
            best = (s, loss)
    return best[0], rtn_loss, best[1]


def awq_clip(w: torch.Tensor, xtx: torch.Tensor, bits: int, group_size: int, steps: int = 20,
             max_shrink: float = 0.5) -> torch.Tensor:
    """Per (row, group) range shrink factor in [1 - max_shrink, 1] minimising that group's share
    of the output error, tr(dW_g H_gg dW_g^T) with H_gg the group's diagonal block of X^T X; factor
    1 (no clipping) is a candidate. All groups of a width at once (a batched product). Returns (N, G)."""
    w = w.float()
    n, k = w.shape
    best = torch.ones(n, len(group_bounds(k, group_size)))
    for s, e, width, groups in _even_runs(k, group_size):
        gcount = (e - s) // width
        hb = torch.stack([xtx[s + g * width:s + (g + 1) * width, s + g * width:s + (g + 1) * width]
                          for g in range(gcount)])                                   # (G, gs, gs)
        wg = w[:, s:e]
        best_err = torch.full((n, gcount), float("inf"))
        for i in range(steps):
            f = torch.full((n, gcount), 1.0 - max_shrink * i / steps)
            d = (fake_quant(wg, bits, width, f) - wg).reshape(n, gcount, width)
            err = ((torch.bmm(d.transpose(0, 1).to(hb.dtype), hb).float().transpose(0, 1)) * d).sum(-1)  # (N, G)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best[:, groups] = torch.where(better, f, best[:, groups])
    return best

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
        return (self.q.float() - self.zeros.float()[:, self.g_idx]) * self.scales[:, self.g_idx]


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
        clip: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest; `clip` (N, G) optional range shrink factors per group."""
    given, w = w, w.float()
    n, k = w.shape
    bounds = group_bounds(k, group_size)
    q = torch.empty(n, k)
    scales, zeros = torch.empty(n, len(bounds)), torch.empty(n, len(bounds))
    for g, (s, e) in enumerate(bounds):
        scales[:, g], zeros[:, g] = grid(w[:, s:e], bits, sym, None if clip is None else clip[:, g])
        q[:, s:e] = quantize_cols(w[:, s:e], scales[:, g], zeros[:, g], bits)
    # `source` must outlive the caller's tensor, which quantize writes the dequantized values into;
    # a search's temporary (AWQ's scaled candidates) needs no copy
    source = w.clone() if w is given else w
    return QuantizedWeight(q.long(), zeros.long(), scales, default_g_idx(k, group_size), bits, source)


def gptq(w: torch.Tensor, xtx: torch.Tensor, bits: int, group_size: int, sym: bool = False,
         act_order: bool = False, damp: float = 0.01) -> QuantizedWeight:
    """Quantize columns one at a time, spreading each column's rounding error over the columns not
    yet quantized through the inverse Hessian H = X^T X of the layer's inputs (lazy batch updates
    in blocks; group scales fixed when a group's first column is reached). `act_order` handles
    columns by decreasing activation energy first; groups are then formed in that order and
    `g_idx` records them."""
    w = w.float().clone()
    n, k = w.shape
    h = xtx.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    try:
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    except torch.linalg.LinAlgError:
        raise ValueError("the layer's input Hessian is not positive definite even after damping; "
                         "raise --damp or use more calibration samples.") from None
    size = k if group_size == -1 else group_size
    block = size * max(1, 128 // size) if group_size != -1 else 128
    num_groups = math.ceil(k / size)
    q, source = torch.zeros(n, k), torch.zeros(n, k)
    scales, zeros = torch.zeros(n, num_groups), torch.zeros(n, num_groups)
    if group_size == -1:
        scales[:, 0], zeros[:, 0] = grid(w, bits, sym)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros(n, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = col // size
            if group_size != -1 and col % size == 0:
                scales[:, g], zeros[:, g] = grid(w1[:, i:i + size], bits, sym)
            qc = quantize_cols(w1[:, i:i + 1], scales[:, g], zeros[:, g], bits)[:, 0]
            q[:, col], source[:, col] = qc, w1[:, i]
            err = (w1[:, i] - (qc - zeros[:, g]) * scales[:, g]) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    g_idx = (torch.arange(k) // size)[inv]
    return QuantizedWeight(q[:, inv].long(), zeros.long(), scales, g_idx, bits, source[:, inv])


def output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """Mean squared error of the layer's outputs on inputs x: what AWQ and GPTQ minimise."""
    return float(((x @ (w_hat - w).t()) ** 2).mean())


def awq_scales(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, steps: int = 20,
               ) -> tuple[torch.Tensor, float, float]:
    """Search per-input-channel scales s = mean|x|^a (normalised), a in [0, 1): quantize W*diag(s)
    and run it on x/s. a = 0 is plain RTN and is always a candidate, so the chosen loss is never
    above RTN's. Returns (s, loss of RTN, loss with s)."""
    w = w.float()
    x_mag = x.abs().mean(0).clamp(min=1e-8)
    best = (torch.ones(w.shape[1]), float("inf"))
    rtn_loss = float("nan")
    for i in range(steps):
        a = i / steps
        s = x_mag.pow(a)
        s = s / (s.max() * s.min()).sqrt()
        w_hat = rtn(w * s, bits, group_size).dequantize() / s
        loss = output_error(w, w_hat, x)
        if i == 0:
            rtn_loss = loss
        if loss < best[1]:
            best = (s, loss)
    return best[0], rtn_loss, best[1]


def awq_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, steps: int = 20,
             max_shrink: float = 0.5, rows_per_chunk: int = 256) -> torch.Tensor:
    """Per (row, group) range shrink factor in [1 - max_shrink, 1] minimising that group's share
    of the output error on x; factor 1 (no clipping) is a candidate. Returns (N, G)."""
    w = w.float()
    n, k = w.shape
    bounds = group_bounds(k, group_size)
    best = torch.ones(n, len(bounds))
    for g, (s, e) in enumerate(bounds):
        xg = x[:, s:e]                                           # (T, gs)
        for r0 in range(0, n, rows_per_chunk):
            wg = w[r0:r0 + rows_per_chunk, s:e]                  # (R, gs)
            ref = xg @ wg.t()                                    # (T, R)
            best_err = torch.full((wg.shape[0],), float("inf"))
            for i in range(steps):
                f = 1.0 - max_shrink * i / steps
                clip = torch.full((wg.shape[0],), f)
                scale, zero = grid(wg, bits, False, clip)
                wq = (quantize_cols(wg, scale, zero, bits) - zero[:, None]) * scale[:, None]
                err = ((xg @ wq.t() - ref) ** 2).mean(0)
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best[r0:r0 + rows_per_chunk, g] = torch.where(better, clip, best[r0:r0 + rows_per_chunk, g])
    return best

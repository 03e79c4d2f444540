"""GGUF K-quants kept at their own bit width: Q4_K and Q6_K blocks decoded into tokenmill's 16-row
panels without rounding anything (kernels: Q4KPanels, Q6KPanels), multiplied by the dot kernels.

Why a transcoding and not the file's bytes as they are: a GGUF row is a run of 256-weight
super-blocks, one output at a time; the kernels want 16 outputs side by side per load, each input's
weights next to each other. The transcoding moves bits, never values: the weights multiplied are
exactly `gguf.quants.dequantize`'s (each scale is float16 times a small integer, exact in
float32), in 0.578 (Q4_K, file 0.5625) and 0.8203 (Q6_K, the file's own) bytes per weight.

    Q4_K super-block, 144 bytes: d, dmin (float16) | 12 bytes of 6-bit sc, mn for 8 groups of 32 |
          128 bytes of nibbles (byte 32c + j: weight 64c + j low, 64c + 32 + j high)
          w = d sc q - dmin mn
    Q6_K super-block, 210 bytes: 128 bytes of low nibbles | 64 of 2-bit highs | 16 int8 sc per 16
          weights | d (float16);  w = d sc (q - 32)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill import kernels

KINDS = ("Q4_K", "Q6_K")
PACK_ROWS = 2048  # rows decoded and packed per step (a multiple of the 16-row panels)


@dataclass
class KQuantWeight:
    kind: str
    out_features: int
    in_features: int
    panels: kernels.Q4KPanels | kernels.Q6KPanels


def decode_q4k(raw: np.ndarray) -> tuple[torch.Tensor, ...]:
    """uint8 (N, K/256 * 144) -> q (N, K) 0..15, sc, mn (N, K/32) 0..63, d, dmin (N, K/256) float16."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0]
    s = b[..., 4:16]                                                   # (N, SB, 12)
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 2) & 48)], axis=-1)   # (N, SB, 8)
    mn = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], axis=-1)
    qs = b[..., 16:].reshape(n, -1, 4, 1, 32)                         # (N, SB, chunk, 1, 32)
    q = (qs >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15  # (N, SB, chunk, nibble, 32)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).reshape(n, -1) for a in (q, sc, mn, d, dmin))


def decode_q6k(raw: np.ndarray) -> tuple[torch.Tensor, ...]:
    """uint8 (N, K/256 * 210) -> q (N, K) 0..63, sc (N, K/16) int8, d (N, K/256) float16."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 210)
    ql = b[..., :128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    q = (ql & 15).reshape(n, -1, 2, 128) | ((qh & 3).reshape(n, -1, 2, 128) << 4)
    sc = b[..., 192:208].copy().view(np.int8)
    d = b[..., 208:210].copy().view(np.float16)[..., 0]
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).reshape(n, -1) for a in (q, sc, d))


def supported(kind: str, rows: int, cols: int) -> bool:
    """Whether a tensor of this type and shape runs on the K-quant kernels here."""
    return kind in KINDS and cols % 256 == 0 and rows % kernels.LANES == 0 and kernels.dot_layout()


def from_blocks(kind: str, rows: int, cols: int, read) -> KQuantWeight:
    """`read(start, stop)` -> uint8 raw rows; packed PACK_ROWS rows at a time into panels
    allocated once (a 128k-row Q6_K output head never exists decoded whole)."""
    p, lanes = (rows + kernels.LANES - 1) // kernels.LANES, kernels.LANES
    if kind == "Q4_K":
        shapes = [((p, cols // 8, 64), torch.uint8), ((p, cols // 32, 32), torch.uint8), ((p, cols // 256, 32), torch.half)]
        decode, pack = decode_q4k, kernels.pack_q4k
    else:
        shapes = [((p, cols // 8, 64), torch.uint8), ((p, cols // 32, 128), torch.uint8), ((p, cols // 16, 16), torch.int8),
                  ((p, cols // 256, 16), torch.half)]
        decode, pack = decode_q6k, kernels.pack_q6k
    out = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
    for r0 in range(0, rows, PACK_ROWS):
        r1 = min(r0 + PACK_ROWS, rows)
        for dst, src in zip(out, pack(*decode(read(r0, r1)))):
            dst[r0 // lanes:(r1 + lanes - 1) // lanes] = src
    panels = kernels.Q4KPanels(*out, rows) if kind == "Q4_K" else kernels.Q6KPanels(*out, rows)
    return KQuantWeight(kind, rows, cols, panels)


def cat(parts: list[KQuantWeight]) -> KQuantWeight:
    """Shards of one kind stacked by rows (each a whole number of panels)."""
    first = parts[0]
    names = [f for f in vars(first.panels) if isinstance(getattr(first.panels, f), torch.Tensor)]
    tensors = [torch.cat([getattr(w.panels, f) for w in parts]) for f in names]
    rows = sum(w.out_features for w in parts)
    panels = type(first.panels)(*tensors, rows)
    return KQuantWeight(first.kind, rows, first.in_features, panels)


def matmul(x: torch.Tensor, w: KQuantWeight, partial: bool = False) -> torch.Tensor:
    """x (..., K) -> (..., N) in x's dtype (`partial`: float64 sums, as int4.matmul)."""
    fn = kernels.q4k_linear if w.kind == "Q4_K" else kernels.q6k_linear
    y = fn(x.float(), w.panels, partial)
    return y if partial else y.to(x.dtype)


def dequantize_raw(kind: str, raw: np.ndarray) -> torch.Tensor:
    """The float32 weights of raw rows, from the decoded integers (what the kernels multiply)."""
    if kind == "Q4_K":
        q, sc, mn, d, dmin = decode_q4k(raw)
        n, k = q.shape
        s = (d.float().repeat_interleave(8, dim=1) * sc.float()).repeat_interleave(32, dim=1)
        m = (dmin.float().repeat_interleave(8, dim=1) * mn.float()).repeat_interleave(32, dim=1)
        return q.float() * s - m
    q, sc, d = decode_q6k(raw)
    s = (d.float().repeat_interleave(16, dim=1) * sc.float()).repeat_interleave(16, dim=1)
    return s * (q.float() - 32)

"""GGUF K-quants kept at their own bit width: Q4_K and Q6_K blocks transcoded into tokenmill's 16-row
panels without rounding anything (kernels: Q4KPanels, Q6KPanels; kquant.cpp q4k_pack, q6k_pack),
multiplied by the dot kernels.

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
from tokenmill.utils import huge_page_zeros

KINDS = ("Q4_K", "Q6_K")
PACK_ROWS = 2048  # rows decoded and packed per step (a multiple of the 16-row panels)


@dataclass
class KQuantWeight:
    kind: str
    out_features: int
    in_features: int
    panels: kernels.Q4KPanels | kernels.Q6KPanels


def supported(kind: str, rows: int, cols: int) -> bool:
    """Whether a tensor of this type and shape runs on the K-quant kernels here."""
    return kind in KINDS and cols % 256 == 0 and rows % kernels.LANES == 0 and kernels.dot_layout()


def empty(kind: str, rows: int, cols: int) -> KQuantWeight:
    """Panels for `rows` outputs, to be filled (`fill`) a shard or a run of rows at a time."""
    p = (rows + kernels.LANES - 1) // kernels.LANES
    if kind == "Q4_K":
        shapes = [((p, cols // 8, 64), torch.uint8), ((p, cols // 32, 32), torch.uint8), ((p, cols // 256, 32), torch.half)]
    else:
        shapes = [((p, cols // 8, 64), torch.uint8), ((p, cols // 32, 128), torch.uint8), ((p, cols // 16, 16), torch.int8),
                  ((p, cols // 256, 16), torch.half)]
    out = [huge_page_zeros(shape, dtype) for shape, dtype in shapes]
    panels = kernels.Q4KPanels(*out, rows) if kind == "Q4_K" else kernels.Q6KPanels(*out, rows)
    return KQuantWeight(kind, rows, cols, panels)


def fill(w: KQuantWeight, start: int, rows: int, read) -> None:
    """Rows [start, start + rows) of `w` (start a multiple of 16) from `read(a, b)` -> uint8 raw
    rows a..b of the source, PACK_ROWS at a time: the kernel writes the panels in place."""
    pack = torch.ops.tokenmill.q4k_pack if w.kind == "Q4_K" else torch.ops.tokenmill.q6k_pack
    tensors = [t for t in vars(w.panels).values() if isinstance(t, torch.Tensor)]
    for r0 in range(0, rows, PACK_ROWS):
        pack(torch.from_numpy(np.ascontiguousarray(read(r0, min(r0 + PACK_ROWS, rows)))), *tensors, start + r0)


def from_blocks(kind: str, rows: int, cols: int, read) -> KQuantWeight:
    """A whole weight from `read` (see `fill`): a 128k-row Q6_K output head never exists decoded."""
    w = empty(kind, rows, cols)
    fill(w, 0, rows, read)
    return w


def rows_of(w: KQuantWeight, start: int, count: int) -> KQuantWeight:
    """Rows [start, start + count) (whole panels) as a weight of their own, copied out."""
    lanes = kernels.LANES
    tensors = []
    for t in vars(w.panels).values():
        if isinstance(t, torch.Tensor):
            part = t[start // lanes:(start + count + lanes - 1) // lanes]
            tensors.append(huge_page_zeros(tuple(part.shape), part.dtype).copy_(part))
    return KQuantWeight(w.kind, count, w.in_features, type(w.panels)(*tensors, count))


def matmul(x: torch.Tensor, w: KQuantWeight, partial: bool = False) -> torch.Tensor:
    """x (..., K) -> (..., N) in x's dtype (`partial`: float64 sums, as int4.matmul)."""
    fn = kernels.q4k_linear if w.kind == "Q4_K" else kernels.q6k_linear
    y = fn(x.float(), w.panels, partial)
    return y if partial else y.to(x.dtype)

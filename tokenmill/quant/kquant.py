"""GGUF block types kept at their own width: each tensor's blocks transcoded into the 16-row panels
of one of the dot kernels, without rounding anything (the weights multiplied are exactly
`gguf.quants.dequantize`'s: every scale is a float16, a float16 times a small integer, or a power
of two, all exact in float32). Q4_0/Q4_1 take the int4 path of `Linear` (quant/int4.py).

Why a transcoding and not the file's bytes as they are: a GGUF row is a run of blocks, one output
at a time; the kernels want 16 outputs side by side per load, each input's weights next to each
other. The transcoding moves bits, never values.

    kind            panels (kernels/)            bytes per weight (file)
    Q4_K            Q4KPanels                    0.578  (0.5625)
    Q5_K            Q4KPanels + fifth bits       0.703  (0.6875)
    Q6_K            Q6KPanels                    0.820  (0.8203)
    Q3_K            Q23KPanels + third bits      0.445  (0.4297)
    Q2_K            Q23KPanels                   0.328  (0.3281)
    Q5_0, Q5_1      Int4Panels + fifth bits      0.6875, 0.750  (0.6875, 0.75): Q5_0 symmetric, no minimums
    Q8_0            Int8Panels, block scales     1.0625 (1.0625)
    IQ4_NL          LutPanels                    0.5625 (0.5625)
    IQ4_XS          LutPanels                    0.539  (0.531)
    MXFP4           LutPanels                    0.531  (0.531)

Q6_K, Q3_K and Q2_K share kquant.cpp's tiles for 16-input sub-blocks (Q2_K's minimum per 16 is
its scale's twin there); kquant.cpp also moves their bits (q6k_pack, q3k_pack, q2k_pack).

    Q4_K super-block, 144 bytes: d, dmin (float16) | 12 bytes of 6-bit sc, mn for 8 groups of 32 |
          128 bytes of nibbles (byte 32c + j: weight 64c + j low, 64c + 32 + j high)
          w = d sc q - dmin mn          (Q5_K, 176 bytes: 32 bytes of fifth bits before the nibbles)
    Q6_K super-block, 210 bytes: 128 bytes of low nibbles | 64 of 2-bit highs | 16 int8 sc per 16
          weights | d (float16);  w = d sc (q - 32)
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill import kernels
from tokenmill.quant import gguf_blocks
from tokenmill.quant.base import QuantWeight
from tokenmill.utils import huge_page_zeros

SUPER = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")  # 256-weight super-blocks
KINDS = (*SUPER, *gguf_blocks.FIVE_BIT, "Q8_0", *gguf_blocks.LOOKUP)
# bytes per weight of each kind's panels (the table above): what the memory check counts
PACKED_BYTES = {"Q4_K": 0.578, "Q5_K": 0.703, "Q6_K": 0.820, "Q3_K": 0.445, "Q2_K": 0.328, "Q5_0": 0.6875, "Q5_1": 0.75,
                "Q8_0": 1.0625, "IQ4_NL": 0.5625, "IQ4_XS": 0.539, "MXFP4": 0.531}
PACK_ROWS = 2048  # rows decoded and packed per step (a multiple of the 16-row panels)

Panels = kernels.Q4KPanels | kernels.Q6KPanels | kernels.Q23KPanels | kernels.Int4Panels | kernels.Int8Panels | kernels.LutPanels


@dataclass
class KQuantWeight(QuantWeight):
    """A GGUF block type at its own width: always on the panels (`supported` needs the kernels)."""
    kind: str
    out_features: int
    in_features: int
    panels: Panels

    @property
    def reduction_unit(self) -> int:
        return unit(self.kind)


def supported(kind: str, rows: int, cols: int) -> bool:
    """Whether a tensor of this type and shape runs at its own width here."""
    block = 256 if kind in SUPER or kind == "IQ4_XS" else 32
    return kind in KINDS and cols % block == 0 and rows % kernels.LANES == 0 and kernels.dot_layout()


def unit(kind: str) -> int:
    """The inputs a kernel's partial sums must keep whole (`Linear.reduction_segment`)."""
    return 256 if kind in SUPER else 32


def empty(kind: str, rows: int, cols: int) -> KQuantWeight:
    """Panels for `rows` outputs, to be filled (`fill`) a shard or a run of rows at a time."""
    p = (rows + kernels.LANES - 1) // kernels.LANES
    z = huge_page_zeros
    if kind in ("Q4_K", "Q5_K"):
        panels = kernels.Q4KPanels(z((p, cols // 8, 64), torch.uint8), z((p, cols // 32, 32), torch.uint8),
                                   z((p, cols // 256, 32), torch.half), rows,
                                   qh=z((p, cols // 32, 64), torch.uint8) if kind == "Q5_K" else None)
    elif kind in ("Q3_K", "Q2_K"):
        three = kind == "Q3_K"
        panels = kernels.Q23KPanels(z((p, cols // 16, 64), torch.uint8), z((p, cols // 16, 16), torch.int8 if three else torch.uint8),
                                    z((p, cols // 256, 16 if three else 32), torch.half), rows,
                                    hb=z((p, cols // 32, 64), torch.uint8) if three else None)
    elif kind == "Q6_K":
        panels = kernels.Q6KPanels(z((p, cols // 8, 64), torch.uint8), z((p, cols // 32, 128), torch.uint8),
                                   z((p, cols // 16, 16), torch.int8), z((p, cols // 256, 16), torch.half), rows)
    elif kind in gguf_blocks.FIVE_BIT:
        g = cols // gguf_blocks.GROUP
        minimum = z((p, g, 16), torch.half) if kind == "Q5_1" else None  # Q5_0 is symmetric: m = -16 s in the kernel
        panels = kernels.Int4Panels(z((p, cols // 8, 64), torch.uint8), z((p, g, 16), torch.half), minimum,
                                    rows, dot=True, qh=z((p, cols // 32, 64), torch.uint8))
    elif kind in gguf_blocks.LOOKUP:
        sdtype = {"IQ4_NL": torch.half, "IQ4_XS": torch.int8, "MXFP4": torch.uint8}[kind]
        panels = kernels.LutPanels(z((p, cols // 8, 64), torch.uint8), z((p, cols // 32, 16), sdtype), rows,
                                   d=z((p, cols // 256, 16), torch.half) if kind == "IQ4_XS" else None)
    else:
        panels = kernels.Int8Panels(z((p, cols // 4, 64), torch.uint8), z((p, cols // 32, 16), torch.half), rows, dot=True)
    return KQuantWeight(kind, rows, cols, panels)


def fill(w: KQuantWeight, start: int, rows: int, read) -> None:
    """Rows [start, start + rows) of `w` (start a multiple of 16) from `read(a, b)` -> uint8 raw
    rows a..b of the source, PACK_ROWS at a time, written into the panels in place."""
    for r0 in range(0, rows, PACK_ROWS):
        _pack(w, np.ascontiguousarray(read(r0, min(r0 + PACK_ROWS, rows))), start + r0)


def _source(raw: np.ndarray) -> torch.Tensor:
    """The raw rows as a tensor the packing kernels only read (a memory-mapped table is read-only)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(raw)


def _pack(w: KQuantWeight, raw: np.ndarray, row0: int) -> None:
    p, kind = w.panels, w.kind
    if kind == "Q4_K":
        return torch.ops.tokenmill.q4k_pack(_source(raw), p.q, p.sm, p.dd, row0)
    if kind == "Q5_K":
        return torch.ops.tokenmill.q5k_pack(_source(raw), p.q, p.sm, p.dd, p.qh, row0)
    if kind == "Q6_K":
        return torch.ops.tokenmill.q6k_pack(_source(raw), p.ql, p.qh, p.sc, p.d, row0)
    if kind == "Q3_K":
        return torch.ops.tokenmill.q3k_pack(_source(raw), p.q2, p.sc, p.d, p.hb, row0)
    if kind == "Q2_K":
        return torch.ops.tokenmill.q2k_pack(_source(raw), p.q2, p.sc, p.d, row0)
    at = slice(row0 // kernels.LANES, (row0 + raw.shape[0] + kernels.LANES - 1) // kernels.LANES)
    if kind in gguf_blocks.FIVE_BIT:
        q, scale, minimum = gguf_blocks.decode(raw, kind, w.in_features)
        p.q[at], p.qh[at] = kernels.int4_dot_panels(q), kernels.fifth_bit_panels(q)
        p.s[at] = kernels.per_panel(scale)
        if p.m is not None:
            p.m[at] = kernels.per_panel(minimum)
    elif kind in gguf_blocks.LOOKUP:
        q, scale, d = gguf_blocks.decode_lut(raw, kind, w.in_features)
        p.q[at], p.s[at] = kernels.int4_dot_panels(q), kernels.per_panel(scale).to(p.s.dtype)
        if d is not None:
            p.d[at] = kernels.per_panel(d).half()
    else:
        q, d = gguf_blocks.decode_q8_0(raw, w.in_features)
        p.q[at], p.s[at] = kernels.int8_dot_panels(q), kernels.per_panel(d).half()


def from_blocks(kind: str, rows: int, cols: int, read) -> KQuantWeight:
    """A whole weight from `read` (see `fill`): a 128k-row Q6_K output head never exists decoded."""
    w = empty(kind, rows, cols)
    fill(w, 0, rows, read)
    return w


def rows_of(w: KQuantWeight, start: int, count: int) -> KQuantWeight:
    """Rows [start, start + count) (whole panels) as a weight of their own, copied out."""
    lanes = kernels.LANES
    parts = {}
    for name, t in w.panels.tensors().items():
        part = t[start // lanes:(start + count + lanes - 1) // lanes]
        parts[name] = huge_page_zeros(tuple(part.shape), part.dtype).copy_(part)
    return KQuantWeight(w.kind, count, w.in_features, dataclasses.replace(w.panels, out_features=count, **parts))

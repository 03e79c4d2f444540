"""The kernels' weight layouts: 16-row panels of each weight format (byte layouts: linear.cpp,
kquant.cpp, lut.cpp), the products that read them, and what the native decode stack is handed.

Every panel class answers the same three questions, so nothing above the kernels branches on
layouts: `linear(x)` (the product), `stack_args()` (stack.cpp's kind and its four tensors),
`nbytes()` (what a product reads). Packing lives in `tokenmill.kernels` (it depends on the loaded
variant's layout); the pure rearrangements of integers into panels are here.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

LANES = 16  # output rows per panel: one AVX-512 register (two AVX2 ones) of float32
PACK_ROWS = 2048  # rows packed per step: a layer's conversion holds a few bytes per weight of this many rows


class StackKind(enum.IntEnum):
    """stack.cpp's `Kind`: which product a projection of the native decode stack runs."""
    FLOAT = 0
    INT4 = 1
    INT8 = 2
    INT4_DOT = 3
    INT8_DOT = 4
    Q4K = 5
    Q6K = 6
    STACK = 7  # parts of different kinds stacked by output rows, each added with add_part
    LUT = 8
    Q23K = 9


# Products on AMX tiles (amx.cpp, the `amx` variant; VDPBF16PS on the `avx512bf16` one), bfloat16
# activations against weights decoded per tile: decoding costs per weight and per call whatever the
# rows, the integer kernels' cost grows with the rows, so from "min_rows" rows (prompt chunks, steps
# of many sequences) the tiles are faster. Products of fewer than AMX_SMALL[0] weights, where a call's fixed costs weigh more, take
# them from AMX_SMALL[1] rows. 0: off (another variant, or the OS refused tile state). Set by
# tokenmill.kernels on load; benchmarks/kernel_bench.py and decode_batch.py measure the crossovers.
# "keep_8bit": products with 8-bit activations stay on the integer kernels (avx512bf16: there the
# 8-bit VNNI kernels are faster than VDPBF16PS; AMX tiles are faster than either).
AMX = {"min_rows": 0, "keep_8bit": False}
AMX_SMALL = (1 << 22, 16)
AMX_KINDS = frozenset({StackKind.INT4_DOT, StackKind.INT8_DOT, StackKind.Q4K, StackKind.Q6K, StackKind.LUT,
                       StackKind.Q23K})


def amx_rows(n: int, k: int) -> int:
    """The rows from which an (n out, k in) product runs on AMX tiles; 0: never (stack.cpp's AmxRows)."""
    rows = AMX["min_rows"]
    return max(rows, AMX_SMALL[1]) if rows and n * k < AMX_SMALL[0] else rows


def _amx(x2: torch.Tensor, w: "_Panels", partial: bool) -> torch.Tensor | None:
    """The AMX product of x2 (M, K) float32, or None where it does not apply (too few rows, a
    row-parallel rank's float64 partial sums, a format without a tile decoder)."""
    rows = amx_rows(w.out_features, x2.shape[1])
    if partial or not rows or x2.shape[0] < rows or (w.act_bits == 8 and AMX["keep_8bit"]):
        return None
    kind, tensors = w.stack_args()
    if kind not in AMX_KINDS:
        return None
    return torch.ops.tokenmill.amx_linear(x2, int(kind), *tensors, w.out_features)


class _Panels:
    """What every layout shares (the dataclasses below add their tensors)."""
    out_features: int
    act_bits: int
    segment: int

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def nbytes(self) -> int:
        """Bytes a product reads: every tensor of the panels."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass
class Int4Panels(_Panels):
    """Group-wise int4, w = q * s + m, in 16-row panels (byte layouts: linear.cpp)."""
    q: torch.Tensor   # uint8 (P, K/2, 16), or (P, K/8, 64) in the dot layout
    s: torch.Tensor   # float32 (P, K/group, 16); float16 in the dot layout
    m: torch.Tensor | None  # float32 (P, K/group, 16); float16 in the dot layout, or None there where the
                            # weights are symmetric (m = -8 s, -16 s with qh: GGUF Q4_0, Q5_0; `symmetric`)
    out_features: int
    dot: bool = False
    act_bits: int = 16  # dot layout: x rounded to 8- or 16-bit integers per 32 inputs (ACT_BITS)
    segment: int = 0    # dot layout: inputs per float32 partial sum, summed in float64 (0: all K)
    qh: torch.Tensor | None = None  # dot layout, 5-bit weights (GGUF Q5_0/Q5_1): q's fifth bits (fifth_bit_panels)

    def linear(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        return int4_linear(x, self, partial)

    def stack_args(self) -> tuple[StackKind, tuple]:
        """(its kind, its four tensors) for stack.cpp's add_projection / add_part (also GGUF Q5_0/Q5_1 with qh)."""
        return (StackKind.INT4_DOT if self.dot else StackKind.INT4), (self.q, self.s, self.m, self.qh)

@dataclass
class Int8Panels(_Panels):
    """int8, w = q * s per output channel, or per block of 32 inputs (GGUF Q8_0 and the lookup
    types, dot layout only), in 16-row panels."""
    q: torch.Tensor   # int8 (P, K, 16), or uint8 (P, K/4, 64) holding q + 128 in the dot layout
    s: torch.Tensor   # float32 (P*16,), or float16 (P, K/32, 16) per block
    out_features: int
    dot: bool = False
    act_bits: int = 16
    segment: int = 0

    def linear(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        return int8_linear(x, self, partial)

    def stack_args(self) -> tuple[StackKind, tuple]:
        return (StackKind.INT8_DOT if self.dot else StackKind.INT8), (self.q, self.s, None, None)

@dataclass
class Q4KPanels(_Panels):
    """GGUF Q4_K, w = q (d sc) - dmin mn: int4 dot-layout nibbles, per 32 inputs the 6-bit sc and mn
    as bytes, per 256 float16 d and -dmin (linear.cpp KScales)."""
    q: torch.Tensor    # uint8 (P, K/8, 64)
    sm: torch.Tensor   # uint8 (P, K/32, 32): 16 sc | 16 mn
    dd: torch.Tensor   # float16 (P, K/256, 32): 16 d | 16 -dmin
    out_features: int
    act_bits: int = 16
    segment: int = 0
    qh: torch.Tensor | None = None  # Q5_K: q's fifth bits, uint8 (P, K/32, 64) (fifth_bit_panels)

    def linear(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        return q4k_linear(x, self, partial)

    def stack_args(self) -> tuple[StackKind, tuple]:
        return StackKind.Q4K, (self.q, self.sm, self.dd, self.qh)

@dataclass
class Q6KPanels(_Panels):
    """GGUF Q6_K, w = d sc (q - 32), q = lo | hi << 4 (kquant.cpp has the byte layouts)."""
    ql: torch.Tensor   # uint8 (P, K/8, 64)
    qh: torch.Tensor   # uint8 (P, K/32, 128)
    sc: torch.Tensor   # int8 (P, K/16, 16)
    d: torch.Tensor    # float16 (P, K/256, 16)
    out_features: int
    act_bits: int = 16
    segment: int = 0

    def linear(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        return q6k_linear(x, self, partial)

    def stack_args(self) -> tuple[StackKind, tuple]:
        return StackKind.Q6K, (self.ql, self.qh, self.sc, self.d)

@dataclass
class Q23KPanels(_Panels):
    """GGUF Q3_K, w = d sc (q - 4) with q = lo2 | third << 2, or Q2_K, w = d sc q - dmin mn: 2-bit
    fields, Q3_K's third bits, a scale (and Q2_K's minimum) per 16 inputs (kquant.cpp has the layouts)."""
    q2: torch.Tensor   # uint8 (P, K/16, 64): the 2-bit fields
    sc: torch.Tensor   # int8 (P, K/16, 16) sc - 32 (Q3_K); uint8 sc | mn << 4 (Q2_K)
    d: torch.Tensor    # float16 (P, K/256, 16) (Q3_K); (P, K/256, 32) 16 d | 16 -dmin (Q2_K)
    out_features: int
    hb: torch.Tensor | None = None  # Q3_K: the third bits, uint8 (P, K/32, 64), the fifth-bit layout
    act_bits: int = 16
    segment: int = 0

    def linear(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        return q23k_linear(x, self, partial)

    def stack_args(self) -> tuple[StackKind, tuple]:
        return StackKind.Q23K, (self.q2, self.sc, self.d, self.hb)

@dataclass
class LutPanels(_Panels):
    """GGUF IQ4_NL / IQ4_XS / MXFP4: 4-bit indices into a 16-entry int8 table, a scale per 32 inputs
    (lut.cpp has the layouts; the scales' dtype names the type)."""
    q: torch.Tensor    # uint8 (P, K/8, 64), the int4 dot layout
    s: torch.Tensor    # (P, K/32, 16): float16 d (IQ4_NL), int8 scale - 32 (IQ4_XS), uint8 exponent (MXFP4)
    out_features: int
    d: torch.Tensor | None = None  # IQ4_XS: float16 (P, K/256, 16)
    act_bits: int = 16
    segment: int = 0

    def linear(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        return lut_linear(x, self, partial)

    def stack_args(self) -> tuple[StackKind, tuple]:
        return StackKind.LUT, (self.q, self.s, self.d, None)

def symmetric(scale: torch.Tensor, minimum: torch.Tensor, offset: int) -> bool:
    """Whether every minimum is exactly -offset x its scale, in the float16 the dot layout keeps (GGUF
    Q4_0 and Q5_0 are): the panels then keep no minimums and the kernels derive them."""
    derived = scale.half() * -offset
    return bool(torch.isfinite(derived).all()) and torch.equal(minimum.half(), derived)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % LANES
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t



def _panels(n: int, shape: tuple[int, ...], dtype: torch.dtype, fill, alloc=None) -> torch.Tensor:
    """(P, *shape) panels of n rows, filled PACK_ROWS rows at a time: fill(r0, r1) -> their panels.
    Packing a whole 128k-row output head at once took ~5 bytes per weight of intermediates.
    `alloc(shape, dtype)`: where the panels live (the caller's huge pages), else torch.empty."""
    full = ((n + LANES - 1) // LANES, *shape)
    out = alloc(full, dtype) if alloc is not None else torch.empty(full, dtype=dtype)
    for r0 in range(0, n, PACK_ROWS):
        r1 = min(r0 + PACK_ROWS, n)
        out[r0 // LANES:(r1 + LANES - 1) // LANES] = fill(r0, r1)
    return out


def per_panel(t: torch.Tensor) -> torch.Tensor:
    """(N, G) per-row values -> (P, G, 16) float32, as the panels hold scales and minimums."""
    return _pad_rows(t.float()).reshape(-1, LANES, t.shape[1]).transpose(1, 2).contiguous()


def int4_dot_panels(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integers (their low 4 bits) -> uint8 (P, K/8, 64), the int4 dot layout."""
    k = q.shape[1]
    octets = _pad_rows(q.to(torch.uint8) & 15).reshape(-1, LANES, k // 8, 2, 4)  # (P, 16, K/8, half, 4)
    packed = octets[:, :, :, 0] | (octets[:, :, :, 1] << 4)                      # (P, 16, K/8, 4)
    return packed.transpose(1, 2).reshape(-1, k // 8, 4 * LANES)


def fifth_bit_panels(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integers 0..31 -> their bits 4 as uint8 (P, K/32, 64) (linear.cpp fifth_bits)."""
    k = q.shape[1]
    bits = ((_pad_rows(q.to(torch.uint8)) >> 4) & 1).reshape(-1, LANES, k // 32, 4, 2, 4)  # (P, 16, block, o, half, j)
    shift = torch.arange(4, dtype=torch.uint8).view(4, 1, 1) + torch.tensor([0, 4], dtype=torch.uint8).view(1, 2, 1)
    packed = (bits << shift).sum(dim=(3, 4), dtype=torch.uint8)                      # (P, 16, block, j)
    return packed.transpose(1, 2).reshape(-1, k // 32, 4 * LANES)


def int8_dot_panels(q: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> uint8 (P, K/4, 64) holding q + 128, the int8 dot layout."""
    k = q.shape[1]
    u = (_pad_rows(q.to(torch.int16)) + 128).to(torch.uint8)
    return u.reshape(-1, LANES, k // 4, 4).transpose(1, 2).reshape(-1, k // 4, 4 * LANES)


def unpack_int8(w: Int8Panels) -> torch.Tensor:
    """The int8 (N, K) integers the panels hold (either layout)."""
    if w.dot:
        p, quads, _ = w.q.shape
        q = (w.q.view(p, quads, LANES, 4).to(torch.int16) - 128).to(torch.int8)   # (P, K/4, 16, 4)
        return q.permute(0, 2, 1, 3).reshape(p * LANES, quads * 4)[:w.out_features]
    p, k, _ = w.q.shape
    return w.q.transpose(1, 2).reshape(p * LANES, k)[:w.out_features]


def int4_linear(x: torch.Tensor, w: Int4Panels, partial: bool = False) -> torch.Tensor:
    """x (..., K) float32 -> (..., N). In the dot layout x is first rounded to `w.act_bits`-bit
    integers per 32 inputs (the product is then exact), or to bfloat16 for AMX tiles where a prompt
    chunk has AMX["min_rows"] rows; the float layout multiplies in float32.
    `partial` (dot layout): float64 sums, unrounded, for a row-parallel rank's all-reduce (float32
    otherwise)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = _amx(x2, w, partial) if w.dot else None
    if y is None and w.dot:
        y = torch.ops.tokenmill.int4_linear_dot(x2, w.q, w.s, w.m, w.out_features, w.act_bits, w.segment, partial, w.qh)
    elif y is None:
        y = torch.ops.tokenmill.int4_linear(x2, w.q, w.s, w.m, w.out_features)
    return y.view(*x.shape[:-1], w.out_features)


def int8_linear(x: torch.Tensor, w: Int8Panels, partial: bool = False) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = _amx(x2, w, partial) if w.dot else None
    if y is None and w.dot:
        y = torch.ops.tokenmill.int8_linear_dot(x2, w.q, w.s, w.out_features, w.act_bits, w.segment, partial)
    elif y is None:
        y = torch.ops.tokenmill.int8_linear(x2, w.q, w.s, w.out_features)
    return y.view(*x.shape[:-1], w.out_features)


def q4k_linear(x: torch.Tensor, w: Q4KPanels, partial: bool = False) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = _amx(x2, w, partial)
    if y is None:
        y = torch.ops.tokenmill.q4k_linear_dot(x2, w.q, w.sm, w.dd, w.out_features, w.act_bits, w.segment, partial, w.qh)
    return y.view(*x.shape[:-1], w.out_features)


def q6k_linear(x: torch.Tensor, w: Q6KPanels, partial: bool = False) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = _amx(x2, w, partial)
    if y is None:
        y = torch.ops.tokenmill.q6k_linear_dot(x2, w.ql, w.qh, w.sc, w.d, w.out_features, w.act_bits, w.segment, partial)
    return y.view(*x.shape[:-1], w.out_features)


def q23k_linear(x: torch.Tensor, w: Q23KPanels, partial: bool = False) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = _amx(x2, w, partial)
    if y is None:
        y = torch.ops.tokenmill.q23k_linear_dot(x2, w.q2, w.sc, w.d, w.hb, w.out_features, w.act_bits, w.segment, partial)
    return y.view(*x.shape[:-1], w.out_features)


def lut_linear(x: torch.Tensor, w: LutPanels, partial: bool = False) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = _amx(x2, w, partial)
    if y is None:
        y = torch.ops.tokenmill.lut_linear_dot(x2, w.q, w.s, w.d, w.out_features, w.act_bits, w.segment, partial)
    return y.view(*x.shape[:-1], w.out_features)

"""Group-wise asymmetric int4 weights: w = scale * q + min, q in 0..15, one (scale, min) per
`group_size` consecutive inputs of a row — exactly GGUF's Q4_1 (Q4_0 is min = -8 * scale).

Two layouts. Where tokenmill's CPU kernels are built (`tokenmill.kernels`), 16-row panels with
float16 scales and mins (as GGUF, AWQ and GPTQ store them; float32 where a group is not a multiple
of 32), 16- or 8-bit-integer activations, one unpacked weight reused by every row of a batch. Otherwise PyTorch's CPU int4 layout for `torch._weight_int4pack_mm_for_cpu`, which
dequantizes as (q - 8) * scale + zero (so zero = min + 8 * scale, kept in bfloat16) and runs fast
only with bfloat16 activations (float32 ones take it off its fast path), so
inputs are cast to bfloat16 for that product and back. That kernel dequantizes its weights again
for every row of x; from DEQUANT_MIN_ROWS rows on (prompt chunks, large batches) it is faster to
dequantize the weight once from a plain nibble copy and run the float GEMM on the same bfloat16-
rounded inputs (benchmarks/RESULTS.md), so the fallback keeps that copy too (half a byte per weight).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill import kernels
from tokenmill.quant.base import QuantWeight
from tokenmill.utils import huge_page_zeros


@dataclass
class Int4Weight(QuantWeight):
    group_size: int
    out_features: int
    in_features: int
    panels: kernels.Int4Panels | None = None   # tokenmill's kernel layout, or else:
    packed: torch.Tensor | None = None         # uint8 (N, K/2), torch's CPU int4 packing
    scales_zeros: torch.Tensor | None = None   # bfloat16 (K/group_size, N, 2)
    nibbles: torch.Tensor | None = None        # uint8 (N, K/2): q[n, 2j] | q[n, 2j+1] << 4

    @property
    def reduction_unit(self) -> int:
        return self.group_size

    def matmul(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        if self.panels is not None:
            return super().matmul(x, partial)
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if x2.shape[0] >= DEQUANT_MIN_ROWS and self.nibbles is not None:
            y = torch.nn.functional.linear(x2.float(), _dequantize_fallback(self))
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_zeros)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


DEQUANT_MIN_ROWS = 128  # fallback: from this many rows of x, dequantize once + float GEMM


GROUP_SIZES = (32, 64, 128, 256)  # what the CPU kernel accepts


def pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int) -> Int4Weight:
    """q: (N, K) integers 0..15; scale, minimum: (N, K/group_size) floats."""
    n, k = q.shape
    if k % group_size or scale.shape != (n, k // group_size):
        raise ValueError(f"int4 groups of {group_size} do not tile a ({n}, {k}) weight.")
    if kernels.available():
        return Int4Weight(group_size, n, k, panels=kernels.pack_int4(q, scale, minimum, alloc=huge_page_zeros))
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    zero = minimum.float() + 8.0 * scale.float()
    sz = torch.stack([scale.float().t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # (G, N, 2)
    q8 = q.to(torch.uint8)
    return Int4Weight(group_size, n, k, packed=packed, scales_zeros=sz,
                      nibbles=(q8[:, 0::2] | (q8[:, 1::2] << 4)).contiguous())


def _dequantize_fallback(w: Int4Weight) -> torch.Tensor:
    """The float32 (N, K) weight PyTorch's int4 kernel multiplies by: (q - 8) * scale + zero with
    its bfloat16 scales and zeros."""
    n, k, g = w.out_features, w.in_features, w.group_size
    q = torch.stack([w.nibbles & 15, w.nibbles >> 4], dim=-1).reshape(n, k // g, g).float() - 8.0
    sz = w.scales_zeros.float()                                            # (G, N, 2)
    scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]     # (N, G, 1)
    return torch.addcmul(zero, q, scale).reshape(n, k)


def quantize_rtn(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4 of a float (N, K) weight: (q, scale, min)."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the input dimension {k}.")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo


def dequantize(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    groups = scale.shape[1]
    w = q.float().reshape(n, groups, k // groups) * scale.float()[..., None] + minimum.float()[..., None]
    return w.reshape(n, k)

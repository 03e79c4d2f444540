"""Group-wise asymmetric int4 weights: w = scale * q + min, q in 0..15, one (scale, min) per
`group_size` consecutive inputs of a row — exactly GGUF's Q4_1 (Q4_0 is min = -8 * scale).

Stored in PyTorch's CPU int4 layout, multiplied with `torch._weight_int4pack_mm_for_cpu`. That
kernel dequantizes as (q - 8) * scale + zero, so zero = min + 8 * scale. It runs fast only with
bfloat16 activations (benchmarks/kernels.py: 28 us vs ~920 us in float32 for a 1536x576 matrix), so inputs
are cast to bfloat16 for the product and the result back to the model's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int4Weight:
    packed: torch.Tensor           # uint8 (N, K/2), torch's CPU int4 packing
    scales_zeros: torch.Tensor     # bfloat16 (K/group_size, N, 2)
    group_size: int
    out_features: int
    in_features: int


GROUP_SIZES = (32, 64, 128, 256)  # what the CPU kernel accepts


def pack(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int) -> Int4Weight:
    """q: (N, K) integers 0..15; scale, minimum: (N, K/group_size) floats."""
    n, k = q.shape
    if k % group_size or scale.shape != (n, k // group_size):
        raise ValueError(f"int4 groups of {group_size} do not tile a ({n}, {k}) weight.")
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    zero = minimum.float() + 8.0 * scale.float()
    sz = torch.stack([scale.float().t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # (G, N, 2)
    return Int4Weight(packed, sz, group_size, n, k)


def matmul(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x: (..., K) -> (..., N) in x's dtype."""
    x2 = x.reshape(-1, w.in_features).to(torch.bfloat16)
    y = torch._weight_int4pack_mm_for_cpu(x2, w.packed, w.group_size, w.scales_zeros)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


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

"""Per-output-channel symmetric int8 weights (w = scale * q, q in -127..127), multiplied with
`torch._weight_int8pack_mm` in bfloat16 (its fast path; float32 is ~18x slower here)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8Weight:
    q: torch.Tensor       # int8 (N, K)
    scale: torch.Tensor   # bfloat16 (N,)
    out_features: int
    in_features: int


def quantize_rtn(w: torch.Tensor) -> Int8Weight:
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = (w32 / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.to(torch.bfloat16), w.shape[0], w.shape[1])


def matmul(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    x2 = x.reshape(-1, w.in_features).to(torch.bfloat16)
    y = torch._weight_int8pack_mm(x2, w.q, w.scale)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


def dequantize(w: Int8Weight) -> torch.Tensor:
    return w.q.float() * w.scale.float()[:, None]

"""Per-output-channel symmetric int8 weights (w = scale * q, q in -127..127). Multiplied by
tokenmill's CPU kernel where it is built (16-row panels, see `tokenmill.kernels`),
else by `torch._weight_int8pack_mm` in bfloat16 (its fast path; float32 is much slower)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill import kernels
from tokenmill.quant.base import QuantWeight
from tokenmill.utils import huge_page_zeros


@dataclass
class Int8Weight(QuantWeight):
    q: torch.Tensor | None  # int8 (N, K); None where the panels hold the only copy
    scale: torch.Tensor   # (N,): bfloat16 for PyTorch's kernel, float32 with panels
    out_features: int
    in_features: int
    panels: kernels.Int8Panels | None = None  # tokenmill's kernel layout of the same numbers

    def matmul(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        if self.panels is not None:
            return super().matmul(x, partial)
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(x2, self.q, self.scale)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def make(q: torch.Tensor, scale: torch.Tensor) -> Int8Weight:
    """The int8 weight for integers q (N, K) and per-row scales (N,), in the fastest layout."""
    n, k = q.shape
    if kernels.available() and k % 2 == 0:
        return Int8Weight(None, scale.float(), n, k, kernels.pack_int8(q, scale, alloc=huge_page_zeros))
    return Int8Weight(q.contiguous(), scale.to(torch.bfloat16), n, k)


def rtn_parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row round-to-nearest of a float (N, K) weight: (q int8, scale (N,)). Row by row, so a
    weight converted in runs of rows gets the same numbers as converted whole."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = (w32 / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_rtn(w: torch.Tensor) -> Int8Weight:
    return make(*rtn_parts(w))


def dequantize(w: Int8Weight) -> torch.Tensor:
    q = w.q if w.q is not None else kernels.unpack_int8(w.panels)
    return q.float() * w.scale.float()[:, None]

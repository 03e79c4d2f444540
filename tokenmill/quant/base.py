"""What every quantized weight format answers, so that layers, the decode stack and the memory
accounting never branch on formats (vLLM's quant-method idea, at tokenmill's size).

A format is one module of this package: int4.py (group-wise int4: GGUF Q4_0/Q4_1, AWQ, GPTQ,
round-to-nearest), int8.py (per-channel int8), kquant.py (GGUF block types at their own width).
Each creates its weight from checkpoint integers or blocks (`int4.pack`, `int8.make`,
`kquant.from_blocks`), and the weight then answers:

    matmul(x, partial)   the product (the kernels' panels, else PyTorch's kernel)
    kernel_bytes()       bytes one product reads: what a decode step streams
    reduction_unit       inputs a kernel's partial sums keep whole (`layers.linear.reduction_segment`)
    configure(bits, seg) activation rounding and float64 segments, set once the layer is packed
    stack_args()         (stack.cpp's kind, its four tensors), or None off the panels
    leaves()             the kernel weights it is made of (itself, or a RowStack's parts)

`quant.assembly` decides which format a layer's checkpoint shards become.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill import kernels


class QuantWeight:
    """Base of every format's weight (each a dataclass with `out_features`, `in_features` and
    `panels`, None where the kernels are not built)."""
    out_features: int
    in_features: int
    panels = None

    def matmul(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """x (..., K) -> (..., N) in x's dtype; `partial`: the dot kernels' float64 sums, unrounded
        (a row-parallel rank's share before the all-reduce)."""
        y = self.panels.linear(x.float(), partial)
        return y if partial else y.to(x.dtype)

    @property
    def reduction_unit(self) -> int:
        return 32

    def kernel_bytes(self) -> int:
        if self.panels is not None:
            return self.panels.nbytes()
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))

    def configure(self, act_bits: int, segment: int) -> None:
        if self.panels is not None:
            self.panels.act_bits, self.panels.segment = act_bits, segment

    def stack_args(self) -> tuple[kernels.StackKind, tuple] | None:
        return None if self.panels is None else self.panels.stack_args()

    def leaves(self) -> list[QuantWeight]:
        return [self]


@dataclass
class RowStack(QuantWeight):
    """Weights of different formats stacked by output rows (a fused QKV whose V is Q6_K and Q, K
    are Q4_K, as llama.cpp's Q4_K_M mixes them): each multiplies x, the outputs are concatenated."""
    parts: list
    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        return torch.cat([p.matmul(x, partial) for p in self.parts], dim=-1)

    def kernel_bytes(self) -> int:
        return sum(p.kernel_bytes() for p in self.parts)

    def configure(self, act_bits: int, segment: int) -> None:
        raise TypeError("configure a RowStack's parts (leaves()), each with its own reduction unit")

    def stack_args(self) -> None:
        return None  # the stack takes a StackKind.STACK projection, then each part

    def leaves(self) -> list[QuantWeight]:
        return list(self.parts)

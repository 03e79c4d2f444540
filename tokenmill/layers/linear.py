"""Linear layers, plain and fused (QKV, gate/up), each knowing how to load its checkpoint shards.

A fused layer stores the shards stacked along the output dimension, so one matmul replaces
three (QKV) or two (gate/up); `weight_loader(param, tensor, shard)` copies a checkpoint tensor
into its rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shard_offsets: dict[str, tuple[int, int]] = {}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        if shard is None:
            if param.shape != loaded.shape:
                raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {tuple(param.shape)}")
            param.data.copy_(loaded)
            return
        start, size = self.shard_offsets[shard]
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch for shard {shard!r}: checkpoint {tuple(loaded.shape)}, "
                             f"expected ({size}, {', '.join(map(str, param.shape[1:]))})")
        param.data[start:start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FusedLinear(Linear):
    """Several projections of the same input, stacked: shards in the given order."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size
        self.split_sizes = list(shards.values())

"""Rotary position embedding (rotate-half / NeoX layout), with Llama 3 and linear scaling.

The cos/sin rows of a step's positions are looked up once per forward (`lookup`) and shared by
every layer; queries and keys are rotated in one call.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill import kernels


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # float32 exactly as the reference implementations compute it, so angles match bit for bit
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"Unsupported rope_scaling type {kind!r}; supported: default, linear, llama3.")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv = _inv_freq(head_dim, theta, scaling).float()
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv)                       # (max_position, head_dim/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) positions -> cos, sin of shape (T, 1, head_dim/2), for all layers of one step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, D) -> rotated (T, H, D); in float32 whatever x's dtype."""
    if kernels.usable_for(x):
        return kernels.rotary(x, cos, sin)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

"""Exact decoding of GGUF 4-bit blocks into (q, scale, min) per 32-weight group, so they can be
packed as int4 without re-quantizing.

    Q4_0 block, 18 bytes: d (fp16) | 16 bytes of nibbles      w = d * (q - 8)
    Q4_1 block, 20 bytes: d (fp16) | m (fp16) | 16 bytes      w = d * q + m
    nibbles: byte j holds value j in its low half and value j + 16 in its high half
"""
from __future__ import annotations

import numpy as np
import torch

GROUP = 32


def decode(raw: np.ndarray, kind: str, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw: uint8 (rows, bytes per row) -> q uint8 (rows, cols), scale and min float32 (rows, cols/32)."""
    rows = raw.shape[0]
    head = 2 if kind == "Q4_0" else 4
    blocks = raw.reshape(rows, cols // GROUP, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_0":
        m = -8.0 * d
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nib = blocks[..., head:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).reshape(rows, cols)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)

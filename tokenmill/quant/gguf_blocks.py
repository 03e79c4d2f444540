"""Exact decoding of GGUF's 32-weight block types into integers and per-block scales, so that they
are packed for the kernels without rounding anything again (vectorized numpy: the loader's step
for these types; the K-quants' super-blocks are moved by kquant.cpp instead).

    Q4_0   18 bytes: d (fp16) | 16 bytes of nibbles                 w = d (q - 8)
    Q4_1   20 bytes: d | m (fp16) | 16 bytes                         w = d q + m
    Q5_0   22 bytes: d | 4 bytes of fifth bits | 16 bytes            w = d (q - 16)
    Q5_1   24 bytes: d | m | 4 bytes of fifth bits | 16 bytes        w = d q + m
    Q8_0   34 bytes: d | 32 int8                                     w = d q
    IQ4_NL 18 bytes: d | 16 bytes of nibbles                         w = d T[q], T a 16-entry int8 table
    MXFP4  17 bytes: e (E8M0) | 16 bytes                             w = 2^(e-128) F[q], F = 2 x FP4 (E2M1)
    IQ4_XS 136 bytes per 256: d | 16-bit and 4 x 8-bit scale bits | 128 bytes of nibbles
                                                                     w = d (ls - 32) T[q], 6-bit ls per 32
    nibbles: byte j of a block holds value j in its low half and value j + 16 in its high half;
    fifth bits: bit j of the little-endian 32-bit word is value j's bit 4.

Each lookup type's weights are an int8 table value times a scale per 32 inputs that is exact in
float32 (an IQ4_XS scale is a float16 times a 6-bit integer, an MXFP4 scale a power of two): the
lookup kernel (kernels/lut.cpp) keeps the 4-bit indices and the file's own scale bits
(`decode_lut`).
"""
from __future__ import annotations

import numpy as np
import torch

GROUP = 32
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
FIVE_BIT = ("Q5_0", "Q5_1")
LOOKUP = ("IQ4_NL", "IQ4_XS", "MXFP4")


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> float32 (...)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) values 0..15."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode(raw: np.ndarray, kind: str, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0/Q4_1/Q5_0/Q5_1 raw uint8 (rows, bytes per row) -> q uint8 (rows, cols) in 0..15 (0..31
    for Q5), scale and min float32 (rows, cols/32): w = q scale + min, exactly."""
    rows = raw.shape[0]
    head = 2 if kind in ("Q4_0", "Q5_0") else 4
    five = kind in FIVE_BIT
    blocks = raw.reshape(rows, cols // GROUP, head + (4 if five else 0) + 16)
    d = _f16(blocks[..., 0:2])
    m = _f16(blocks[..., 2:4]) if head == 4 else (-16.0 if five else -8.0) * d
    q = _nibbles(blocks[..., -16:])
    if five:
        qh = np.ascontiguousarray(blocks[..., head:head + 4]).view("<u4")[..., 0]
        q |= (((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    return torch.from_numpy(q.reshape(rows, cols)), torch.from_numpy(d), torch.from_numpy(m)


def decode_q8_0(raw: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 raw rows -> q int8 (rows, cols), d float16 (rows, cols/32): w = q d, exactly."""
    blocks = raw.reshape(raw.shape[0], cols // GROUP, 34)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], cols)
    return torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].copy())


def decode_lut(raw: np.ndarray, kind: str, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """IQ4_NL/IQ4_XS/MXFP4 raw rows -> table indices uint8 (rows, cols), the per-32 scales as the
    lookup kernel holds them (IQ4_NL float16 d, IQ4_XS int8 ls - 32, MXFP4 uint8 exponent; (rows,
    cols/32)) and IQ4_XS's float16 d per 256 (else None)."""
    rows = raw.shape[0]
    if kind == "IQ4_XS":
        sb = raw.reshape(rows, cols // 256, 136)
        high = np.ascontiguousarray(sb[..., 2:4]).view("<u2")[..., 0]
        ib = np.arange(8)
        ls = ((sb[..., 4:8][..., ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 15) | \
             (((high[..., None] >> (2 * ib).astype(np.uint16)) & 3) << 4).astype(np.uint8)
        q = _nibbles(sb[..., 8:].reshape(rows, cols // 256, 8, 16))
        d = torch.from_numpy(np.ascontiguousarray(sb[..., 0:2]).view(np.float16)[..., 0].copy())
        return (torch.from_numpy(q.reshape(rows, cols)), torch.from_numpy((ls.astype(np.int8) - 32).reshape(rows, -1)), d)
    head = 1 if kind == "MXFP4" else 2
    blocks = raw.reshape(rows, cols // GROUP, head + 16)
    q = _nibbles(blocks[..., head:]).reshape(rows, cols)
    scale = blocks[..., 0].copy() if kind == "MXFP4" else np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].copy()
    return torch.from_numpy(q), torch.from_numpy(scale), None

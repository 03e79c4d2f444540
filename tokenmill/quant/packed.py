"""The two standard packed int4 checkpoint layouts, AWQ (GEMM version) and GPTQ, to and from
plain integer tensors. Checkpoints written here load in other engines that read these formats;
checkpoints from AutoAWQ / AutoGPTQ / GPTQModel load here.

Both store w = (q - zero) * scale per group of `group_size` input channels, with integer zeros.
In our own orientation a weight is (N out, K in); the formats transpose it:

    AWQ   qweight (K, N/8) int32, 8 outputs per word in the order 0 2 4 6 1 3 5 7
          qzeros  (G, N/8) int32, same order          scales (G, N) float16
    GPTQ  qweight (K*b/32, N) int32, 32/b consecutive inputs per word, low bits first
          qzeros  (G, N*b/32) int32, consecutive outputs, stored as zero - 1 (the v1 format
          every loader expects)                       scales (G, N) float16
          g_idx   (K,) int32, the group of each input channel (act-order permutes it)
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C) ints -> (R*bits/32, C) int32: 32/bits consecutive rows share one word."""
    per = 32 // bits
    r, c = v.shape
    if r % per:
        raise ValueError(f"{r} rows do not pack {per} per 32-bit word.")
    v = v.to(torch.int64).reshape(r // per, per, c)
    shifts = (torch.arange(per, dtype=torch.int64) * bits)[None, :, None]
    return _to_int32((v << shifts).sum(dim=1))


def _unpack_rows(p: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    w = p.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(per, dtype=torch.int64) * bits)[None, :, None]
    v = (w[:, None, :] >> shifts) & ((1 << bits) - 1)
    return v.reshape(-1, p.shape[1])


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the same bits as int32."""
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


def _pack_cols(v: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """(R, C) -> (R, C*bits/32): 32/bits consecutive columns per word, in `order` if given."""
    per = 32 // bits
    r, c = v.shape
    if c % per:
        raise ValueError(f"{c} columns do not pack {per} per 32-bit word.")
    v = v.reshape(r, c // per, per)
    if order is not None:
        v = v[..., list(order)]
    return _pack_rows(v.permute(2, 0, 1).reshape(per, -1), bits).reshape(r, c // per)


def _unpack_cols(p: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    per = 32 // bits
    r, w = p.shape
    v = _unpack_rows(p.reshape(1, -1), bits).reshape(per, r, w).permute(1, 2, 0)  # (R, W, per)
    if order is not None:
        v = v[..., list(torch.argsort(torch.tensor(order)))]
    return v.reshape(r, w * per)


# ------------------------------------------------------------------ AWQ
def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """q (N, K) in 0..15, zeros (N, G) in 0..15, scales (N, G) -> AWQ GEMM tensors."""
    return {"qweight": _pack_cols(q.t().contiguous(), 4, AWQ_ORDER),
            "qzeros": _pack_cols(zeros.t().contiguous(), 4, AWQ_ORDER),
            "scales": scales.t().contiguous().to(torch.float16)}


def unpack_awq(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ GEMM tensors -> q (N, K), zeros (N, G), scales (N, G) float32."""
    q = _unpack_cols(t["qweight"], 4, AWQ_ORDER).t()
    zeros = _unpack_cols(t["qzeros"], 4, AWQ_ORDER).t()
    scales = t["scales"].float().t()
    _check(q, zeros, scales, "AWQ")
    return q.contiguous(), zeros.contiguous(), scales.contiguous()


# ------------------------------------------------------------------ GPTQ
def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
              bits: int) -> dict[str, torch.Tensor]:
    """q (N, K) in 0..2^bits-1, zeros/scales (N, G), g_idx (K,) -> GPTQ tensors (v1 zeros)."""
    return {"qweight": _pack_rows(q.t().contiguous(), bits),
            "qzeros": _pack_cols((zeros.t().to(torch.int64) - 1) & ((1 << bits) - 1), bits),
            "scales": scales.t().contiguous().to(torch.float16),
            "g_idx": g_idx.to(torch.int32)}


def unpack_gptq(t: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, ...]:
    """GPTQ tensors -> q (N, K), zeros (N, G), scales (N, G) float32, g_idx (K,) int64 or None
    when the checkpoint has none (groups in order)."""
    q = _unpack_rows(t["qweight"], bits).t()
    zeros = ((_unpack_cols(t["qzeros"], bits) + 1) & ((1 << bits) - 1)).t()
    scales = t["scales"].float().t()
    k = q.shape[1]
    g_idx = t["g_idx"].long() if "g_idx" in t else None
    if g_idx is not None and (g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[1]):
        raise ValueError(f"GPTQ g_idx of shape {tuple(g_idx.shape)} does not index {scales.shape[1]} groups.")
    _check(q, zeros, scales, "GPTQ")
    return q.contiguous(), zeros.contiguous(), scales.contiguous(), g_idx


def _check(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, fmt: str) -> None:
    if zeros.shape != scales.shape or q.shape[0] != scales.shape[0]:
        raise ValueError(f"inconsistent {fmt} tensors: qweight -> {tuple(q.shape)}, qzeros -> "
                         f"{tuple(zeros.shape)}, scales -> {tuple(scales.shape)}.")


def default_g_idx(k: int, group_size: int) -> torch.Tensor:
    """Groups of `group_size` consecutive inputs; when that does not divide k the last is shorter
    (GPTQ's convention: ceil(k / group_size) groups). group_size -1: one group per row."""
    return torch.zeros(k, dtype=torch.long) if group_size == -1 else torch.arange(k) // group_size


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """w[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)], float32 (N, K)."""
    return (q.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]


def kernel_layout(g_idx: torch.Tensor, kernel_sizes: tuple[int, ...]) -> tuple[torch.Tensor | None, int, torch.Tensor]:
    """How a group-wise kernel with equal groups of one of `kernel_sizes` runs this grouping:
    (input permutation or None, kernel group size, the checkpoint group of each kernel group).
    Act-order permutes the inputs so that every group is one run; a short last group (group size
    not dividing K) or groups of 128 are split into kernel groups of 64 sharing one scale."""
    k = g_idx.numel()
    perm = None if bool((g_idx[1:] >= g_idx[:-1]).all()) else torch.argsort(g_idx, stable=True)
    ordered = g_idx if perm is None else g_idx[perm]
    starts = torch.nonzero(ordered[1:] != ordered[:-1]).flatten() + 1
    if ordered.unique().numel() != starts.numel() + 1:
        raise ValueError("a quantization group is split into several runs of inputs; cannot run it group-wise.")
    for size in sorted(kernel_sizes, reverse=True):
        if k % size == 0 and bool((starts % size == 0).all()):
            return perm, size, ordered[::size].clone()
    raise ValueError(f"quantization groups (starting at inputs {starts[:4].tolist()}...) do not align to any "
                     f"kernel group size {kernel_sizes} dividing {k}.")

"""LoRA adapters beside a projection's base weight: slots of low-rank pairs, applied per row.

A projection that adapters target gets a `LoRABank`: `num_slots` slots, each able to hold one
adapter's (A, B) for every output part of the projection (q, k, v of a fused QKV; gate, up; or the
one part). A step's rows each run under one slot or none (`LoRARows`, in the ForwardContext), so
requests for different adapters and the base share one forward pass; the base weight — quantized
or float — is never merged with an adapter or copied per adapter, and its kernels run as without
LoRA. The delta `x A^T B * scale` is added per run of rows of one slot: the CPU kernel
(kernels/lora.cpp) shrinks and expands all short runs in two parallel passes; elsewhere each run
is two matrix products here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill import kernels
from tokenmill.layers.attention import get_forward_context


@dataclass
class LoRARows:
    """The step's adapter slot of every row of the flat batch (-1: the base alone), and the same as
    runs (start, end, slot) of consecutive rows, for the path without the CPU kernel."""
    slots: torch.Tensor
    runs: list[tuple[int, int, int]]


def step_rows() -> LoRARows | None:
    meta = get_forward_context()
    return None if meta is None else meta.lora


class LoRABank:
    """Slots of adapter weights for one projection of `in_features` inputs whose outputs are the
    parts `part_sizes` in order. A (S, K, P R): per slot each part's R down-projection rows,
    transposed (the kernel's lanes run over them); B (S, R, N) with the scale folded in; zero where
    a slot's adapter is shorter than R or leaves a part alone; `ranks` (S, P) the rows used."""

    def __init__(self, part_sizes: list[int], in_features: int, num_slots: int, max_rank: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.offsets = [0]
        for n in part_sizes:
            self.offsets.append(self.offsets[-1] + n)
        p, n = len(part_sizes), self.offsets[-1]
        self.a = torch.zeros(num_slots, in_features, p * max_rank, device=device, dtype=dtype)
        self.b = torch.zeros(num_slots, max_rank, n, device=device, dtype=dtype)
        self.ranks = torch.zeros(num_slots, p, dtype=torch.long)  # on the host: the kernel and the loop below read it

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def put(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Slot `slot` holds one adapter: per part index its A (r, K), B (n_p, r) and scale."""
        self.clear(slot)
        r_max = self.b.shape[1]
        for p, (a, b, scale) in parts.items():
            r, lo, hi = a.shape[0], self.offsets[p], self.offsets[p + 1]
            self.a[slot, :, p * r_max:p * r_max + r].copy_(a.t())
            self.b[slot, :r, lo:hi].copy_((b.to(torch.float32) * scale).t())  # rounded to the slots' dtype once
            self.ranks[slot, p] = r

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot].zero_()

    def add_(self, y: torch.Tensor, x: torch.Tensor, rows: LoRARows) -> torch.Tensor:
        """y (T, N) += each row's delta; x (T, K) the projection's input."""
        if kernels.usable_for(x) and self.a.dtype in (torch.float32, torch.float16) and y.dtype == torch.float32:
            kernels.lora_add_(y, x, self.a, self.b, self.ranks, rows.slots, self.offsets)
            return y
        r_max = self.b.shape[1]
        for start, end, s in rows.runs:
            if s < 0:
                continue
            work = torch.float32 if self.a.dtype == torch.float16 and x.device.type == "cpu" else self.a.dtype
            t = x[start:end].to(work) @ self.a[s].to(work)
            for p, r in enumerate(self.ranks[s].tolist()):
                if r:
                    lo, hi = self.offsets[p], self.offsets[p + 1]
                    y[start:end, lo:hi] += (t[:, p * r_max:p * r_max + r] @ self.b[s, :r, lo:hi].to(work)).to(y.dtype)
        return y

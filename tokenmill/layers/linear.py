"""Linear layers, plain and fused (QKV, gate/up), each knowing how to load its checkpoint shards
and how to become quantized once loaded.

A fused layer stores the shards stacked along the output dimension, so one matmul replaces three
(QKV) or two (gate/up); `weight_loader(param, tensor, shard)` copies a checkpoint tensor into its
rows. Weights load as float; `quantize(...)` then swaps them for a packed int4 or int8 form:
exactly, when every shard came as GGUF Q4_0/Q4_1 blocks, or by round-to-nearest on request.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quant import int4, int8

QUANT_POLICIES = ("auto", "none", "int8", "int4", "awq", "gptq")
PREQUANTIZED = ("awq", "gptq")  # policies that name a checkpoint's format: they load its weights as stored
# PyTorch's int4/int8 CPU kernels cost time linear in the rows of x (no reuse of the unpacked weight
# across rows): 28 us at 1 row, 900 us at 64 for a 1536x576 matrix, where a float GEMM takes 520 us.
# Past this many rows a layer that kept its float weight uses that instead.
FLOAT_MIN_ROWS = 32


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        self.qweight: int4.Int4Weight | int8.Int8Weight | None = None
        self.float_weight: torch.Tensor | None = None  # kept for large batches when asked
        self.input_perm: torch.Tensor | None = None  # act-order GPTQ: inputs reordered so groups are contiguous
        self._int4_parts: dict[str | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._int8_parts: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self._input_perms: dict[str | None, torch.Tensor | None] = {}
        self.quantized_source = False  # some shard was stored quantized in the checkpoint
        self.keep_float = False  # never quantized: MoE routers (tiny, and they decide which experts run)
        # row-parallel under tensor parallelism (distributed/tensor_parallel.py): the ranks' partial
        # outputs are summed by this group's all-reduce before the bias is added (once)
        self.tp_group = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None,
                      int4_parts: tuple | None = None, int8_parts: tuple | None = None,
                      input_perm: torch.Tensor | None = None, quantized: bool = False) -> None:
        """`int4_parts` (q, scale, min) / `int8_parts` (q, scale): the exact quantized form of
        `loaded` (which is its dequantized float), kept so that `quantize` need not round again;
        `input_perm`: the input order the int4 parts are stored in (act-order GPTQ)."""
        if param is self.weight:
            self.quantized_source |= quantized
            if int4_parts is not None:
                self._int4_parts[shard] = int4_parts
                self._input_perms[shard] = input_perm
            if int8_parts is not None:
                self._int8_parts[shard] = int8_parts
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

    def quantize(self, policy: str, group_size: int, allow_int4: bool = True, keep_float: bool = False,
                 activation_bits: int = 16, row_bounds: tuple[int, ...] = ()) -> None:
        """Replace the float weight by a quantized one according to `policy`:
        auto (awq, gptq): exact int4/int8 where the checkpoint stored those (GGUF Q4_0/Q4_1, AWQ, GPTQ),
        int8 for other quantized tensors;
        int8 / int4: round-to-nearest for the rest too; none: keep float.
        `activation_bits` (8 | 16): what the VNNI kernels round inputs to (`tokenmill.kernels`).
        `row_bounds`: where tensor-parallel ranks' input slices of this (row-parallel) projection can
        begin and end, at any rank count (`tensor_parallel.row_parallel_bounds`); see `reduction_segment`."""
        if policy == "int4" and group_size not in int4.GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {int4.GROUP_SIZES}, got {group_size}.")
        expected = list(self.shard_offsets) or [None]
        allow_int4 = allow_int4 and self.out_features % 16 == 0  # the CPU packing works on 16-row tiles
        exact = allow_int4 and all(s in self._int4_parts for s in expected) and self._same_perm(expected)
        if policy == "none":
            pass
        elif exact:
            parts = [self._int4_parts[s] for s in expected]
            q, scale, minimum = (torch.cat([p[i] for p in parts]) for i in range(3))
            self.qweight = int4.pack(q, scale, minimum, self.in_features // scale.shape[1])
            self.input_perm = self._input_perms[expected[0]]
        elif all(s in self._int8_parts for s in expected):
            q, scale = (torch.cat([self._int8_parts[s][i] for s in expected]) for i in range(2))
            self.qweight = int8.make(q, scale)
        elif policy == "int4" and allow_int4:
            self.qweight = int4.pack(*int4.quantize_rtn(self.weight.data, group_size), group_size)
        elif policy in ("int8", "int4") or (policy in ("auto", *PREQUANTIZED) and self.quantized_source):
            self.qweight = int8.quantize_rtn(self.weight.data)
        self._int4_parts, self._int8_parts, self._input_perms = {}, {}, {}
        if self.qweight is not None:
            if self.qweight.panels is not None:
                self.qweight.panels.act_bits = activation_bits
                unit = self.qweight.group_size if isinstance(self.qweight, int4.Int4Weight) else 32
                perm = self.input_perm is not None  # permuted inputs: slices are not runs of them
                self.qweight.panels.segment = 0 if perm else reduction_segment(self.in_features, unit, row_bounds)
            self.float_weight = self.weight.data if keep_float else None
            self.weight = None

    def _same_perm(self, shards: list) -> bool:
        """Fused shards run as one int4 matrix only if their inputs share one order."""
        first, *rest = [self._input_perms.get(s) for s in shards]
        return all(p is first or (p is not None and first is not None and torch.equal(p, first)) for p in rest)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return self._matmul(x, self.bias)
        # the rank's share unrounded (float64 from the int kernels): rounded once after the ranks'
        # shares are added, exactly as the whole sum rounds in one process (`reduction_segment`)
        y = self.tp_group.all_reduce(self._matmul(x, None, partial=True)).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None, partial: bool = False) -> torch.Tensor:
        q = self.qweight
        if q is None:
            return F.linear(x, self.weight, bias)
        if self.float_weight is not None and x.numel() > FLOAT_MIN_ROWS * self.in_features:
            return F.linear(x, self.float_weight, bias)
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        y = int4.matmul(x, q, partial) if isinstance(q, int4.Int4Weight) else int8.matmul(x, q, partial)
        return y if bias is None else y + bias


def reduction_segment(in_features: int, unit: int, row_bounds) -> int:
    """How many inputs the int kernels sum in float32 before adding the sums in float64 (0: all).

    Tensor parallelism splits a row-parallel projection's inputs among the ranks and adds their
    partial outputs. Summed in float32 over each slice, the total differs from one sum over all
    inputs in its last bits, and with 8-bit activations the next layer's rounding magnifies that
    into different greedy tokens. So every process sums runs of `segment` inputs that every
    possible slice bound divides (in units of the kernels' blocks or int4 groups) and adds the runs
    in float64, exact for a few float32 values: one process and N ranks add the same numbers.
    Bounds that are not whole units are left out; those slices fall back to other weights anyway.
    `in_features` is this process's share (all of them without tensor parallelism)."""
    segment = math.gcd(*(b for b in row_bounds if b % unit == 0))
    return segment if 0 < segment < in_features and in_features % segment == 0 else 0


class FusedLinear(Linear):
    """Several projections of the same input, stacked: shards in the given order."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias)
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

"""Linear layers, plain and fused (QKV, gate/up), each knowing how to load its checkpoint shards
and how to become quantized once loaded.

A fused layer stores the shards stacked along the output dimension, so one matmul replaces three
(QKV) or two (gate/up); `weight_loader(param, tensor, shard)` copies a checkpoint tensor into its
rows. Weights load as float, or stream into `quant.assembly.ShardAssembly` in the form they
will be packed in; `quantize(...)` then swaps them for one of the formats (`quant.base`).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.lora import LoRABank, step_rows
from tokenmill.quant import int4
from tokenmill.quant.assembly import QuantArgs, ShardAssembly, as_float
from tokenmill.quant.base import QuantWeight
from tokenmill.quant.gguf_tensor import BlockTensor

# PyTorch's int4/int8 CPU kernels cost time linear in the rows of x (no reuse of the unpacked weight
# across rows), so past some tens of rows a float GEMM is faster (benchmarks/kernel_bench.py).
# Past this many rows a layer that kept its float weight uses that instead.
FLOAT_MIN_ROWS = 32


_DEFERRED = [False]


@contextlib.contextmanager
def deferred_weights():
    """Layers built inside allocate no weight until one is loaded (`Linear.stream`): a model whose
    layers are packed as their weights stream in never holds a float copy of itself."""
    _DEFERRED[0] = True
    try:
        yield
    finally:
        _DEFERRED[0] = False


def deferrable_empty(*shape: int) -> nn.Parameter:
    """An empty weight of `shape`, or a 0-element stand-in of the same dtype and device when
    deferred (`materialize` gives it its storage)."""
    return nn.Parameter(torch.empty(0) if _DEFERRED[0] else torch.empty(*shape), requires_grad=False)


def materialize(param: nn.Parameter, shape: tuple[int, ...]) -> None:
    if tuple(param.shape) != tuple(shape):
        param.data = torch.empty(shape, dtype=param.dtype, device=param.device)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = deferrable_empty(out_features, in_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        self.qweight: QuantWeight | None = None
        self.float_weight: torch.Tensor | None = None  # kept for large batches when asked
        self.input_perm: torch.Tensor | None = None  # act-order GPTQ: inputs reordered so groups are contiguous
        self.shards = ShardAssembly(out_features, in_features, self.shard_offsets)  # until packed
        self.quantized_source = False  # some shard was stored quantized in the checkpoint
        self.keep_float = False  # never quantized: MoE routers (tiny, and they decide which experts run)
        # row-parallel under tensor parallelism (layers/tensor_parallel.py): the ranks' partial
        # outputs are summed by this group's all-reduce before the bias is added (once)
        self.tp_group = None
        self.stream: QuantArgs | None = None  # set: each shard is converted as it loads, packed when all are in
        self.lora: LoRABank | None = None  # adapters' slots (runner/lora.py), applied to the rows that run under one
        self._loaded: set[str | None] = set()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None,
                      int4_parts: tuple | None = None, int8_parts: tuple | None = None,
                      input_perm: torch.Tensor | None = None, quantized: bool = False) -> None:
        """`int4_parts` (q, scale, min) / `int8_parts` (q, scale): the exact quantized form of
        `loaded` (which is its dequantized float), kept so that `quantize` need not round again;
        `input_perm`: the input order the int4 parts are stored in (act-order GPTQ)."""
        full = (self.out_features, self.in_features) if param is self.weight else tuple(param.shape)
        if shard is None:
            if tuple(loaded.shape) != full:
                raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {full}")
            rows = slice(None)
        else:
            start, size = self.shard_offsets[shard]
            if loaded.shape[0] != size or tuple(loaded.shape[1:]) != full[1:]:
                raise ValueError(f"shape mismatch for shard {shard!r}: checkpoint {tuple(loaded.shape)}, "
                                 f"expected ({size}, {', '.join(map(str, full[1:]))})")
            rows = slice(start, start + size)
        if param is not self.weight:
            param.data[rows].copy_(loaded)
            return
        quantized = quantized or (isinstance(loaded, BlockTensor) and loaded.quantized)
        self.quantized_source |= quantized
        if self.stream is not None and not self.stream.needs_float(quantized):
            self.shards.add_streamed(shard, loaded, self.stream, int4_parts, int8_parts, input_perm)
        else:
            materialize(param, full)
            param.data[rows].copy_(as_float(loaded))
            keeps_float_only = self.stream is not None and self.stream.policy == "none"
            if isinstance(loaded, BlockTensor) and int4_parts is None and int8_parts is None and not keeps_float_only:
                int4_parts = loaded.int4_parts()  # Q4_0/Q4_1 stay exact
            self.shards.add(shard, int4_parts, int8_parts, input_perm)
        self._loaded.add(shard)
        if self.stream is not None and self._loaded >= set(self.shard_offsets or [None]):
            self.quantize(**vars(self.stream))

    def quantize(self, policy: str, group_size: int, allow_int4: bool = True, keep_float: bool = False,
                 activation_bits: int = 16, row_bounds: tuple[int, ...] = ()) -> None:
        """Replace the float weight by a quantized one according to `policy` (the formats:
        `quant.assembly`): auto (awq, gptq): the checkpoint's own quantized weights; int8 / int4:
        round-to-nearest for the rest too; none: keep float.
        `activation_bits` (8 | 16): what the dot kernels round inputs to (`tokenmill.kernels`).
        `row_bounds`: where tensor-parallel ranks' input slices of this (row-parallel) projection can
        begin and end, at any rank count (`tensor_parallel.row_parallel_bounds`); see `reduction_segment`."""
        if policy == "int4" and group_size not in int4.GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {int4.GROUP_SIZES}, got {group_size}.")
        if self.qweight is not None:
            return  # packed already, as its weights streamed in
        float_weight = self.weight.data if self.weight.numel() else None
        self.qweight, self.input_perm = self.shards.finish(policy, group_size, allow_int4, float_weight,
                                                           self.quantized_source)
        self.shards = ShardAssembly(self.out_features, self.in_features, self.shard_offsets)
        self.stream = None
        if self.qweight is not None:
            for w in self.qweight.leaves():
                perm = self.input_perm is not None  # permuted inputs: slices are not runs of them
                w.configure(activation_bits, 0 if perm else reduction_segment(self.in_features, w.reduction_unit,
                                                                             row_bounds))
            self.float_weight = self.weight.data if keep_float else None
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            y = self._matmul(x, self.bias)
        else:
            # the rank's share unrounded (float64 from the int kernels): rounded once after the ranks'
            # shares are added, exactly as the whole sum rounds in one process (`reduction_segment`)
            y = self.tp_group.all_reduce(self._matmul(x, None, partial=True)).to(x.dtype)
            y = y if self.bias is None else y + self.bias
        if self.lora is not None and (rows := step_rows()) is not None:
            self.lora.add_(y, x, rows)
        return y

    def part_sizes(self) -> list[int]:
        """Output sizes of the shards in order (one part for a plain projection)."""
        return [n for _, n in self.shard_offsets.values()] or [self.out_features]

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None, partial: bool = False) -> torch.Tensor:
        q = self.qweight
        if q is None:
            return F.linear(x, self.weight, bias)
        if self.float_weight is not None and x.numel() > FLOAT_MIN_ROWS * self.in_features:
            return F.linear(x, self.float_weight, bias)
        if self.input_perm is not None:
            x = x.index_select(-1, self.input_perm)
        y = q.matmul(x, partial)
        return y if bias is None else y.add_(bias)  # the kernel's output is its own: added in place


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


"""Linear layers, plain and fused (QKV, gate/up), each knowing how to load its checkpoint shards
and how to become quantized once loaded.

A fused layer stores the shards stacked along the output dimension, so one matmul replaces three
(QKV) or two (gate/up); `weight_loader(param, tensor, shard)` copies a checkpoint tensor into its
rows. Weights load as float; `quantize(...)` then swaps them for a packed int4 or int8 form:
exactly, when every shard came as GGUF Q4_0/Q4_1 blocks, or by round-to-nearest on request.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.quant import int4, int8, kquant
from tokenmill.quant.gguf_tensor import BlockTensor

QUANT_POLICIES = ("auto", "none", "int8", "int4", "awq", "gptq")
PREQUANTIZED = ("awq", "gptq")  # policies that name a checkpoint's format: they load its weights as stored
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


def as_float(loaded) -> torch.Tensor:
    return loaded.dequantize() if isinstance(loaded, BlockTensor) else loaded


@dataclass(frozen=True)
class QuantArgs:
    """How a layer is packed (`Linear.quantize`), known before its weights arrive when they stream."""
    policy: str
    group_size: int
    allow_int4: bool = True
    keep_float: bool = False
    activation_bits: int = 16
    row_bounds: tuple[int, ...] = ()


@dataclass
class RowStack:
    """Weights of different kinds stacked by output rows (a fused QKV whose V is Q6_K and Q, K are
    Q4_K, as llama.cpp's Q4_K_M mixes them): each multiplies x, the outputs are concatenated."""
    parts: list
    out_features: int
    in_features: int
    panels: None = None


def quant_matmul(x: torch.Tensor, q, partial: bool = False) -> torch.Tensor:
    """x (..., K) times any quantized weight (int4, int8, a K-quant, or a RowStack of them)."""
    if isinstance(q, int4.Int4Weight):
        return int4.matmul(x, q, partial)
    if isinstance(q, int8.Int8Weight):
        return int8.matmul(x, q, partial)
    if isinstance(q, kquant.KQuantWeight):
        return kquant.matmul(x, q, partial)
    return torch.cat([quant_matmul(x, p, partial) for p in q.parts], dim=-1)


def leaf_weights(q) -> list:
    """A quantized weight's kernel weights: itself, or a RowStack's parts."""
    return list(q.parts) if isinstance(q, RowStack) else [q]


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = deferrable_empty(out_features, in_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        self.qweight: int4.Int4Weight | int8.Int8Weight | None = None
        self.float_weight: torch.Tensor | None = None  # kept for large batches when asked
        self.input_perm: torch.Tensor | None = None  # act-order GPTQ: inputs reordered so groups are contiguous
        self._int4_parts: dict[str | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._int8_parts: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kq_parts: dict[str | None, kquant.KQuantWeight | None] = {}  # GGUF K-quant shards (None: in _kq_fused)
        self._kq_fused: kquant.KQuantWeight | None = None  # all rows, filled by the shards of its kind
        self._sources: dict[str | None, BlockTensor] = {}  # where the K-quant shards came from
        self._input_perms: dict[str | None, torch.Tensor | None] = {}
        self.quantized_source = False  # some shard was stored quantized in the checkpoint
        self.keep_float = False  # never quantized: MoE routers (tiny, and they decide which experts run)
        # row-parallel under tensor parallelism (distributed/tensor_parallel.py): the ranks' partial
        # outputs are summed by this group's all-reduce before the bias is added (once)
        self.tp_group = None
        self.stream: QuantArgs | None = None  # set: each shard is converted as it loads, packed when all are in
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
        if self.stream is not None and not self._needs_float(quantized):
            if self._kquant(loaded):
                self._pack_kquant(shard, loaded)
            else:
                int4_parts, int8_parts = self._parts_of(loaded, int4_parts, int8_parts)
        else:
            materialize(param, full)
            param.data[rows].copy_(as_float(loaded))
            keeps_float_only = self.stream is not None and self.stream.policy == "none"
            if isinstance(loaded, BlockTensor) and int4_parts is None and int8_parts is None and not keeps_float_only:
                int4_parts = loaded.int4_parts()  # Q4_0/Q4_1 stay exact
        if int4_parts is not None:
            self._int4_parts[shard] = int4_parts
            self._input_perms[shard] = input_perm
        if int8_parts is not None:
            self._int8_parts[shard] = int8_parts
        self._loaded.add(shard)
        if self.stream is not None and self._loaded >= set(self.shard_offsets or [None]):
            self.quantize(**vars(self.stream))

    def _needs_float(self, quantized: bool) -> bool:
        """Streaming: whether this layer keeps (or is packed from) its float weight."""
        a = self.stream
        return a.policy == "none" or a.keep_float or (not quantized and a.policy not in ("int8", "int4"))

    def _kquant(self, loaded) -> bool:
        """A K-quant tensor the kernels run at its own width (auto: the file's weights as they are;
        an explicit int8/int4 policy rounds them instead)."""
        return (isinstance(loaded, BlockTensor) and self.stream.policy in ("auto", *PREQUANTIZED)
                and kquant.supported(loaded.kind, *loaded.shape))

    def _pack_kquant(self, shard: str | None, loaded: BlockTensor) -> None:
        """A K-quant shard straight into the fused layer's panels when it is of the first shard's
        kind (no concatenation after), else into panels of its own."""
        self._sources[shard] = loaded
        rows, cols = loaded.shape
        start = self.shard_offsets[shard][0] if shard is not None else 0
        if self._kq_fused is None:
            self._kq_fused = kquant.empty(loaded.kind, self.out_features, cols)
        if self._kq_fused.kind == loaded.kind:
            kquant.fill(self._kq_fused, start, rows, loaded.raw)
            self._kq_parts[shard] = None
        else:
            self._kq_parts[shard] = kquant.from_blocks(loaded.kind, rows, cols, loaded.raw)

    def _kquant_weight(self, expected: list):
        """The layer's K-quant weight once every shard is in: the fused panels, or a RowStack of
        runs of one kind where the shards' kinds differ (Q4_K_M's Q4_K q, k and Q6_K v)."""
        if all(self._kq_parts[s] is None for s in expected):
            return self._kq_fused
        parts, offset, run = [], 0, None  # run: (first row, rows) of consecutive shards in the fused panels
        for s in expected:
            size, own = self.shard_offsets[s][1], self._kq_parts[s]
            if own is None:
                run = (run[0], run[1] + size) if run else (offset, size)
            else:
                if run:
                    parts.append(kquant.rows_of(self._kq_fused, *run))
                    run = None
                parts.append(own)
            offset += size
        if run:
            parts.append(kquant.rows_of(self._kq_fused, *run))
        return RowStack(parts, self.out_features, self.in_features)

    def _parts_of(self, loaded, int4_parts, int8_parts) -> tuple:
        """A shard's packed-to-be form without its float copy: the exact parts that came with it,
        the file's own 4-bit blocks, or what `quantize` would round the float to (row-local
        roundings, so shard by shard gives the same numbers as the whole weight)."""
        a = self.stream
        if int4_parts is not None or int8_parts is not None:
            return int4_parts, int8_parts
        if isinstance(loaded, BlockTensor) and (parts := loaded.int4_parts()) is not None:
            return parts, None
        if a.policy == "int4" and a.allow_int4 and self.out_features % 16 == 0:
            return int4.quantize_rtn(as_float(loaded), a.group_size), None
        return None, (loaded.int8_parts() if isinstance(loaded, BlockTensor) else int8.rtn_parts(loaded))

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
        if self.qweight is not None:
            return  # packed already, as its weights streamed in
        expected = list(self.shard_offsets) or [None]
        allow_int4 = allow_int4 and self.out_features % 16 == 0  # the CPU packing works on 16-row tiles
        exact = allow_int4 and all(s in self._int4_parts for s in expected) and self._same_perm(expected)
        if self._kq_parts and set(self._kq_parts) >= set(expected):
            self.qweight = self._kquant_weight(expected)
            self._sources = {}
        for s, src in self._sources.items():  # K-quant shards fused with shards of other types: all int8
            self._int8_parts[s] = src.int8_parts()
        self._kq_parts, self._sources, self._kq_fused = {}, {}, None
        if self.qweight is None and not exact and self.weight.numel() == 0:  # streamed without a float copy: mixed parts become int8
            for s in expected:
                if s not in self._int8_parts:
                    q, scale, minimum = self._int4_parts[s]
                    w = int4.dequantize(q, scale, minimum)
                    perm = self._input_perms.get(s)
                    self._int8_parts[s] = int8.rtn_parts(w if perm is None else w[:, torch.argsort(perm)])
        if self.qweight is not None or policy == "none":
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
        self.stream = None
        if self.qweight is not None:
            for w in leaf_weights(self.qweight):
                if w.panels is None:
                    continue
                w.panels.act_bits = activation_bits
                unit = w.group_size if isinstance(w, int4.Int4Weight) else kquant.unit(w.kind) if isinstance(w, kquant.KQuantWeight) else 32
                perm = self.input_perm is not None  # permuted inputs: slices are not runs of them
                w.panels.segment = 0 if perm else reduction_segment(self.in_features, unit, row_bounds)
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
        y = quant_matmul(x, q, partial)
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


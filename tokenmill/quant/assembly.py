"""Which format a linear layer's checkpoint shards become, decided in one place.

A layer arrives as shards (q, k, v of a fused QKV; gate, up; or one whole weight), each in its
checkpoint's form: float, GGUF blocks, AWQ/GPTQ integers. `ShardAssembly` keeps each shard, as it
loads, in the form it will be packed in (without a float copy where the layer streams: a K-quant
straight into the fused panels, Q4_0/Q4_1 and AWQ/GPTQ as exact int4 parts, other blocks as int8
parts), and `finish` picks the layer's format once every shard is in:

    every shard a GGUF block type the kernels run at its own width  -> kquant (fused, or a RowStack)
    every shard exact int4 in one input order, int4 allowed          -> int4, exact
    every shard with int8 parts (mixed shards are brought to these)  -> int8, exact or rounded once
    float, policy int4 (and int4 allowed)                            -> int4, round-to-nearest
    float, policy int8/int4, or a quantized source under auto        -> int8, round-to-nearest
    otherwise (policy none, or float under auto)                     -> float

`packed_bytes` counts the same decisions before loading, for the memory check.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.quant import int4, int8, kquant
from tokenmill.quant.base import QuantWeight, RowStack
from tokenmill.quant.gguf_tensor import BlockTensor

QUANT_POLICIES = ("auto", "none", "int8", "int4", "awq", "gptq")
PREQUANTIZED = ("awq", "gptq")  # policies that name a checkpoint's format: they load its weights as stored
FILE_FORMATS = ("auto", *PREQUANTIZED)  # policies that keep the checkpoint's own quantized weights


@dataclass(frozen=True)
class QuantArgs:
    """How a layer is packed (`Linear.quantize`), known before its weights arrive when they stream."""
    policy: str
    group_size: int
    allow_int4: bool = True
    keep_float: bool = False
    activation_bits: int = 16
    row_bounds: tuple[int, ...] = ()

    def needs_float(self, quantized: bool) -> bool:
        """Streaming: whether a shard is kept (or packed from) as float."""
        return self.policy == "none" or self.keep_float or (not quantized and self.policy not in ("int8", "int4"))


def packed_bytes(kind: str, elements: int, policy: str, keep_float: bool) -> float:
    """Bytes a projection's weight of `elements` takes once packed: `kind` is how the checkpoint
    stores it (float, q4: 4-bit blocks kept as int4, a GGUF block type, block: other integers)."""
    extra = 4 * elements if keep_float else 0
    if policy == "none":
        return 4 * elements
    if kind == "q4":
        return elements * 0.625 + extra
    if kind in kquant.PACKED_BYTES and policy in FILE_FORMATS:
        return elements * kquant.PACKED_BYTES[kind] + extra
    if kind != "float" or policy in ("int8", "int4"):
        return elements * (0.625 if policy == "int4" else 1) + extra
    return 4 * elements


def as_float(loaded) -> torch.Tensor:
    return loaded.dequantize() if isinstance(loaded, BlockTensor) else loaded


class ShardAssembly:
    """One layer's shards until `finish` (the layer owns one; `offsets` is its shard -> (first row,
    rows) map, empty for a single weight)."""

    def __init__(self, out_features: int, in_features: int, offsets: dict[str | None, tuple[int, int]]) -> None:
        self.out_features, self.in_features, self.offsets = out_features, in_features, offsets
        self.int4: dict[str | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.perms: dict[str | None, torch.Tensor | None] = {}  # act-order GPTQ: the int4 parts' input order
        self.int8: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self.blocks: dict[str | None, kquant.KQuantWeight | None] = {}  # K-quant shards (None: in `fused`)
        self.fused: kquant.KQuantWeight | None = None  # all rows, filled by the shards of its kind
        self.sources: dict[str | None, BlockTensor] = {}  # where the K-quant shards came from

    def add(self, shard: str | None, int4_parts=None, int8_parts=None, input_perm=None) -> None:
        """A shard's exact integer forms, where it has them (its float is the layer's)."""
        if int4_parts is not None:
            self.int4[shard] = int4_parts
            self.perms[shard] = input_perm
        if int8_parts is not None:
            self.int8[shard] = int8_parts

    def add_streamed(self, shard: str | None, loaded, args: QuantArgs, int4_parts=None, int8_parts=None,
                     input_perm=None) -> None:
        """A shard with no float copy: a K-quant at its own width (auto: the file's weights as they
        are; an explicit int8/int4 policy rounds them instead), else the exact parts that came
        with it, the file's 4-bit blocks, or what `finish` would round the float to (row-local
        roundings, so shard by shard gives the same numbers as the whole weight)."""
        if isinstance(loaded, BlockTensor) and args.policy in FILE_FORMATS and kquant.supported(loaded.kind, *loaded.shape):
            return self._pack_blocks(shard, loaded)
        if int4_parts is None and int8_parts is None:
            if isinstance(loaded, BlockTensor) and (parts := loaded.int4_parts()) is not None:
                int4_parts = parts
            elif args.policy == "int4" and args.allow_int4 and self.out_features % 16 == 0:
                int4_parts = int4.quantize_rtn(as_float(loaded), args.group_size)
            else:
                int8_parts = loaded.int8_parts() if isinstance(loaded, BlockTensor) else int8.rtn_parts(loaded)
        self.add(shard, int4_parts, int8_parts, input_perm)

    def _pack_blocks(self, shard: str | None, loaded: BlockTensor) -> None:
        """Into the fused panels when of the first shard's kind (no concatenation after), else
        into panels of its own."""
        self.sources[shard] = loaded
        rows, cols = loaded.shape
        start = self.offsets[shard][0] if shard is not None else 0
        if self.fused is None:
            self.fused = kquant.empty(loaded.kind, self.out_features, cols)
        if self.fused.kind == loaded.kind:
            kquant.fill(self.fused, start, rows, loaded.raw)
            self.blocks[shard] = None
        else:
            self.blocks[shard] = kquant.from_blocks(loaded.kind, rows, cols, loaded.raw)

    def finish(self, policy: str, group_size: int, allow_int4: bool, float_weight: torch.Tensor | None,
               quantized_source: bool) -> tuple[QuantWeight | None, torch.Tensor | None]:
        """(the layer's weight or None to stay float, the input permutation it needs). `float_weight`:
        the layer's float copy, None where it streamed without one."""
        expected = list(self.offsets) or [None]
        allow_int4 = allow_int4 and self.out_features % 16 == 0  # the CPU packing works on 16-row tiles
        exact = allow_int4 and all(s in self.int4 for s in expected) and self._same_perm(expected)
        if self.blocks and set(self.blocks) >= set(expected):
            return self._kquant_weight(expected), None
        for s, src in self.sources.items():  # K-quant shards fused with shards of other types: all int8
            self.int8[s] = src.int8_parts()
        if not exact and float_weight is None:  # no float to round: mixed parts become int8
            for s in expected:
                if s not in self.int8:
                    w = int4.dequantize(*self.int4[s])
                    perm = self.perms.get(s)
                    self.int8[s] = int8.rtn_parts(w if perm is None else w[:, torch.argsort(perm)])
        if policy == "none":
            return None, None
        if exact:
            parts = [self.int4[s] for s in expected]
            q, scale, minimum = (torch.cat([p[i] for p in parts]) for i in range(3))
            return int4.pack(q, scale, minimum, self.in_features // scale.shape[1]), self.perms[expected[0]]
        if all(s in self.int8 for s in expected):
            q, scale = (torch.cat([self.int8[s][i] for s in expected]) for i in range(2))
            return int8.make(q, scale), None
        if policy == "int4" and allow_int4:
            return int4.pack(*int4.quantize_rtn(float_weight, group_size), group_size), None
        if policy in ("int8", "int4") or (policy in FILE_FORMATS and quantized_source):
            return int8.quantize_rtn(float_weight), None
        return None, None

    def _kquant_weight(self, expected: list) -> QuantWeight:
        """The fused panels, or a RowStack of runs of one kind where the shards' kinds differ
        (Q4_K_M's Q4_K q, k and Q6_K v)."""
        if all(self.blocks[s] is None for s in expected):
            return self.fused
        parts, offset, run = [], 0, None  # run: (first row, rows) of consecutive shards in the fused panels
        for s in expected:
            size, own = self.offsets[s][1], self.blocks[s]
            if own is None:
                run = (run[0], run[1] + size) if run else (offset, size)
            else:
                if run:
                    parts.append(kquant.rows_of(self.fused, *run))
                    run = None
                parts.append(own)
            offset += size
        if run:
            parts.append(kquant.rows_of(self.fused, *run))
        return RowStack(parts, self.out_features, self.in_features)

    def _same_perm(self, shards: list) -> bool:
        """Fused shards run as one int4 matrix only if their inputs share one order."""
        first, *rest = [self.perms.get(s) for s in shards]
        return all(p is first or (p is not None and first is not None and torch.equal(p, first)) for p in rest)

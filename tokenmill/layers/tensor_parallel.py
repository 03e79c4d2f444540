"""How a tensor-parallel rank's model is cut (Megatron style; the collectives are in
distributed/tensor_parallel.py, which runs them):

    QKV, gate/up   column-parallel: rank r holds its output channels (its heads, its share of the
                   MLP's intermediate channels)
    o, down        row-parallel: rank r holds its slice of the input channels; the partial
                   outputs are summed by one all-reduce, then the bias (if any) is added once
    embedding,     vocabulary-parallel: each rank holds a contiguous share of the rows
    output head

Attention heads and the KV cache are split by KV head (a query head lives with its KV head),
unevenly where the KV heads do not divide, so no head is duplicated. `ShardPlan` says which slice
a rank holds; `slice_weight` cuts a checkpoint tensor (and the exact int4/int8 parts that come
with a quantized one) as it streams past the loader, so a rank never holds more than one full
tensor at a time. Here, below the models, because a model's layers are built for their shard.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("tokenmill")


def split(n: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """(start, count) of share `index` of `n` items cut into `parts` contiguous shares of whole
    `unit`s, the first shares one unit larger where they do not divide."""
    units = n // unit
    base, extra = divmod(units, parts)
    start = index * base + min(index, extra)
    return start * unit, (base + (1 if index < extra else 0)) * unit


def _unit(n: int, parts: int, prefer: tuple[int, ...] = (128, 64, 32, 16, 8, 4, 2)) -> int:
    """The largest preferred unit that divides n into at least `parts` pieces: shares of whole
    groups (int4 groups of up to 128 input channels) and whole 16-row kernel tiles."""
    return next((u for u in prefer if n % u == 0 and n // u >= parts), 1)


@dataclass(frozen=True)
class ShardPlan:
    """Which slices of the model rank `rank` of `size` holds, in the full model's indices."""
    rank: int
    size: int
    head_dim: int
    q_per_kv: int
    kv_heads: tuple[int, int]  # (first, count) of the rank's KV heads; its query heads follow them
    inter: tuple[int, int]     # (first, count) of the MLP's intermediate channels
    vocab: tuple[int, int]     # (first, count) of the vocabulary rows (embedding, output head)
    vocab_widths: tuple[int, ...]  # every rank's count of vocabulary rows (rank 0's is the largest)
    full: dict = dataclasses.field(default_factory=dict)  # full sizes of the fused layers' shards

    @classmethod
    def for_rank(cls, arch, rank: int, size: int) -> "ShardPlan":
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} of {size} is not a rank.")
        if arch.num_experts or arch.qk_norm_full:
            raise ValueError(f"tensor parallelism does not shard mixtures of experts yet ({arch.family}); "
                             f"serve this model with tensor_parallel_size 1 (data parallelism: --data-parallel-size).")
        if size > arch.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {size} exceeds the model's {arch.num_kv_heads} KV heads: every "
                             f"rank needs at least one (heads are split, never duplicated).")
        if size > arch.intermediate_size:
            raise ValueError(f"tensor_parallel_size {size} exceeds the model's MLP width {arch.intermediate_size}.")
        vocab = [split(arch.vocab_size, size, r, _unit(arch.vocab_size, size, (16, 8, 4, 2))) for r in range(size)]
        hd, groups = arch.head_dim, arch.num_heads // arch.num_kv_heads
        return cls(rank, size, hd, groups, split(arch.num_kv_heads, size, rank),
                   split(arch.intermediate_size, size, rank, _unit(arch.intermediate_size, size)), vocab[rank],
                   tuple(count for _, count in vocab),
                   {"qkv_proj": {"q": arch.num_heads * hd, "k": arch.num_kv_heads * hd, "v": arch.num_kv_heads * hd},
                    "gate_up_proj": {"gate": arch.intermediate_size, "up": arch.intermediate_size}})

    def local_arch(self, arch):
        """The rank's model: its heads, MLP channels and vocabulary rows."""
        return dataclasses.replace(arch, num_heads=self.kv_heads[1] * self.q_per_kv, num_kv_heads=self.kv_heads[1],
                                   intermediate_size=self.inter[1], vocab_size=self.vocab[1])

    def _rows(self, target: str, shard: str | None) -> tuple[int, int] | None:
        """The output rows (column-parallel) the rank holds of a tensor, or None."""
        hd, (kv0, kvn) = self.head_dim, self.kv_heads
        if target.endswith("self_attn.qkv_proj"):
            g = self.q_per_kv if shard == "q" else 1
            return kv0 * g * hd, kvn * g * hd
        if target.endswith("mlp.gate_up_proj"):
            return self.inter
        if target in ("model.embed_tokens", "lm_head"):
            return self.vocab
        return None

    def _cols(self, target: str) -> tuple[int, int] | None:
        """The input columns (row-parallel) the rank holds of a weight, or None."""
        if target.endswith("self_attn.o_proj"):
            hd, g, (kv0, kvn) = self.head_dim, self.q_per_kv, self.kv_heads
            return kv0 * g * hd, kvn * g * hd
        if target.endswith("mlp.down_proj"):
            return self.inter
        return None

    def slice_weight(self, target: str, kind: str, shard: str | None, tensor: torch.Tensor,
                     extra: dict) -> tuple[torch.Tensor, dict]:
        """The rank's slice of checkpoint tensor `target.kind` (kind: weight or bias), with its
        quantized parts cut alike. Replicated tensors (norms, row-parallel biases) come back whole."""
        rows = self._rows(target, shard)
        if rows is not None:
            start, count = rows
            out = dict(extra)
            for key in ("int4_parts", "int8_parts"):
                if out.get(key) is not None:
                    out[key] = tuple(p[start:start + count] for p in out[key])
            return tensor[start:start + count], out
        cols = self._cols(target) if kind == "weight" else None
        if cols is None:
            return tensor, extra
        start, count = cols
        out = dict(extra)
        parts, perm = out.get("int4_parts"), out.get("input_perm")
        if parts is not None:
            group = tensor.shape[1] // parts[1].shape[1]
            if perm is not None or start % group or count % group:
                # an act-order permutation or a share that cuts a group: the exact int4 form does not
                # split; the slice loads as the dequantized float it is (then int8, as other block types)
                log.warning("%s: rank %d's input channels %d..%d do not split the checkpoint's int4 groups of %d%s; "
                            "its slice is kept as int8", target, self.rank, start, start + count, group,
                            " (act-order)" if perm is not None else "")
                out["int4_parts"], out["input_perm"] = None, None
            else:
                g0, gn = start // group, count // group
                out["int4_parts"] = (parts[0][:, start:start + count], parts[1][:, g0:g0 + gn],
                                     parts[2][:, g0:g0 + gn])
        if out.get("int8_parts") is not None:  # one scale per output row: columns slice freely
            q, scale = out["int8_parts"]
            out["int8_parts"] = (q[:, start:start + count], scale)
        return tensor[:, start:start + count], out


def row_parallel_bounds(arch) -> dict[str, tuple[int, ...]]:
    """Where ranks' input slices of each row-parallel projection begin and end, over every rank
    count the model allows: {"self_attn.o_proj": bounds, "mlp.down_proj": bounds}, the whole
    projection's input count last (empty tuples when it cannot be sharded). Every process, one or
    many, sums those projections in runs that these bounds divide (layers/linear.py
    `reduction_segment`), so that TP=N adds the same numbers as TP=1."""
    attn, mlp = {arch.num_heads * arch.head_dim}, {arch.intermediate_size}
    for size in range(2, min(arch.num_kv_heads, arch.intermediate_size) + 1):
        for rank in range(1, size):
            try:
                plan = ShardPlan.for_rank(arch, rank, size)
            except ValueError:  # not shardable (mixtures of experts): one process sums as it likes
                return {"self_attn.o_proj": (), "mlp.down_proj": ()}
            attn.add(plan._cols("self_attn.o_proj")[0])
            mlp.add(plan.inter[0])
    return {"self_attn.o_proj": tuple(sorted(attn)), "mlp.down_proj": tuple(sorted(mlp))}

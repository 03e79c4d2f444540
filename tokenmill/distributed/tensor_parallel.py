"""Tensor parallelism in the Megatron style, on torch.distributed.

Each rank holds a slice of every large weight and the model runs on all ranks at once:

    QKV, gate/up   column-parallel: rank r computes its output channels (its heads, its share of
                   the MLP's intermediate channels) from the whole input; no communication
    o, down        row-parallel: rank r multiplies its slice of the input channels; one all-reduce
                   sums the partial outputs, then the bias (if any) is added once
    embedding      vocabulary-parallel: each rank looks up the ids in its rows (zeros elsewhere);
                   one all-reduce
    output head    vocabulary-parallel: each rank computes its rows' logits; rank 0 gathers them

so a decoder layer costs two all-reduces of (tokens, hidden). Attention heads and the KV cache are
split by KV head (a query head lives with its KV head), unevenly where the KV heads do not divide
(SmolLM2-135M's 3 KV heads over 2 ranks: 2 and 1), so no head is duplicated.

`ShardPlan` says which slice a rank holds; `slice_weight` cuts a checkpoint tensor (and the exact
int4/int8 parts that come with a quantized one) as it streams past the loader, so a rank never
holds more than one full tensor at a time. `TPGroup` is the rank's process group and its
collectives. Only rank 0 samples: it alone receives the gathered logits.
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


SHM_SLOT_BYTES = 4 << 20  # per rank and step of the shared-memory all-reduce; larger tensors go in chunks
SHM_MSG_BYTES = 4 << 20   # a step's message from rank 0; a larger one goes over the group instead
SHM_TIMEOUT_S = 600.0      # a rank that stays away this long mid-step fails the step


class TPGroup:
    """A rank's tensor-parallel process group and the three collectives the model uses. The
    all-reduces go through shared memory (kernels/shm.cpp) when every rank is on this host and
    the CPU kernels are built; through the group (gloo, NCCL) otherwise."""

    def __init__(self, rank: int, size: int, group, shm=None) -> None:
        self.rank, self.size, self.group, self.shm = rank, size, group, shm
        self.name = group.group_name  # how the native decode stack reaches the group (c10d functional ops)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        if self.shm is not None and x.dtype in (torch.float32, torch.float64) and x.device.type == "cpu" \
                and x.is_contiguous():
            self.shm.all_reduce_(x)
            return x
        import torch.distributed as dist
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (pickled): through shared memory where the group has it
        (an empty message there means "this one comes over the group": it was too large)."""
        import pickle

        import torch.distributed as dist
        if self.shm is not None:
            if self.rank == 0:
                data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                if self.shm.send(torch.frombuffer(bytearray(data), dtype=torch.uint8)):
                    return obj
                self.shm.send(torch.empty(0, dtype=torch.uint8))
            else:
                data = self.shm.receive()
                if data.numel():
                    return pickle.loads(data.numpy().tobytes())
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def abort(self) -> None:
        """Every rank's shared-memory wait fails from now on (a rank died)."""
        if self.shm is not None:
            self.shm.abort()

    def gather_vocab(self, local: torch.Tensor, plan: ShardPlan) -> torch.Tensor | None:
        """(N, this rank's vocabulary rows) logits -> (N, vocab) on rank 0, None on the others
        (gloo gathers equal shapes: shares are padded to the largest, rank 0's). In shared memory
        the gather is an all-reduce of each rank's rows placed in zeros: x + 0 is exact."""
        import torch.distributed as dist
        if self.shm is not None and local.dtype == torch.float32 and local.device.type == "cpu":
            first, count = plan.vocab
            full = local.new_zeros(local.shape[0], sum(plan.vocab_widths))
            full[:, first:first + count] = local
            self.shm.all_reduce_(full)
            return full if self.rank == 0 else None
        width = plan.vocab_widths[0]
        if local.shape[1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self.group)
        if self.rank:
            return None
        return torch.cat([p[:, :w] for p, w in zip(parts, plan.vocab_widths)], dim=1)


def shared_memory_all_reduce(group, rank: int, size: int):
    """The shared-memory all-reduce of a group whose ranks are all on this host (same host name
    and boot), or None: ranks on several hosts, no CPU kernels, or TOKENMILL_TP_SHM=0 (for
    comparisons with gloo)."""
    import os
    import socket
    import uuid

    import torch.distributed as dist

    from tokenmill import kernels

    host = f"{socket.gethostname()}/{_boot_id()}"
    hosts: list = [None] * size
    wanted = os.environ.get("TOKENMILL_TP_SHM", "1") != "0"
    dist.all_gather_object(hosts, (host, wanted and kernels.available()), group=group)
    if len({h for h, _ in hosts}) != 1 or not all(ok for _, ok in hosts):
        return None
    box = [None]
    if rank == 0:
        box[0] = f"/dev/shm/tokenmill-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(box[0], "wb") as f:
            f.truncate(torch.classes.tokenmill.ShmAllReduce.bytes_needed(size, SHM_SLOT_BYTES, SHM_MSG_BYTES))
    dist.broadcast_object_list(box, src=0, group=group)
    try:
        shm = torch.classes.tokenmill.ShmAllReduce(box[0], rank, size, SHM_SLOT_BYTES, SHM_MSG_BYTES, SHM_TIMEOUT_S)
    finally:
        dist.barrier(group=group)  # every rank has mapped it: the name can go
        if rank == 0:
            os.unlink(box[0])
    return shm


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""

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

Which slice a rank holds is `layers/tensor_parallel.ShardPlan`'s; here is `TPGroup`, the rank's
process group and its collectives. Only rank 0 samples: it alone receives the gathered logits.
"""
from __future__ import annotations

import torch

from tokenmill.layers.tensor_parallel import ShardPlan

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

"""The token embedding table: float, or, loaded from a block-quantized GGUF tensor on the CPU, kept
in the file's own blocks with the looked-up rows dequantized per step.

Why: a float32 copy of Llama 3's 128k x 4k table is 2.1 GB where its Q4_K blocks are 0.3 GB, and
a step looks up one row per token. The rows come out exactly as `gguf.quants.dequantize` gives
them, so a model computes the same as with the float table.
"""
from __future__ import annotations

import mmap

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import deferrable_empty, materialize
from tokenmill.quant import int8, kquant
from tokenmill.quant.assembly import FILE_FORMATS, as_float
from tokenmill.quant.gguf_tensor import BlockTensor

LOGIT_ROWS = 8192  # vocabulary rows dequantized at a time when the whole table multiplies (float head)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = deferrable_empty(num_embeddings, embedding_dim)
        self.blocks: BlockTensor | None = None   # the stored rows' bytes, when kept in the file's format
        self._raw: np.ndarray | None = None      # uint8 (V, bytes per row): those bytes, memory-mapped
        self.keep_blocks = False                 # set before loading: keep a block-quantized table as it is

    def weight_loader(self, param: nn.Parameter, loaded, shard: str | None = None, **_: object) -> None:
        shape = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded.shape) != shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {shape}")
        if self.keep_blocks and isinstance(loaded, BlockTensor) and loaded.quantized:
            self.blocks = loaded
            self._raw = loaded.mapped()
            self.weight = None
            return
        materialize(param, shape)
        param.data.copy_(as_float(loaded))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.weight is None else self.weight.dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.weight is None else self.weight.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        return self._rows(self._raw[ids.reshape(-1).cpu().numpy()]).view(*ids.shape, self.embedding_dim)

    def _rows(self, raw: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.blocks._dequantize_raw(np.ascontiguousarray(raw)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, H) times the table (the tied output head in float)."""
        if self.weight is not None:
            return F.linear(hidden, self.weight)
        out = hidden.new_empty(hidden.shape[0], self.num_embeddings)
        for r0 in range(0, self.num_embeddings, LOGIT_ROWS):
            out[:, r0:r0 + LOGIT_ROWS] = F.linear(hidden, self._rows(self._raw[r0:r0 + LOGIT_ROWS]).to(hidden.dtype))
        return out

    def head_weight(self, policy: str):
        """The table in a kernel form for the tied output head: a K-quant table as it is (the file's
        own values), else rounded to per-row int8."""
        if self.weight is not None:
            return int8.quantize_rtn(self.weight.data)
        try:
            if policy in FILE_FORMATS and kquant.supported(self.blocks.kind, *self.blocks.shape):
                return kquant.from_blocks(self.blocks.kind, *self.blocks.shape, self._raw_rows)
            return int8.make(*self.blocks.int8_parts())
        finally:
            self._release_pages()

    def _raw_rows(self, start: int, stop: int) -> np.ndarray:
        return self._raw[start:stop]

    def _release_pages(self) -> None:
        """Unmap the table's pages the head's packing read (they stay in the page cache): lookups
        then map back only the rows they read, so the table costs the process almost nothing."""
        mm = getattr(self._raw, "_mmap", None)
        if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)

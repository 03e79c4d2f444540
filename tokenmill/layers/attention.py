"""Attention over the paged KV cache, and the per-step ForwardContext that tells it where to go.

The runner builds one `AttentionMetadata` per step and installs it with `forward_context(...)`;
model forwards keep the plain `(input_ids, positions)` signature. Outside any context (or with
no cache attached) attention is dense and causal over the whole input: that path serves
perplexity evaluation and training, which need no cache.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels


@dataclass
class PrefillSegment:
    """Queries `[q_start, q_end)` of the flat batch, one request's prompt chunk, whose context
    (earlier chunks and this one) is in the cache blocks of `block_table`. The CPU kernel reads it
    there whatever `start` is, so a token's attention is the same arithmetic however the prompt was
    chunked or served from the prefix cache. Elsewhere, with no earlier context (`start` 0) the
    chunk attends causally to its own fresh keys; otherwise it gathers the context under `mask`
    (q_len, ctx_slots), True = may attend."""
    q_start: int
    q_end: int
    block_table: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    start: int = 0  # position of the chunk's first token: the cached context before it


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                      # (T,) cache slot of every token fed
    decode_idx: torch.Tensor | None = None          # (B,) flat indices of single-token decodes
    decode_block_tables: torch.Tensor | None = None  # (B, max_blocks), padded with block 0
    decode_mask: torch.Tensor | None = None          # (B, 1, 1, max_blocks*block_size) bool
    decode_context_lens: torch.Tensor | None = None  # (B,) int64 tokens in each context
    all_decode: bool = False                         # every token is a decode, in batch order
    prefills: list[PrefillSegment] = field(default_factory=list)


_CONTEXT: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata | None) -> Iterator[None]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, meta
    try:
        yield
    finally:
        _CONTEXT = prev


def get_forward_context() -> AttentionMetadata | None:
    return _CONTEXT


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Views into the runner's cache, (num_blocks, block_size, num_kv_heads, head_dim) each.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.use_kernel: bool | None = None  # the paged CPU kernels read this cache (found once)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, Hq, D), k/v: (T, Hkv, D) -> (T, Hq, D)."""
        meta = get_forward_context()
        if meta is None or self.k_cache is None:
            return _sdpa(q, k, v, self.scale, causal=True)
        if k.dtype != self.k_cache.dtype:  # attend to K/V exactly as stored, cached or fresh
            k, v = k.to(self.k_cache.dtype), v.to(self.k_cache.dtype)
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        if self.use_kernel is None:
            self.use_kernel = kernels.supports_attention(q.dtype, self.k_cache, self.num_heads)
        if meta.decode_idx is not None:
            qd = q if meta.all_decode else q[meta.decode_idx]              # (B, Hq, D)
            if self.use_kernel:  # reads the blocks in place
                od = kernels.paged_decode_attention(qd, self.k_cache, self.v_cache, meta.decode_block_tables,
                                                    meta.decode_context_lens, self.scale)
            else:
                od = decode_reference(qd, self.k_cache, self.v_cache, meta.decode_block_tables,
                                      meta.decode_mask, self.scale)
            if meta.all_decode:
                return od
            out[meta.decode_idx] = od
        for seg in meta.prefills:
            qs = q[seg.q_start:seg.q_end]
            if self.use_kernel:  # reads the context's blocks in place
                out[seg.q_start:seg.q_end] = kernels.paged_context_attention(qs, self.k_cache, self.v_cache,
                                                                             seg.block_table, seg.start, self.scale)
            elif seg.start == 0:
                out[seg.q_start:seg.q_end] = _sdpa(qs, k[seg.q_start:seg.q_end].to(q.dtype),
                                                   v[seg.q_start:seg.q_end].to(q.dtype), self.scale, causal=True)
            else:
                kc = gather_blocks(self.k_cache, seg.block_table[None]).to(q.dtype)
                vc = gather_blocks(self.v_cache, seg.block_table[None]).to(q.dtype)
                out[seg.q_start:seg.q_end] = _sdpa_batched(qs[None], kc, vc, self.scale, seg.mask[None, None])[0]
        return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V into its slot: the cache viewed as (num_slots, Hkv, D)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Gather-then-SDPA decode: copies every context into a padded (B, L, Hkv, D) batch first.
    The path for caches the kernel does not take (CUDA, bfloat16) and its reference in tests."""
    kd = gather_blocks(k_cache, block_tables).to(q.dtype)  # (B, L, Hkv, D)
    vd = gather_blocks(v_cache, block_tables).to(q.dtype)
    return _sdpa_decode(q, kd, vd, scale, mask)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(num_blocks, bs, H, D)[(B, nb)] -> contiguous context (B, nb*bs, H, D). index_select on
    whole blocks is a row memcpy: 2.3x faster here than advanced indexing."""
    b, nb = block_tables.shape
    rows = torch.index_select(cache.view(cache.shape[0], -1), 0, block_tables.reshape(-1))
    return rows.view(b, nb * cache.shape[1], *cache.shape[2:])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    # (T, H, D) -> (1, H, T, D) for SDPA and back
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)


def _sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 mask: torch.Tensor) -> torch.Tensor:
    """One query token per sequence: the query heads that share a KV head become that head's
    "query positions", so SDPA runs per KV head with no GQA expansion of K/V (1.3-1.7x faster here
    than enable_gqa at 1k-token contexts). q: (B, Hq, D), k/v: (B, L, Hkv, D), mask (B, 1, 1, L)."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)                      # (B, Hkv, Hq/Hkv, D)
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return o.reshape(b, hq, d)


def _sdpa_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor) -> torch.Tensor:
    # q: (B, Tq, Hq, D), k/v: (B, L, Hkv, D), mask broadcastable to (B, 1, Tq, L) -> (B, Tq, Hq, D)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)

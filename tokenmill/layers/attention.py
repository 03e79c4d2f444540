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

INT8_SCALE_BYTES = 4  # an int8 cache row's float32 scale, stored after its block's values
EIGHT_BIT = (torch.int8, torch.float8_e5m2)  # caches whose rows are quantized as they are written
CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
                "fp8_e5m2": torch.float8_e5m2}  # --kv-cache-dtype names


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """A cache's last dimension: head_dim, and for int8 the 4 bytes of each row's float32 scale (kept
    after the block's values: `int8_blocks`)."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


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
    lora: object | None = None  # layers.lora.LoRARows: each row's adapter slot, when some row runs under one

    def sequence_lengths(self, positions: torch.Tensor) -> torch.Tensor:
        """(T,) the sequence length in force for each token (layers/rotary.py): a decode row's own
        position + 1, a prompt chunk's last position + 1 for all its tokens."""
        lens = positions + 1
        for seg in self.prefills:
            lens[seg.q_start:seg.q_end] = positions[seg.q_end - 1] + 1
        return lens


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
    """`window` > 0: each query sees only its `window` latest positions (a sliding-window layer).
    `softcap`: scores become cap * tanh(scores / cap) before the softmax (Gemma 2); the CPU kernels
    do not implement it, so such layers take the reference path."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.window, self.softcap = window, softcap
        # Views into the runner's cache, (num_blocks, block_size, num_kv_heads, head_dim) each.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.use_kernel: bool | None = None  # the paged CPU kernels read this cache (found once)
        # int8 caches: keys stored divided by k_smooth (Hkv, D) per channel, queries multiplied by
        # q_smooth (the same, per query head) before they meet the cache (models/kv_smoothing.py)
        self.k_smooth: torch.Tensor | None = None
        self.q_smooth: torch.Tensor | None = None

    def set_key_smoothing(self, k_smooth: torch.Tensor | None) -> None:
        self.k_smooth = k_smooth
        self.q_smooth = None if k_smooth is None else \
            k_smooth.repeat_interleave(self.num_heads // self.num_kv_heads, dim=0).contiguous()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, Hq, D), k/v: (T, Hkv, D) -> (T, Hq, D)."""
        meta = get_forward_context()
        if meta is None or self.k_cache is None:
            return self._dense(q, k, v)
        if self.use_kernel is None:
            self.use_kernel = self.softcap is None and kernels.supports_attention(q.dtype, self.k_cache, self.num_heads)
        eight_bit = self.k_cache.dtype in EIGHT_BIT
        if eight_bit:  # quantized as written; attention then reads them back from the cache, fresh or not
            store_kv_quantized(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.use_kernel, self.k_smooth)
            if self.q_smooth is not None:
                q = q * self.q_smooth
        else:
            if k.dtype != self.k_cache.dtype:  # attend to K/V exactly as stored, cached or fresh
                k, v = k.to(self.k_cache.dtype), v.to(self.k_cache.dtype)
            store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)
        if meta.decode_idx is not None:
            qd = q if meta.all_decode else q[meta.decode_idx]              # (B, Hq, D)
            if self.use_kernel:  # reads the blocks in place
                od = kernels.paged_decode_attention(qd, self.k_cache, self.v_cache, meta.decode_block_tables,
                                                    meta.decode_context_lens, self.scale, self.window)
            else:
                mask = meta.decode_mask
                if self.window:
                    first = (meta.decode_context_lens - self.window)[:, None, None, None]
                    mask = mask & (torch.arange(mask.shape[-1], device=mask.device) >= first)
                od = decode_reference(qd, self.k_cache, self.v_cache, meta.decode_block_tables,
                                      mask, self.scale, self.softcap, self.head_dim)
            if meta.all_decode:
                return od
            out[meta.decode_idx] = od
        for seg in meta.prefills:
            qs = q[seg.q_start:seg.q_end]
            if self.use_kernel:  # reads the context's blocks in place
                out[seg.q_start:seg.q_end] = kernels.paged_context_attention(
                    qs, self.k_cache, self.v_cache, seg.block_table, seg.start, self.scale, self.window)
            elif seg.start == 0 and not eight_bit:
                out[seg.q_start:seg.q_end] = self._dense(qs, k[seg.q_start:seg.q_end].to(q.dtype),
                                                         v[seg.q_start:seg.q_end].to(q.dtype))
            else:
                kc = read_blocks(self.k_cache, seg.block_table[None], self.head_dim, q.dtype)
                vc = read_blocks(self.v_cache, seg.block_table[None], self.head_dim, q.dtype)
                mask = seg.mask
                if mask is None:  # a first chunk read back from an 8-bit cache: causal over its own keys
                    mask = torch.arange(kc.shape[1], device=qs.device)[None, :] <= \
                        torch.arange(qs.shape[0], device=qs.device)[:, None]
                if self.window:
                    q_pos = torch.arange(seg.start, seg.start + qs.shape[0], device=mask.device)
                    mask = mask & (torch.arange(mask.shape[1], device=mask.device)[None, :] > q_pos[:, None] - self.window)
                out[seg.q_start:seg.q_end] = _attend(qs[None], kc, vc, self.scale, mask[None, None], self.softcap)[0]
        return out

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of q (T, Hq, D) over k/v (T, Hkv, D) of the same tokens, with the
        layer's window and soft-capping."""
        if not self.window and self.softcap is None:
            return _sdpa(q, k, v, self.scale, causal=True)
        i = torch.arange(q.shape[0], device=q.device)
        mask = i[None, :] <= i[:, None]
        if self.window:
            mask &= i[None, :] > i[:, None] - self.window
        return _attend(q[None], k[None], v[None], self.scale, mask[None, None], self.softcap)[0]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V into its slot: the cache viewed as (num_slots, Hkv, D)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def store_kv_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, use_kernel: bool, k_smooth: torch.Tensor | None = None) -> None:
    """Write each token's K/V into an 8-bit cache, quantized as they are written (K divided by
    `k_smooth` first, where given): on CPU in one pass per row by the kernels' store_kv, elsewhere (or
    where the kernels do not serve) by PyTorch ops that round the same way."""
    if use_kernel and k.dtype == torch.float32:
        kernels.store_kv(k, v, k_cache, v_cache, slot_mapping, k_smooth)
        return
    if k_smooth is not None:
        k = k.float() / k_smooth
    for x, cache in ((k, k_cache), (v, v_cache)):
        values, scales = quantize_rows(x, cache.dtype)
        if scales is None:  # fp8: whole rows, as bytes (index_copy_ has no float8 kernels)
            cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, values.view(torch.uint8))
            continue
        data, scale = int8_blocks(cache)
        blk, off = slot_mapping // cache.shape[1], slot_mapping % cache.shape[1]
        data[blk, off] = values
        scale[blk, off] = scales


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(T, H, D) -> (values, scales) in an 8-bit cache's format. int8: q = round(x / s) with
    s = max|x| / 127 per row (one token's head; a zero row: s = 0), scales (T, H) float32;
    fp8_e5m2: a cast (nearest even), no scales."""
    x = x.float()
    if dtype != torch.int8:
        return x.to(dtype), None
    s = x.abs().amax(dim=-1) / 127.0
    nz = s[..., None] > 0
    q = torch.where(nz, torch.round(x / torch.where(nz, s[..., None], 1.0)).clamp(-127, 127), 0.0)
    return q.to(torch.int8), s


def int8_blocks(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache (num_blocks, bs, H, D + 4) as what its blocks hold: (num_blocks, bs, H, D) values,
    then the float32 scales head by head, returned as a (num_blocks, bs, H) view; each block's values
    before its scales (kernels/attention.h: rows on the cache-line boundaries a float16 cache's have,
    a KV head's scales on one line)."""
    nb, bs, h, w = cache.shape
    d = w - INT8_SCALE_BYTES
    flat = cache.view(nb, bs * h * w)
    scales = flat[:, bs * h * d:].view(torch.float32).view(nb, h, bs).transpose(1, 2)
    return flat[:, :bs * h * d].view(nb, bs, h, d), scales


def dequantize_blocks(blocks: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache blocks (N, bs, H, width) in any cache dtype -> their values (N, bs, H, head_dim) as `dtype`."""
    if blocks.dtype != torch.int8:
        return blocks.to(dtype)
    data, scales = int8_blocks(blocks)
    return (data.float() * scales[..., None]).to(dtype)


def read_blocks(cache: torch.Tensor, block_tables: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The contexts of `block_tables` (B, nb) as values: (B, nb*bs, Hkv, head_dim) in `dtype`."""
    raw = cache.view(torch.uint8) if cache.dtype in EIGHT_BIT else cache  # as bytes: no float8 index kernels on some devices
    blocks = gather_blocks(raw, block_tables).view(cache.dtype).view(-1, *cache.shape[1:])  # (B*nb, bs, Hkv, width)
    return dequantize_blocks(blocks, head_dim, dtype).view(*block_tables.shape[:1], -1, cache.shape[2], head_dim)


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     mask: torch.Tensor, scale: float, softcap: float | None = None,
                     head_dim: int | None = None) -> torch.Tensor:
    """Gather-then-SDPA decode: copies every context into a padded (B, L, Hkv, D) batch first.
    The path for caches the kernel does not take (CUDA, bfloat16) and its reference in tests."""
    d = q.shape[-1] if head_dim is None else head_dim
    kd = read_blocks(k_cache, block_tables, d, q.dtype)  # (B, L, Hkv, D)
    vd = read_blocks(v_cache, block_tables, d, q.dtype)
    if softcap is not None:
        return _attend(q[:, None], kd, vd, scale, mask, softcap)[:, 0]
    return _sdpa_decode(q, kd, vd, scale, mask)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(num_blocks, bs, H, D)[(B, nb)] -> contiguous context (B, nb*bs, H, D). index_select on
    whole blocks is a row memcpy, faster than advanced indexing."""
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
    "query positions", so SDPA runs per KV head with no GQA expansion of K/V (faster than
    enable_gqa at long contexts). q: (B, Hq, D), k/v: (B, L, Hkv, D), mask (B, 1, 1, L)."""
    b, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d)                      # (B, Hkv, Hq/Hkv, D)
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return o.reshape(b, hq, d)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor,
            softcap: float | None = None) -> torch.Tensor:
    """q: (B, Tq, Hq, D), k/v: (B, L, Hkv, D), mask (True = may attend) broadcastable to
    (B, 1, Tq, L) -> (B, Tq, Hq, D). SDPA, or written out when scores are soft-capped."""
    if softcap is None:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)
    group = q.shape[2] // k.shape[2]
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)  # (B, Hq, L, D)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(q.transpose(1, 2), kt.transpose(2, 3)) * scale
    s = torch.tanh(s / softcap) * softcap
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, vt).transpose(1, 2)

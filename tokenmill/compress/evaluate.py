"""Perplexity with a sliding window: the yardstick for every compression step.

Windows of `context_len` tokens advance by `stride`; each window scores only the tokens that no
earlier window scored, with up to `context_len - stride` tokens of left context (Hugging Face's
recipe), so the number is comparable across tools. `chunked_perplexity` is llama.cpp's `llama-perplexity`
recipe instead, token for token: the number to hold against that tool's on the same file.

With a KV cache dtype (`paged_cache`), each window is fed in chunks through a paged cache of that
dtype, as a server's chunked prefill feeds a prompt: every token's attention then reads the K/V of
the tokens before it back from the cache, rounded as the cache stores them (an 8-bit cache's
rounding shows in the number; without a cache attention sees float K/V).
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Iterator

import torch

from tokenmill.layers.attention import CACHE_DTYPES, AttentionMetadata, PrefillSegment, forward_context, row_width
from tokenmill.models import kv_smoothing
from tokenmill.models.llama import CausalLM

Scorer = Callable[[torch.Tensor], torch.Tensor]  # a window's token ids (L,) -> its logits (L, vocab)


def dense_scorer(model: CausalLM) -> Scorer:
    """One forward over the whole window, attention over float K/V (no cache)."""
    return lambda window: model.compute_logits(model(window, torch.arange(len(window), device=window.device)))


@contextlib.contextmanager
def paged_cache(model: CausalLM, kv_cache_dtype: str, context_len: int, chunk: int = 32,
                block_size: int = 16) -> Iterator[Scorer]:
    """A scorer that feeds each window `chunk` tokens at a time through a paged KV cache of
    `kv_cache_dtype` (float16, bfloat16, float32, int8, fp8_e5m2) big enough for one window, attached
    to the model's attention layers while the block runs (their own caches, if any, put back after)."""
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(CACHE_DTYPES)}; got {kv_cache_dtype!r}.")
    if chunk < 1:
        raise ValueError(f"the chunk must hold at least one token; got {chunk}.")
    dtype, layers = CACHE_DTYPES[kv_cache_dtype], model.attention_layers()
    device = model.model.embed_tokens.device
    nb = -(-context_len // block_size)
    shape = (nb, block_size, layers[0].num_kv_heads, row_width(layers[0].head_dim, dtype))
    saved = [(a.k_cache, a.v_cache, a.use_kernel, a.k_smooth) for a in layers]
    for a in layers:
        a.k_cache, a.v_cache = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        a.use_kernel = None
    # as a server's cache: int8 keys smoothed (models/kv_smoothing.py)
    kv_smoothing.attach(model, kv_smoothing.key_scales(model) if dtype == torch.int8 else None)
    table = torch.arange(nb, device=device)  # block i holds positions [16 i, 16 i + 16): slot = position

    def score(window: torch.Tensor) -> torch.Tensor:
        if len(window) > nb * block_size:
            raise ValueError(f"a window of {len(window)} tokens is longer than the cache ({nb * block_size}).")
        logits = []
        for start in range(0, len(window), chunk):
            end = min(len(window), start + chunk)
            pos = torch.arange(start, end, device=device)
            seg = PrefillSegment(0, end - start, block_table=table[:-(-end // block_size)], start=start)
            if start > 0:  # the PyTorch path's mask over the context (the kernels read positions)
                seg.mask = torch.arange(len(seg.block_table) * block_size, device=device)[None, :] <= pos[:, None]
            with forward_context(AttentionMetadata(slot_mapping=pos, prefills=[seg])):
                logits.append(model.compute_logits(model(window[start:end], pos)))
        return torch.cat(logits)

    try:
        yield score
    finally:
        for a, (k, v, use, smooth) in zip(layers, saved):
            a.k_cache, a.v_cache, a.use_kernel = k, v, use
            a.set_key_smoothing(smooth)


@torch.inference_mode()
def perplexity(model: CausalLM, token_ids: list[int], context_len: int = 512, stride: int = 256,
               progress: bool = True, scorer: Scorer | None = None) -> dict:
    if context_len < 2 or not 0 < stride <= context_len:
        raise ValueError(f"need context_len >= 2 and 0 < stride <= context_len; got {context_len}, {stride}.")
    if len(token_ids) < 2:
        raise ValueError("the evaluation text has fewer than 2 tokens.")
    device = model.model.embed_tokens.device
    scorer = scorer or dense_scorer(model)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    starts = list(range(0, max(1, len(ids) - 1), stride))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(starts), desc="perplexity", unit="window")
    nll, counted, prev_end = 0.0, 0, 0
    t0 = time.perf_counter()
    for start in starts:
        end = min(start + context_len, len(ids))
        window = ids[start:end]
        logits = scorer(window)
        targets = window[1:]
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, targets[:, None])[:, 0]
        new = end - max(prev_end, start + 1)  # tokens not scored by an earlier window
        if new > 0:
            nll -= logprobs[-new:].sum().item()
            counted += new
        prev_end = end
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"ppl {math.exp(nll / max(counted, 1)):.3f}")
        if end == len(ids):
            break
    if bar is not None:
        bar.close()
    return {"perplexity": math.exp(nll / counted), "nll_per_token": nll / counted, "tokens_scored": counted,
            "context_len": context_len, "stride": stride, "elapsed_s": time.perf_counter() - t0}


@torch.inference_mode()
def chunked_perplexity(model: CausalLM, token_ids: list[int], context_len: int = 512, bos_id: int | None = None,
                       max_chunks: int | None = None, scorer: Scorer | None = None) -> dict:
    """llama-perplexity's default: non-overlapping chunks of `context_len` tokens of the text
    tokenized with its special tokens; each chunk's first token replaced by BOS when the
    tokenizer adds one; only the second half of each chunk scored (every scored token has at
    least context_len / 2 tokens of context)."""
    if context_len < 4:
        raise ValueError(f"need context_len >= 4; got {context_len}.")
    chunks = len(token_ids) // context_len
    if max_chunks is not None:
        chunks = min(chunks, max_chunks)
    if chunks < 1:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one chunk of {context_len}.")
    device = model.model.embed_tokens.device
    scorer = scorer or dense_scorer(model)
    first = context_len // 2
    nll, counted, t0 = 0.0, 0, time.perf_counter()
    for i in range(chunks):
        window = torch.tensor(token_ids[i * context_len:(i + 1) * context_len], dtype=torch.long, device=device)
        if bos_id is not None:
            window[0] = bos_id
        logits = scorer(window)
        logprobs = torch.log_softmax(logits[first:-1].float(), dim=-1)
        nll -= logprobs.gather(1, window[first + 1:, None])[:, 0].sum().item()
        counted += context_len - 1 - first
    return {"perplexity": math.exp(nll / counted), "nll_per_token": nll / counted, "tokens_scored": counted,
            "context_len": context_len, "chunks": chunks, "scoring": "chunks",
            "elapsed_s": time.perf_counter() - t0}

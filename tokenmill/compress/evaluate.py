"""Perplexity with a sliding window: the yardstick for every compression step.

Windows of `context_len` tokens advance by `stride`; each window scores only the tokens that no
earlier window scored, with up to `context_len - stride` tokens of left context (Hugging Face's
recipe), so the number is comparable across tools. `chunked_perplexity` is llama.cpp's `llama-perplexity`
recipe instead, token for token: the number to hold against that tool's on the same file.
"""
from __future__ import annotations

import math
import time

import torch

from tokenmill.models.llama import CausalLM


@torch.inference_mode()
def perplexity(model: CausalLM, token_ids: list[int], context_len: int = 512, stride: int = 256,
               progress: bool = True) -> dict:
    if context_len < 2 or not 0 < stride <= context_len:
        raise ValueError(f"need context_len >= 2 and 0 < stride <= context_len; got {context_len}, {stride}.")
    if len(token_ids) < 2:
        raise ValueError("the evaluation text has fewer than 2 tokens.")
    device = model.model.embed_tokens.device
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
        logits = model.compute_logits(model(window, torch.arange(len(window), device=device)))
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
                       max_chunks: int | None = None) -> dict:
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
    first = context_len // 2
    nll, counted, t0 = 0.0, 0, time.perf_counter()
    for i in range(chunks):
        window = torch.tensor(token_ids[i * context_len:(i + 1) * context_len], dtype=torch.long, device=device)
        if bos_id is not None:
            window[0] = bos_id
        logits = model.compute_logits(model(window, torch.arange(context_len, device=device)))
        logprobs = torch.log_softmax(logits[first:-1].float(), dim=-1)
        nll -= logprobs.gather(1, window[first + 1:, None])[:, 0].sum().item()
        counted += context_len - 1 - first
    return {"perplexity": math.exp(nll / counted), "nll_per_token": nll / counted, "tokens_scored": counted,
            "context_len": context_len, "chunks": chunks, "scoring": "chunks",
            "elapsed_s": time.perf_counter() - t0}

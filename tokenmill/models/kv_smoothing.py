"""Key smoothing for the int8 KV cache: QServe's SmoothAttention, applied after RoPE at run time.

Some models' keys carry a few channels far larger than the rest (Qwen2.5's: its key biases). A row
scale set by its largest element then rounds every other channel of the row coarsely: on
Qwen2.5-Coder-0.5B an int8 cache cost 3-4 % perplexity (benchmarks/kv_cache.sh). So each layer's keys
are divided, channel by channel, by λ (their typical magnitude) before they are rounded, and the
queries multiplied by it: q·k = (q λ)·(k / λ), the same scores, with flat rows to round. λ is measured
once, when the cache is made, on a prompt of a few seeded random tokens (the large channels are the
model's, not the text's) run through the cache as any prompt is (so the ranks of a tensor-parallel
group see the bits one process would): per KV head and channel the largest |k|, shared by the two channels
RoPE rotates together (a pair trades magnitude as positions advance), and never below the head's
median (only the large channels are pulled in), rounded to a power of two (dividing and multiplying
by it are then exact). The calibration prompt's K/V land in the cache's first blocks, which are free:
requests overwrite them.
"""
from __future__ import annotations

import torch

from tokenmill.layers.attention import AttentionMetadata, PrefillSegment, forward_context
from tokenmill.models.llama import CausalLM

CALIBRATION_TOKENS = 64


@torch.inference_mode()
def key_scales(model: CausalLM, tokens: int = CALIBRATION_TOKENS, seed: int = 0) -> list[torch.Tensor]:
    """λ (Hkv, D) float32 for each attention layer, from one prompt of up to `tokens` random token
    ids through the model's paged cache (attached, free). Under tensor parallelism every rank runs
    the same prompt (its collectives with it) and gets its own heads' λ."""
    layers = model.attention_layers()
    cache = layers[0].k_cache
    block_size = cache.shape[1]
    tokens = min(tokens, cache.shape[0] * block_size)
    seen: dict[int, torch.Tensor] = {}

    def grab(i: int):
        def hook(_module, args, _out):
            seen[i] = args[1].float().abs().amax(dim=0)  # k (T, Hkv, D) after RoPE
        return hook

    handles = [a.register_forward_hook(grab(i)) for i, a in enumerate(layers)]
    try:
        device = cache.device
        vocab = model.cfg.vocab_size if model.plan is None else sum(model.plan.vocab_widths)  # a rank's cfg: its share
        ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(seed)).to(device)
        pos = torch.arange(tokens, device=device)
        table = torch.arange(-(-tokens // block_size), device=device)
        meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSegment(0, tokens, block_table=table)])
        with forward_context(meta):
            model(ids, pos)
    finally:
        for h in handles:
            h.remove()
    half = model.cfg.rope_dim // 2
    scales = []
    for i in range(len(layers)):
        m = seen[i].clone()
        pair = torch.maximum(m[:, :half], m[:, half:2 * half])
        m[:, :half], m[:, half:2 * half] = pair, pair
        m = torch.maximum(m, m.median(dim=-1, keepdim=True).values)
        m = torch.where(m > 0, m, torch.ones_like(m))
        scales.append(torch.exp2(torch.round(torch.log2(m))).contiguous())  # powers of two: see the module's doc
    return scales


def attach(model: CausalLM, scales: list[torch.Tensor] | None) -> None:
    """Give each attention layer its λ (None: take smoothing away)."""
    for attn, lam in zip(model.attention_layers(), scales or [None] * len(model.attention_layers())):
        attn.set_key_smoothing(lam)

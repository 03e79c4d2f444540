"""Batched sampler: one call per step for every request that samples, each with its own params.

Sampling uses the exponential race (argmax of p / q with q ~ Exp(1)), which draws exactly from p
and lets a seeded row take its noise from a generator seeded for that row alone: `noise_seed`
mixes the request's seed with the index of the output token, so a seeded request's output
depends on its seed alone — not on whatever else shares the batch, nor on how many tokens a step
produced (speculative decoding samples several positions of one request in one step). Logprobs are
those of the model's raw distribution (before penalties and temperature), as in vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill import kernels
from tokenmill.sampling_params import SamplingParams


_MASK64 = 2**64 - 1


def noise_seed(seed: int, index: int) -> int:
    """The generator seed of output token `index` of a request seeded with `seed` (splitmix64 of
    the pair, so neighbouring seeds and indices give unrelated streams)."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class SamplingRow:
    params: SamplingParams
    token_ids: list[int]        # prompt + output so far (for penalties)
    prompt_len: int
    seed: int | None            # noise_seed of this row's draw, None: the global generator
    banned: list[int]           # token ids that may not be sampled now (EOS before min_tokens)
    allowed: torch.Tensor | None = None  # structured outputs: int32 bitmask of the tokens it may take


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                    # (N,)
    logprobs: torch.Tensor | None = None       # (N,) logprob of the sampled token
    ranks: torch.Tensor | None = None          # (N,) its rank, 1 = most likely
    top_ids: torch.Tensor | None = None        # (N, K)
    top_logprobs: torch.Tensor | None = None   # (N, K)


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, seed: int) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = self._generators[device] = torch.Generator(device=device)
        return g.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: (N, V) float32, one row per entry of `rows`."""
        max_k = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if max_k is not None else None

        logits = self.adjust(logits, rows)
        tokens = _argmax(logits)
        if not all(r.params.greedy for r in rows):
            greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
            sampled = self.race(self.probs(logits, rows), [r.seed for r in rows])
            tokens = torch.where(greedy, tokens, sampled)

        out = SamplerOutput(token_ids=tokens)
        if raw_logprobs is not None:
            out.logprobs, out.ranks, out.top_logprobs, out.top_ids = token_logprobs(raw_logprobs, tokens, max_k)
        return out

    def distribution(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """(N, V) the distribution each (non-greedy) row samples from, normalised."""
        return self.probs(self.adjust(logits, rows), rows)

    def adjust(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Logit bias in, tokens outside a row's grammar mask and banned tokens out, penalties in:
        the logits greedy rows take the argmax of."""
        if any(r.banned or r.allowed is not None or r.params.logit_bias for r in rows):
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.params.logit_bias:
                    ids = torch.tensor(list(r.params.logit_bias), device=logits.device)
                    logits[i, ids] += torch.tensor(list(r.params.logit_bias.values()), device=logits.device)
                if r.banned:
                    logits[i, r.banned] = float("-inf")
            constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
            if constrained:
                allowed = _unpack_bits(torch.stack([rows[i].allowed for i in constrained]), logits.shape[1])
                idx = torch.tensor(constrained, device=logits.device)
                logits[idx] = logits[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
        if any(r.params.needs_penalties for r in rows):
            logits = _apply_penalties(logits, rows)
        return logits

    def probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k / top-p, min-p applied to adjusted logits; rows sum to 1."""
        device = logits.device
        temps = torch.tensor([r.params.temperature if r.params.temperature > 0 else 1.0 for r in rows],
                             device=device)
        logits = logits / temps[:, None]
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
            logits = _top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        if any(r.params.min_p > 0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def race(self, probs: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
        """One draw per row of `probs` (any non-negative weights): argmax of probs / Exp(1) noise,
        the noise of a seeded row from its own seed."""
        device = probs.device
        q = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seeds) if s is None]
        if unseeded:
            q[unseeded] = torch.empty((len(unseeded), q.shape[1]), device=device).exponential_()
        for i, s in enumerate(seeds):
            if s is not None:
                q[i].exponential_(generator=self._generator(device, s))
        return _argmax(probs / q)

    def uniform(self, n: int, seeds: list[int | None], device: torch.device) -> torch.Tensor:
        """n uniforms in [0, 1), seeded ones from their own seeds."""
        u = torch.rand(n, device=device)
        for i, s in enumerate(seeds):
            if s is not None:
                u[i] = torch.rand(1, device=device, generator=self._generator(device, s))[0]
        return u


def token_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, k: int):
    """Row i's logprob of tokens[i], its rank (1 = most likely) and, for k > 0, the row's top-k
    (logprobs, ids); (None, None) for k = 0."""
    chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
    ranks = (raw_logprobs > chosen[:, None]).sum(dim=-1) + 1
    top_lps, top_ids = raw_logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    return chosen, ranks, top_lps, top_ids


_SHIFTS = torch.arange(32, dtype=torch.int32)


def _unpack_bits(words: torch.Tensor, width: int) -> torch.Tensor:
    """(N, W) int32 bitmasks (bit j of word w = token 32 w + j, llguidance's layout) -> (N, width) bool."""
    return ((words[:, :, None] >> _SHIFTS) & 1).view(words.shape[0], -1)[:, :width].bool()


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row argmax: tokenmill's CPU kernel where it runs (torch.argmax is a noticeable part of a
    batched decode step at a vocabulary's width), else PyTorch's."""
    if x.dim() == 2 and kernels.usable_for(x) and x.stride(1) == 1:
        return kernels.argmax(x)
    return x.argmax(dim=-1)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt + output (divide positive logits, multiply negative ones, as
    in the CTRL paper and HF); frequency / presence penalties over output tokens (OpenAI)."""
    n, vocab = logits.shape
    device = logits.device
    seen = torch.zeros((n, vocab), dtype=torch.bool, device=device)
    counts = torch.zeros((n, vocab), dtype=logits.dtype, device=device)
    for i, r in enumerate(rows):
        if not r.params.needs_penalties:
            continue
        ids = torch.tensor(r.token_ids, dtype=torch.long, device=device)
        seen[i, ids] = True
        out_ids = ids[r.prompt_len:]
        counts[i].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * counts - pres * (counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask everything outside each row's top-k and its top-p nucleus (the smallest set whose
    probability reaches p; the most likely token always stays)."""
    device = logits.device
    vocab = logits.shape[1]
    k = torch.tensor([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows], device=device)
    p = torch.tensor([r.params.top_p for r in rows], device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = drop | (mass_before >= p[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)

"""Accepting draft tokens so that the output distribution is exactly the target model's.

Point-mass drafts (prompt lookup, or any proposer that offers one token with certainty): the
target samples every scored position from its own distribution p (greedy: its argmax) and the
drafts are accepted while they equal those samples. That is the standard rule — accept draft d
with probability min(1, p(d)/q(d)) = p(d) since q(d) = 1, and on rejection draw from the
normalised residual (p - q)+, which is p without d — because a sample x ~ p equals d with
probability p(d), and when it does not, x is distributed as p conditioned on x != d. The first
rejected position's sample is the step's extra token; after k accepted drafts the sample at the
last position is the bonus token.

Drafts sampled from a draft model's distribution q take the general rule, `accept_with_probs`.
"""
from __future__ import annotations

from typing import Callable

import torch


# Seeded requests draw the draft model's samples and the acceptance uniforms from streams of
# their own (the request's seed xor these), independent of the target's sampling noise.
DRAFT_SALT = 0x5DEECE66D
ACCEPT_SALT = 0x2545F4914F6CDD1D


def accept_point_mass(drafts: list[int], sampled: list[int]) -> list[int]:
    """`sampled[i]`: the target's sample after the first i drafts (len(drafts) + 1 of them).
    Returns the emitted tokens: the accepted drafts, then the target's own token."""
    assert len(sampled) == len(drafts) + 1
    j = 0
    while j < len(drafts) and sampled[j] == drafts[j]:
        j += 1
    return sampled[:j + 1]


def accept_with_probs(drafts: list[int], p: torch.Tensor, q: torch.Tensor, u: list[float],
                      residual_draw: Callable[[torch.Tensor, int], int]) -> list[int]:
    """The standard rule for drafts sampled from a distribution q (a draft model).

    p: (k + 1, V) the target's distributions after each draft prefix; q: (k, V) the draft's
    distributions the drafts were drawn from; u: k uniforms in [0, 1). Draft i is accepted with
    probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the step's token is drawn from
    the residual (p_i - q_i)+ (normalised by the draw), and after k acceptances the bonus token from
    p_k. `residual_draw(weights, i)` draws one token for position i. The emitted tokens are then
    distributed exactly as k + 1 tokens sampled from the target one by one."""
    k = len(drafts)
    idx = torch.arange(k, device=p.device)
    d = torch.tensor(drafts, dtype=torch.long, device=p.device)
    p_d, q_d = p[idx, d].tolist(), q[idx, d].tolist()
    for i in range(k):
        if u[i] * q_d[i] < p_d[i]:
            continue
        residual = (p[i] - q[i]).clamp_(min=0.0)
        if not residual.sum() > 0:  # p == q up to rounding: the residual is p itself
            residual = p[i]
        return drafts[:i] + [residual_draw(residual, i)]
    return drafts + [residual_draw(p[k], k)]

"""Chunk sizes for long prompts that keep decoding requests flowing.

A token budget alone cannot bound the decoders' inter-token latency across model sizes: the same
256-token chunk is a few tens of milliseconds on a 135M model and over a second on a 3B one, where a
decode step of 8 requests is a fifth of that. While requests decode, a prompt longer than the
budget (it is chunked anyway) takes per step only the tokens that keep the step at about
`slowdown` times a decode-only step, sized from measured step times: the decode-only step and the
cost of each prompt token on top of it, both as moving averages (they drift as the context grows
and as other work comes and goes). Prompts within the budget, and long ones with nobody decoding,
still take the whole budget: their time to first token is what matters then.

The estimates come from the runner's step times (forward pass and sampling), which the scheduler
passes here after each step; no torch, no clock of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

# Smallest paced chunk: a prompt chunk this large stays on the matrix units' path on CPUs with AMX
# (kernels.AMX_MIN_ROWS and the larger minimum of small products) and costs little more per token
# than a whole chunk; a first guess before any mixed step is timed.
MIN_CHUNK = 32
WEIGHT = 0.5  # of the newest sample in the moving averages: step times vary run to run (a noisy VM's)


@dataclass
class PrefillPacer:
    slowdown: float                 # a mixed step's target, in decode-only steps (> 1)
    decode_s: float | None = None   # a decode-only step's time, moving average
    token_s: float | None = None    # each prompt token's time on top of a decode-only step, moving average

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """One step's composition and time: decode-only steps time the base; steps that also
        prefilled beside decoders time the tokens (prompt-only steps tell neither: their time is
        mostly the weights' pass, which a decode step pays too)."""
        if decode_rows and not prompt_tokens:
            self.decode_s = _average(self.decode_s, seconds)
        elif decode_rows and prompt_tokens and self.decode_s is not None:
            self.token_s = _average(self.token_s, max(seconds - self.decode_s, 0.0) / prompt_tokens)

    def chunk(self, budget: int) -> int:
        """Prompt tokens that long prompts may take, together, in a step beside decoding requests."""
        if self.decode_s is None or self.token_s is None:
            return min(budget, MIN_CHUNK)
        if self.token_s <= 0.0:
            return budget
        room = (self.slowdown - 1.0) * self.decode_s / self.token_s
        return max(min(budget, MIN_CHUNK), min(budget, int(room)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)

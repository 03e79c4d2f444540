"""How many draft tokens each request proposes for its next step. No torch here.

A decode step's time grows with the rows it scores: t(R) = t0 * (1 + ROW_COST * (R - 1)) is a
fair fit on the CPU kernels (benchmarks/verify_rows.py; RESULTS.md has the figures), where one
row costs t0 because every weight is read once per step whatever the row count, and each further
row adds the arithmetic on it. A request verifying k drafts adds k rows and is expected to gain
E(k) - 1 tokens, where E(k) = (1 - a^(k+1)) / (1 - a) when each draft is accepted with
probability a (given the ones before it were: the first rejection ends the run). At a batch of B
running requests a token costs t(B) / B, so the policy picks the k in [0, num_speculative_tokens]
that maximises

    (E(k) - 1) * t(B) / B  -  k * ROW_COST * t0,

the time saved minus the time spent. A draft model also spends its own steps: k drafts cost k
of them, each `draft_cost` of a target step at the same batch, so with a draft model the saving
is (E(k) - 1 - k * draft_cost) * t(B) / B. The draft cost starts as the ratio of the weight bytes
the two read per step and is then measured, as is every proposer's: the runner times the target's
decode steps and the proposer's passes (`observe_timing`). At batch 1 drafts are cheap and long ones pay; as the batch
grows a token's share of the step shrinks while a draft row costs the same, so k falls, and with
low acceptance it reaches 0. Each request keeps a decaying estimate of its own a. A request
whose drafts stopped paying proposes one draft every `PROBE_EVERY` steps, so a change in the text
(a quoted passage starts) brings speculation back. `disable_by_batch_size` (vLLM's switch) turns
drafts off outright above a batch size.
"""
from __future__ import annotations

from tokenmill.core.request import Request
from tokenmill.core.sched_output import StepTiming

ROW_COST = 0.17     # an extra row of a decode step, in one-row steps (benchmarks/verify_rows.py)
DECAY = 0.8         # weight of the past in the acceptance estimate, per verified step
PRIOR = (1.5, 2.0)  # (accepted, trials) a new request starts from: a = 0.75
PROBE_EVERY = 8


def _ema(old: float | None, new: float, weight: float = 0.9) -> float:
    return new if old is None else weight * old + (1.0 - weight) * new


def expected_tokens(a: float, k: int) -> float:
    """Tokens one step yields with k drafts, each accepted with probability a (given the ones
    before it were): the accepted prefix plus the token the target samples after it."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class DraftPolicy:
    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None, adaptive: bool,
                 row_cost: float = ROW_COST, draft_cost: float = 0.0) -> None:
        self.k_max = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.adaptive = adaptive
        self.row_cost = row_cost
        self.draft_cost = draft_cost  # a proposer pass, in target steps: a prior until measured
        self._t0: float | None = None   # measured one-row target step (s)
        self._d0: float | None = None   # measured one-row proposer pass (s)

    def num_propose(self, req: Request, num_running: int) -> int:
        if self.disable_by_batch_size is not None and num_running > self.disable_by_batch_size:
            return 0
        if not self.adaptive:
            return self.k_max
        accepted, trials = req.spec_estimate or PRIOR
        a = accepted / trials
        token_cost = (1.0 + self.row_cost * (num_running - 1)) / max(num_running, 1)  # t(B) / B, in t0
        saved = lambda k: (expected_tokens(a, k) - 1.0 - k * self.draft_cost) * token_cost - k * self.row_cost
        best = max(range(self.k_max + 1), key=saved)
        if best == 0:
            req.spec_idle_steps += 1
            if req.spec_idle_steps >= PROBE_EVERY:
                req.spec_idle_steps = 0
                return 1
        return best

    def observe_timing(self, timing: StepTiming) -> None:
        """Measure what the model says: a one-row target step t0 from the steps made only of
        decode rows, and a one-row proposer pass from its passes, both through the row-cost fit;
        their ratio replaces the prior draft cost (a draft model whose kernels are not faster in
        proportion to its bytes, or proposing's own Python time, shows up here)."""
        if timing.decode_rows:
            self._t0 = _ema(self._t0, timing.forward_s / (1.0 + self.row_cost * (timing.decode_rows - 1)))
        if timing.propose_passes and timing.propose_rows:
            per_pass = timing.propose_s / timing.propose_passes
            self._d0 = _ema(self._d0, per_pass / (1.0 + self.row_cost * (timing.propose_rows - 1)))
        if self._t0 and self._d0 is not None:
            self.draft_cost = self._d0 / self._t0

    def observe(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """One verification: drafts are tried in order until the first rejection."""
        if num_drafts == 0:
            return
        trials = num_accepted + (num_accepted < num_drafts)
        accepted, total = req.spec_estimate or PRIOR
        req.spec_estimate = (DECAY * accepted + num_accepted, DECAY * total + trials)
        req.spec_idle_steps = 0

"""How many draft tokens each request proposes for its next step. No torch here.

A decode step's time grows with the rows it scores: t(R) = t0 * (1 + row_cost * (R - 1)), where
one row costs t0 because every weight is read once per step whatever the row count, and each
further row adds the arithmetic on it. Both numbers are the model's and the host's (the kernels,
the ISA, the vocabulary the head multiplies out), so the policy fits them by least squares to the
decode-only steps the engine runs, forgetting old steps at `FIT_DECAY` per step; until the steps
seen vary enough in their row count it assumes `ROW_COST` (benchmarks/verify_rows.py measured it;
RESULTS.md has the figures).

A request verifying k drafts adds k rows and is expected to gain E(k) - 1 tokens, where
E(k) = (1 - a^(k+1)) / (1 - a) when each draft is accepted with probability a (given the ones
before it were: the first rejection ends the run). At a batch of B running requests a token costs
t(B) / B, so the policy picks the k in [0, num_speculative_tokens] that maximises

    (E(k) - 1 - k * draft_cost - k * MARGIN) * t(B) / B  -  k * row_cost * t0,

the time saved minus the time spent, each draft asked to save a tenth of a token beyond
break-even (the measurements are noisy, and a draft near break-even gains nothing worth its risk).
`draft_cost` is what proposing one draft costs in one-row target steps: 0 for prompt lookup up to
its Python time, a draft model's own forward pass for a draft model. It starts as the ratio of the weight bytes the two read per step and is then the
median of the proposer's measured passes (each through the same row-cost model).

At batch 1 drafts are cheap and long ones pay; as the batch grows a token's share of the step
shrinks while a draft row costs the same, so k falls, and with low acceptance it reaches 0. Each
request keeps a decaying estimate of its own a. A request whose drafts stopped paying proposes one
draft every `PROBE_EVERY` steps, so a change in the text (a quoted passage starts) brings
speculation back — unless drafts measurably cost more than any acceptance could save at this
batch size (a draft model no faster than the target): the costs are the model's and the host's,
not the text's, and a probe is not free (a draft model first catches up on what it has not seen),
so then nothing is proposed at that batch size at all.
`disable_by_batch_size` (vLLM's switch) turns drafts off outright above a batch size.
"""
from __future__ import annotations

import statistics
from collections import deque

from tokenmill.core.request import Request
from tokenmill.core.sched_output import StepTiming

ROW_COST = 0.17     # prior for an extra row of a decode step, in one-row steps (benchmarks/verify_rows.py)
FIT_DECAY = 0.98    # weight of the past in the step-cost fit, per decode step observed
MIN_SPREAD = 0.25   # variance of (rows - 1) the fit needs before it trusts its own slope
ROW_COST_RANGE = (0.01, 2.0)
MAX_PASS_ROWS = 32  # a proposer pass over more rows ran as a prompt chunk: not a decode-row pass
DECAY = 0.8         # weight of the past in the acceptance estimate, per verified step
PRIOR = (1.5, 2.0)  # (accepted, trials) a new request starts from: a = 0.75
PROBE_EVERY = 8
MARGIN = 0.1        # of a token's cost, each draft must save beyond break-even (noise, unmodelled costs)
REFRESH_EVERY = 48  # drafted steps at a batch size after which one runs plain, to re-measure the baseline
MIN_SAMPLES = 5     # measurements (their median) a measured cost needs before it replaces the model's


class StepCostFit:
    """t(R) = t0 + slope * (R - 1) by decayed weighted least squares over observed steps."""

    def __init__(self, decay: float = FIT_DECAY) -> None:
        self.decay = decay
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, rows: int, seconds: float) -> None:
        d, x = self.decay, float(rows - 1)
        self.w, self.sx, self.sy = d * self.w + 1.0, d * self.sx + x, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * seconds

    def row_cost(self) -> float | None:
        """slope / t0, or None while the rows seen do not vary enough to tell."""
        if self.w < 4.0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var < MIN_SPREAD:
            return None
        slope = (self.sxy / self.w - mx * my) / var
        t0 = my - slope * mx
        if t0 <= 0.0:
            return ROW_COST_RANGE[1]
        return min(max(slope / t0, ROW_COST_RANGE[0]), ROW_COST_RANGE[1])

    def t0(self, row_cost: float) -> float | None:
        """The one-row step under the given row cost (the decayed mean of t(R) / (1 + c (R - 1)))."""
        if self.w == 0.0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        return my / (1.0 + row_cost * mx)


def _median(samples: deque[float] | None) -> float | None:
    return statistics.median(samples) if samples is not None and len(samples) >= MIN_SAMPLES else None


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
        self.row_cost = row_cost      # a prior until the step fit can tell
        self.draft_cost = draft_cost  # a proposer pass, in one-row target steps: a prior until measured
        self.fit = StepCostFit()
        self._passes: deque[float] = deque(maxlen=15)  # recent proposer passes, in one-row passes (s)
        self._plain: dict[int, deque[float]] = {}      # batch size -> recent steps without drafts (s)
        self._since_plain: dict[int, int] = {}         # batch size -> drafted steps since its last plain one
        self._refresh_step: dict[int, int] = {}        # batch size -> the step whose scheduling asks for a plain one
        self._steps = 0
        self._per_draft: dict[int, deque[float]] = {}  # batch size -> what one draft added to its step (s)
        self._last_propose: tuple[float, bool] = (0.0, False)  # the previous step's proposing: (s, steady)
        self._costs_at: tuple[int, int] | None = None  # (step, batch) the cached costs below are for
        self._costs: tuple[float, float, bool] = (0.0, 0.0, False)

    def _step(self, batch: int) -> float:
        """A decode step of `batch` requests without drafts: measured, else the fit's, in s (in
        units of a one-row step while nothing is measured)."""
        plain = _median(self._plain.get(batch))
        if plain is not None:
            return plain
        return (self.fit.t0(self.row_cost) or 1.0) * (1.0 + self.row_cost * (batch - 1))

    def _draft_price(self, batch: int) -> float:
        """What one more draft costs at this batch size: measured all-in (the proposer's work plus
        the row it adds to the step), else the model's prior."""
        measured = _median(self._per_draft.get(batch))
        if measured is not None:
            return measured
        t0 = self.fit.t0(self.row_cost) or 1.0
        return self.row_cost * t0 + self.draft_cost * self._step(batch) / max(batch, 1)

    def _costs_for(self, batch: int) -> tuple[float, float, bool]:
        """(a token's share of a plain step, a draft's price, whether that price is measured) at
        this batch size; computed once per step, as every request of the step asks the same."""
        if self._costs_at != (self._steps, batch):
            self._costs_at = (self._steps, batch)
            self._costs = (self._step(batch) / max(batch, 1), self._draft_price(batch),
                           _median(self._per_draft.get(batch)) is not None)
        return self._costs

    def _saving(self, a: float, k: int, batch: int) -> float:
        token, price, _ = self._costs_for(batch)
        return (expected_tokens(a, k) - 1.0 - MARGIN * k) * token - k * price

    def num_propose(self, req: Request, num_running: int) -> int:
        if self.disable_by_batch_size is not None and num_running > self.disable_by_batch_size:
            return 0
        if not self.adaptive:
            return self.k_max
        if self._since_plain.get(num_running, 0) >= REFRESH_EVERY:  # the baseline is stale:
            self._since_plain[num_running] = 0                      # the next step runs plain
            self._refresh_step[num_running] = self._steps
        if self._refresh_step.get(num_running) == self._steps:      # (every request of this step)
            return 0
        accepted, trials = req.spec_estimate or PRIOR
        a = accepted / trials
        best = max(range(self.k_max + 1), key=lambda k: self._saving(a, k, num_running))
        if best == 0 and not self._dear(num_running):
            req.spec_idle_steps += 1
            if req.spec_idle_steps >= PROBE_EVERY:
                req.spec_idle_steps = 0
                return 1
        return best

    def _dear(self, batch: int) -> bool:
        """Drafts measurably cost more than they can save at this batch size, at any acceptance."""
        return (self._costs_for(batch)[2]
                and all(self._saving(1.0, k, batch) <= 0.0 for k in range(1, self.k_max + 1)))

    def observe_timing(self, timing: StepTiming) -> None:
        """Learn the costs from the steps the engine runs. Decode-only steps feed the target's
        t0 / row-cost fit; those without drafts measure a plain step at their batch size; those
        with drafts measure what a draft adds, all in: the step's excess over a plain step of the
        same batch plus the proposer's time that produced the drafts (the previous step's), per
        draft. That is the price `num_propose` charges once measured; until then a draft costs a
        row plus a proposer pass priced from its measured passes (a draft model whose kernels are
        not faster in proportion to its bytes, or proposing's own Python time, shows up there).
        The plain baseline is kept fresh: after `REFRESH_EVERY` drafted steps at a batch size one
        step there runs without drafts (a stale or warm-up-slow baseline would otherwise make
        drafts look cheaper or dearer than they are, for good)."""
        self._steps += 1
        if timing.decode_rows:
            self.fit.add(timing.decode_rows, timing.step_s)
            self.row_cost = self.fit.row_cost() or self.row_cost
            batch = timing.decode_rows - timing.drafts
            if timing.drafts == 0:
                self._plain.setdefault(batch, deque(maxlen=MIN_SAMPLES)).append(timing.step_s)
                self._since_plain[batch] = 0
            else:
                self._since_plain[batch] = self._since_plain.get(batch, 0) + 1
            if timing.drafts and self._last_propose[1]:
                extra = timing.step_s + self._last_propose[0] - self._step(batch)
                self._per_draft.setdefault(batch, deque(maxlen=15)).append(max(extra, 0.0) / timing.drafts)
        # a proposer pass over a prompt (a draft model catching up on a new request) is a one-off
        # like the target's prefill, not what each draft costs: such steps are not priced
        steady = timing.propose_rows <= MAX_PASS_ROWS * timing.propose_passes
        self._last_propose = (timing.propose_s, steady)
        if timing.propose_passes and steady:
            extra_rows = max(timing.propose_rows - timing.propose_passes, 0)
            self._passes.append(timing.propose_s / (timing.propose_passes + self.row_cost * extra_rows))
        t0 = self.fit.t0(self.row_cost)
        if t0 and len(self._passes) >= MIN_SAMPLES:
            self.draft_cost = statistics.median(self._passes) / t0

    def observe(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """One verification: drafts are tried in order until the first rejection."""
        if num_drafts == 0:
            return
        trials = num_accepted + (num_accepted < num_drafts)
        accepted, total = req.spec_estimate or PRIOR
        req.spec_estimate = (DECAY * accepted + num_accepted, DECAY * total + trials)
        req.spec_idle_steps = 0

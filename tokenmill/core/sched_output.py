"""The contracts between scheduler and runner (and the runner's to its draft proposers): plain
dataclasses of ints and lists, and the only channel between them. The runner learns of a request when it is first scheduled (`NewRequest`),
follows its block table through deltas, and forgets it when its id is in `finished_req_ids`."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequest:
    """What the runner keeps about a request for sampling: its params, the tokens so far (for
    penalties and n-gram drafts) and which of them are the prompt."""
    req_id: str
    # the scheduler's own list, not a copy: the runner reads it and never changes it; the scheduler
    # appends each step's tokens once the step is done (a worker rank in another process gets a copy,
    # which it never needs to update: only rank 0 samples)
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    eos_token_ids: list[int]
    pooling: PoolingParams | None = None  # a pooling request: one vector at the end of its prompt, no tokens
    lora_name: str | None = None  # the LoRA adapter it runs under (added to the runner beforehand), None: the base


@dataclass
class ScheduledRequest:
    """What the runner does for one request this step: feed `token_ids` (positions `start_pos ..`),
    writing their KV through the request's block table, which is first cut to `num_kept_blocks`
    blocks and extended by `new_block_ids`; sample if `sample`, or pool the prompt's hidden states
    into the request's vector if `pool` (its last chunk: a pooling request never samples). The last `num_drafts` of
    `token_ids` are draft tokens to verify: every one of the 1 + num_drafts last positions is
    scored. `num_propose`: how many drafts to propose for the next step (0: none)."""
    req_id: str
    token_ids: list[int]
    start_pos: int
    num_kept_blocks: int
    new_block_ids: list[int]
    sample: bool
    num_drafts: int = 0
    num_propose: int = 0
    pool: bool = False


@dataclass
class StepStats:
    """What one step did, for metrics: gauges after the step and the latency samples it produced.
    The scheduler fills it; the engine adds the requests that finished on a stop string or abort."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0          # prompts that finished prefilling this step
    prefix_cache_queries: int = 0       # prompt tokens looked up in the prefix cache this step
    prefix_cache_hits: int = 0          # of those, found
    num_generation_tokens: int = 0
    num_drafts: int = 0                 # requests that verified drafts this step
    num_draft_tokens: int = 0           # draft tokens verified
    num_accepted_tokens: int = 0        # of those, accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted drafts by position in the draft
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    finished: list = field(default_factory=list)  # Requests that finished this step
    running_loras: list[str] = field(default_factory=list)  # LoRA adapters of the running requests (gauge)
    waiting_loras: list[str] = field(default_factory=list)  # ... and of the waiting ones


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class RunnerOutput:
    """Per sampled request: the tokens it gained this step — the accepted drafts, then one token
    sampled by the target — with (when asked for) each one's logprob, rank and top-k alternatives
    as (token_id, logprob) pairs, best first; and the drafts proposed for its next step. Per pooled
    request its vector (an embedding, or a classifier's probabilities). Or, for a
    fault that belongs to one request (non-finite logits, a sampling error), no token and the reason."""
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[tuple[float, int, list[tuple[int, float]]]]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # req_id -> why this request's step failed
    pooled: dict[str, list[float]] = field(default_factory=dict)  # pooling requests' vectors (entries with pool)
    timing: StepTiming | None = None


@dataclass
class StepTiming:
    """What the step's work took, for the draft policy's cost estimates: the target's forward
    pass and sampling over `decode_rows` rows (0 when the step also held prompt chunks), and the
    proposer's `propose_passes` passes over `propose_rows` rows in all. `drafts`: of the decode
    rows, how many verified drafts."""
    step_s: float
    decode_rows: int
    drafts: int = 0
    propose_s: float = 0.0
    propose_passes: int = 0
    propose_rows: int = 0


@dataclass
class DraftRequest:
    """What the runner asks a proposer (spec/) for."""
    req_id: str
    token_ids: list[int]   # prompt + output so far, this step's tokens included (the step's view: read only)
    prompt_len: int
    params: SamplingParams
    num_drafts: int        # most drafts wanted

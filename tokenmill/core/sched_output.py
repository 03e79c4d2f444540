"""The two contracts between scheduler and runner: plain dataclasses of ints and lists."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledRequest:
    """What the runner does for one request this step: feed `token_ids` (positions
    `start_pos ..`), write their KV through `block_table`, and sample one token if `sample`."""
    req_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass
class RunnerOutput:
    """Per sampled request: its new token, and (when asked for) that token's logprob, its rank,
    and the top-k alternatives as (token_id, logprob) pairs, best first. Or, for a fault that
    belongs to one request (non-finite logits, a sampling error), no token and the reason."""
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, tuple[float, int, list[tuple[int, float]]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # req_id -> why this request's step failed

"""Results handed back to users: vLLM's `RequestOutput` / `CompletionOutput` shapes."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One position: token id -> Logprob (the sampled token plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Per-request timings (seconds, `time.monotonic`) so users see why a request was slow."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_drafts: int = 0             # speculative decoding: steps that verified drafts for this request
    num_draft_tokens: int = 0       # draft tokens verified in them
    num_accepted_tokens: int = 0    # of those, accepted


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # What this output added since the previous RequestOutput of its request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # the request failed (its outputs' finish_reason is "error" or "abort")


@dataclass
class PoolingOutput:
    """A pooling request's vector: an embedding, or a classifier's probabilities (a cross-encoder's
    relevance score is the one probability). vLLM's `outputs.embedding` / `.score` / `.probs`."""
    data: list[float]

    @property
    def embedding(self) -> list[float]:
        return self.data

    @property
    def probs(self) -> list[float]:
        return self.data

    @property
    def score(self) -> float:
        return self.data[0]


@dataclass
class PoolingRequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # the request failed; `outputs.data` is then empty

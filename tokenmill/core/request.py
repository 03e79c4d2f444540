"""One sequence inside the engine: its tokens, its progress and its KV blocks. No torch here."""
from __future__ import annotations

import enum
import time

from tokenmill.outputs import RequestMetrics
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """`token_ids` is prompt + output so far; `num_computed_tokens` of them have KV in the cache.

    A preempted request keeps its output tokens and is recomputed from scratch later, so the
    prompt it prefills then is `token_ids`, not just the original prompt.
    """

    def __init__(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None, pooling: PoolingParams | None = None,
                 lora_name: str | None = None) -> None:
        self.req_id = req_id
        self.lora_name = lora_name  # the LoRA adapter it runs under; None: the base model
        # a pooling request prefills its prompt and ends with one vector (`pooled`), no tokens
        self.pooling = pooling
        self.pooled: list[float] | None = None
        self.cache_salt = cache_salt  # prefix-cache namespace: only requests with the same salt share blocks
        self.priority = priority  # lower runs first under the priority policy
        self.arrival_seq = 0      # set by the scheduler: ties in priority go to the earlier request
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # leading block_table entries given back because they lie before the sliding window of
        # every layer: their ids stay in the table (positions keep their index) but are not held
        self.released_blocks = 0
        self.block_hashes: list[int] = []  # prefix-cache key ids of the full blocks, in order
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # set with finish_reason "error": why this request failed
        self.eos_token_ids = eos_token_ids
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict] = []  # filled by the engine when params.logprobs is set
        # speculative decoding: drafts to verify next step, and the draft policy's state
        self.draft_token_ids: list[int] = []
        self.spec_estimate: tuple[float, float] | None = None  # decayed (accepted, tried) draft tokens
        self.spec_idle_steps = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_stop(self, max_model_len: int) -> bool:
        """Sets finish_reason when the newest token ends the request (stop strings live in the
        detokenizer). Returns whether it finished."""
        p = self.params
        last = self.token_ids[-1]
        n_out = self.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", None
                return True
            if last in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", last
                return True
        if (p.max_tokens is not None and n_out >= p.max_tokens) or self.num_tokens >= max_model_len:
            self.finish_reason = "length"
            return True
        return False

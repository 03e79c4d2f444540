"""Continuous batching under one token budget. Decides who runs each step; no torch here.

Every step: running requests first (oldest first), each granted the tokens it still has to
compute (a decode needs 1, a prompt gets as much as the budget allows: chunked prefill); then
waiting requests join — FCFS, or by `priority` (lower first) — while budget, `max_num_seqs` and
free KV blocks last, starting after whatever prefix the cache already holds. When a running
request cannot get a block, a victim is preempted (the newest; under the priority policy the
lowest-priority, newest first): its blocks are freed and it is recomputed later from its prompt +
output so far. The engine never runs out of memory and never drops a request.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import RunnerOutput, ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"  # or "priority"

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._arrivals = 0

    # ----------------------------------------------------------------- intake / exit
    def add_request(self, req: Request) -> None:
        req.arrival_seq = self._arrivals
        self._arrivals += 1
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def finish_request(self, req_id: str, reason: str) -> Request | None:
        """Ends a request wherever it is (abort, stop string) and frees its blocks at once."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.FINISHED
        if req.finish_reason is None:
            req.finish_reason = reason
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: dict[str, ScheduledRequest] = {}
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.allocate(req, req.num_computed_tokens + num_new):
                victim = self._victim()
                if self.running.index(victim) < i:
                    i -= 1
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim.req_id)
                if victim.req_id in scheduled:
                    budget += len(scheduled.pop(victim.req_id).token_ids)
                if victim is req:
                    break
            else:
                scheduled[req.req_id] = self._entry(req, num_new)
                budget -= num_new
                i += 1

        if not out.preempted:
            budget = self._admit(budget, scheduled)
        out.scheduled = list(scheduled.values())
        return out

    def _admit(self, budget: int, scheduled: dict[str, ScheduledRequest]) -> int:
        """Waiting requests join in policy order while budget, seats and blocks last. A request
        whose first block is being prefilled right now (by a running request, or one admitted in
        this step) waits instead of computing the same prefix again: it will find those blocks in
        the cache once they are computed."""
        bm = self.block_manager
        order = list(self.waiting) if self.config.policy == "fcfs" else \
            sorted(self.waiting, key=lambda r: (r.priority, r.arrival_seq))
        in_flight = {tuple(r.token_ids[:bm.block_size]) for r in self.running
                     if r.num_computed_tokens < r.prompt_len} if bm.enable_prefix_caching else set()
        for req in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            cached = bm.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            head = tuple(req.token_ids[:bm.block_size])
            if not cached and req.num_tokens > bm.block_size and head in in_flight:
                continue
            num_cached = len(cached) * bm.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not bm.allocate(req, num_cached + num_new, cached):
                break
            self.waiting.remove(req)
            req.num_computed_tokens = num_cached
            if req.num_output_tokens == 0:
                req.metrics.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.req_id] = self._entry(req, num_new)
            budget -= num_new
            bm.count_lookup(req.num_tokens, num_cached)
            if bm.enable_prefix_caching:
                in_flight.add(head)  # its blocks are cached once computed: same-prefix requests wait
        return budget

    def _victim(self) -> Request:
        if self.config.policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=lambda r: (r.priority, r.arrival_seq))

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _entry(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(req_id=req.req_id, token_ids=req.token_ids[start:end], start_pos=start,
                                block_table=list(req.block_table), sample=end == req.num_tokens)

    # ----------------------------------------------------------------- after the forward pass
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advances progress, appends sampled tokens, finishes requests that hit EOS / stop ids /
        length, and those whose step failed (finish_reason "error"). Returns the requests that
        were given a new token this step, and the failed ones."""
        advanced = []
        for entry in sched.scheduled:
            req = self.requests.get(entry.req_id)
            if req is None:  # aborted while the step ran
                continue
            if entry.req_id in result.failed:  # its KV of this step is suspect: never cached
                req.error = result.failed[entry.req_id]
                self.finish_request(req.req_id, "error")
                advanced.append(req)
                continue
            req.num_computed_tokens += len(entry.token_ids)
            self.block_manager.cache_full_blocks(req)
            if not entry.sample:
                continue
            req.token_ids.append(result.sampled[entry.req_id])
            if entry.req_id in result.logprobs:
                req.logprobs.append(result.logprobs[entry.req_id])
            advanced.append(req)
            if req.check_stop(self.config.max_model_len):
                self.finish_request(req.req_id, req.finish_reason or "stop")
        return advanced

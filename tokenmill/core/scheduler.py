"""Continuous batching under one token budget. Decides who runs each step; no torch here.

Every step: running requests first (oldest first), each granted the tokens it still has to
compute (a decode needs 1, a prompt gets as much as the budget allows: chunked prefill); then
waiting requests join — FCFS, or by `priority` (lower first) — while budget, `max_num_seqs` and
free KV blocks last, starting after whatever prefix the cache already holds. When a running
request cannot get a block, a victim is preempted (the newest; under the priority policy the
lowest-priority, newest first): its blocks are freed and it is recomputed later from its prompt +
output so far. The engine never runs out of memory and never drops a request.

Speculative decoding: a decoding request that holds drafts (proposed by the runner last step) is
granted 1 + k tokens, the drafts counted in the budget and given KV slots ahead; drafts are the
first thing cut when budget or blocks run short. After verification the slots of rejected drafts
go back to the block manager, and only verified tokens ever count as computed (so the prefix
cache never keys a block holding a draft). `DraftPolicy` says how many drafts each request
proposes next.

The runner hears of everything through the SchedulerOutput: a request's data when it is first
scheduled, its block table as deltas, and the ids of the requests that finished.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import time

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.pacing import PrefillPacer
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import NewRequest, RunnerOutput, ScheduledRequest, SchedulerOutput, StepStats
from tokenmill.core.speculation import DraftPolicy


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"  # or "priority"
    sliding_window: int | None = None  # every layer's window: blocks before it are given back
    long_prefill_slowdown: float = 0.0  # > 1: long prompts paced beside decoders (pacing.py); 0: off
    # an encoder's input runs whole in one step (every token attends to every other: no chunks)
    whole_prompts: bool = False
    max_loras: int = 0  # LoRA adapters the running requests may use at once (the runner's slots); 0: no LoRA

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.long_prefill_slowdown != 0 and not 1 < self.long_prefill_slowdown < float("inf"):
            raise ValueError(f"long_prefill_slowdown must be 0 or above 1, got {self.long_prefill_slowdown}.")
        if self.whole_prompts and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must hold a whole input of "
                             f"max_model_len ({self.max_model_len}) tokens: this model's inputs run in one step.")
        if self.whole_prompts and self.long_prefill_slowdown:
            raise ValueError("long_prefill_slowdown paces prompts in chunks; this model's inputs run whole.")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 draft_policy: DraftPolicy | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.draft_policy = draft_policy  # None: no speculative decoding
        self.pacer = PrefillPacer(config.long_prefill_slowdown) if config.long_prefill_slowdown else None
        self._long_room: int | None = None  # this step's prompt tokens left for long prompts (None: no limit)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.stats = StepStats()
        self._arrivals = 0
        self._blocks_sent: dict[str, int] = {}  # requests the runner knows -> leading blocks of its table it has
        self._finished_ids: list[str] = []      # known to the runner, finished since the last step
        self._lookups = (0, 0)                  # block manager's (queries, hits) at the last step

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
        req.draft_token_ids = []
        if req.finish_reason is None:
            req.finish_reason = reason
        if self._blocks_sent.pop(req_id, None) is not None:
            self._finished_ids.append(req_id)
        return req

    def stop_at(self, req: Request, num_tokens: int, stop_reason: str | int | None) -> None:
        """Ends a sequence after its first `num_tokens` tokens: where the output processor found a
        stop string, even in a sequence that finished on its own this step (later tokens dropped)."""
        del req.token_ids[num_tokens:]
        del req.logprobs[max(0, num_tokens - req.prompt_len):]
        req.finish_reason, req.stop_reason = "stop", stop_reason
        if not req.is_finished:
            self.finish_request(req.req_id, "stop")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished_to_report(self) -> bool:
        """Finished requests the runner has not heard of yet (it keeps their state until then)."""
        return bool(self._finished_ids)

    # ----------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = []
        scheduled: dict[str, ScheduledRequest] = {}
        budget = self.config.max_num_batched_tokens
        self._long_room = self._paced_room()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._paced(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if num_new == 0:  # a long prompt waiting for the next step's room
                i += 1
                continue
            drafts = req.draft_token_ids[:budget - num_new] if num_new == 1 else []
            while not self.block_manager.allocate(req, req.num_computed_tokens + num_new + len(drafts)):
                if drafts:  # drafts go first, before anyone is preempted
                    drafts = []
                    continue
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
                scheduled[req.req_id] = self._entry(req, num_new, drafts, out)
                budget -= num_new + len(drafts)
                i += 1

        if not out.preempted:
            budget = self._admit(budget, scheduled, out)
        out.scheduled = list(scheduled.values())
        if self.draft_policy is not None:
            for entry in out.scheduled:
                if entry.sample:
                    entry.num_propose = self.draft_policy.num_propose(self.requests[entry.req_id], len(self.running))
        return out

    def _paced_room(self) -> int | None:
        """Prompt tokens long prompts may take this step: the pacer's chunk while anyone decodes."""
        if self.pacer is None or not any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            return None
        return self.pacer.chunk(self.config.max_num_batched_tokens)

    def _paced(self, req: Request, num_new: int) -> int:
        """num_new, cut to this step's room for long prompts if req is one (longer than the token
        budget) and is prefilling; the room shrinks by what it takes."""
        if self._long_room is None or num_new <= 1 or req.num_tokens <= self.config.max_num_batched_tokens:
            return num_new
        num_new = min(num_new, self._long_room)
        self._long_room -= num_new
        return num_new

    def _admit(self, budget: int, scheduled: dict[str, ScheduledRequest], out: SchedulerOutput) -> int:
        """Waiting requests join in policy order while budget, seats and blocks last. A request
        whose first block is being prefilled right now (by a running request, or one admitted in
        this step) waits instead of computing the same prefix again: it will find those blocks in
        the cache once they are computed."""
        bm = self.block_manager
        order = list(self.waiting) if self.config.policy == "fcfs" else \
            sorted(self.waiting, key=lambda r: (r.priority, r.arrival_seq))
        in_flight = {(r.lora_name, r.cache_salt, tuple(r.token_ids[:bm.block_size])) for r in self.running
                     if r.num_computed_tokens < r.prompt_len} if bm.enable_prefix_caching else set()
        adapters = {r.lora_name for r in self.running if r.lora_name is not None} if self.config.max_loras else set()
        for req in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.lora_name is not None and req.lora_name not in adapters and len(adapters) >= self.config.max_loras:
                continue  # every adapter slot is taken by running requests: it waits, others may go ahead
            cached = bm.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            head = (req.lora_name, req.cache_salt, tuple(req.token_ids[:bm.block_size]))
            if not cached and req.num_tokens > bm.block_size and head in in_flight:
                continue
            num_cached = len(cached) * bm.block_size
            num_new = self._paced(req, min(req.num_tokens - num_cached, budget))
            if self.config.whole_prompts and num_new < req.num_tokens - num_cached:
                break  # waits for a step with room for all of it, ahead of those behind it
            if num_new == 0:
                continue
            if not bm.allocate(req, num_cached + num_new, cached):
                break
            self.waiting.remove(req)
            req.num_computed_tokens = num_cached
            if req.num_output_tokens == 0:
                req.metrics.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.req_id] = self._entry(req, num_new, [], out)
            budget -= num_new
            if req.lora_name is not None:
                adapters.add(req.lora_name)
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
        if req.req_id in self._blocks_sent:
            self._blocks_sent[req.req_id] = 0
        req.draft_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _entry(self, req: Request, num_new: int, drafts: list[int], out: SchedulerOutput) -> ScheduledRequest:
        start = req.num_computed_tokens
        end = start + num_new
        kept = self._blocks_sent.get(req.req_id)
        if kept is None:
            out.new_requests.append(NewRequest(req.req_id, req.token_ids, req.prompt_len, req.params,
                                               sorted(req.eos_token_ids), req.pooling, req.lora_name))
            kept = 0
        self._blocks_sent[req.req_id] = len(req.block_table)
        last = end == req.num_tokens
        return ScheduledRequest(req_id=req.req_id, token_ids=req.token_ids[start:end] + drafts, start_pos=start,
                                num_kept_blocks=kept, new_block_ids=req.block_table[kept:],
                                sample=last and req.pooling is None, num_drafts=len(drafts),
                                pool=last and req.pooling is not None)

    # ----------------------------------------------------------------- after the forward pass
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[tuple[Request, int]]:
        """Advances progress, appends each request's new tokens (accepted drafts, then the sampled
        one) until one of them ends it (EOS / stop ids / length), gives rejected drafts' slots back,
        stores the next drafts, and fails the requests whose step failed (finish_reason "error").
        Returns (request, tokens it gained) for every request that gained tokens or failed, and
        leaves the step's numbers in `self.stats`."""
        now = time.monotonic()
        bm = self.block_manager
        queries, hits = bm.num_queries, bm.num_hits
        st = self.stats = StepStats(num_preemptions=len(sched.preempted),
                                    prefix_cache_queries=queries - self._lookups[0],
                                    prefix_cache_hits=hits - self._lookups[1])
        self._lookups = (queries, hits)
        if self.draft_policy is not None and result.timing is not None:
            self.draft_policy.observe_timing(result.timing)
        if self.pacer is not None and result.timing is not None:
            fed = [len(e.token_ids) - e.num_drafts for e in sched.scheduled]
            self.pacer.observe(fed.count(1), sum(f for f in fed if f > 1), result.timing.step_s)
        advanced = []
        for entry in sched.scheduled:
            req = self.requests.get(entry.req_id)
            if req is None:  # aborted while the step ran
                continue
            if entry.req_id in result.failed:  # its KV of this step is suspect: never cached
                req.error = result.failed[entry.req_id]
                self.finish_request(req.req_id, "error")
                advanced.append((req, 0))
                continue
            fed = len(entry.token_ids) - entry.num_drafts
            if not entry.sample:
                req.num_computed_tokens += fed
                bm.cache_full_blocks(req)
                if self.config.sliding_window:
                    bm.release_before_window(req, self.config.sliding_window)
                if entry.pool:  # its vector is its whole output: done, its blocks stay cached for prefixes
                    req.pooled = result.pooled[entry.req_id]
                    self._count(req, entry, 0, 0, now)
                    req.finish_reason = "stop"
                    self.finish_request(req.req_id, "stop")
                    advanced.append((req, 0))
                continue
            tokens = result.sampled[entry.req_id]
            lps = result.logprobs.get(entry.req_id)
            computed = req.num_computed_tokens + fed + len(tokens) - 1  # + the accepted drafts
            added = 0
            for j, tok in enumerate(tokens):
                req.token_ids.append(tok)
                if lps is not None:
                    req.logprobs.append(lps[j])
                added += 1
                if req.check_stop(self.config.max_model_len):
                    break
            req.num_computed_tokens = min(computed, req.num_tokens - 1)
            bm.cache_full_blocks(req)
            if self.config.sliding_window:
                bm.release_before_window(req, self.config.sliding_window)
            self._count(req, entry, len(tokens) - 1, added, now)
            advanced.append((req, added))
            if req.finish_reason is not None:
                self.finish_request(req.req_id, req.finish_reason)
                continue
            if entry.num_drafts:  # rejected drafts' slots go back
                bm.truncate(req, req.num_tokens)
                self._blocks_sent[req.req_id] = min(self._blocks_sent[req.req_id], len(req.block_table))
            req.draft_token_ids = result.draft_token_ids.get(entry.req_id, [])[:self._draft_room(req)]
        st.num_running, st.num_waiting = len(self.running), len(self.waiting)
        st.kv_cache_usage = bm.usage
        return advanced

    def _draft_room(self, req: Request) -> int:
        """Drafts that can still matter: their positions stay inside the context, and the step's
        tokens (drafts + one) stay within max_tokens."""
        room = self.config.max_model_len - req.num_tokens
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - req.num_output_tokens - 1)
        return max(room, 0)

    def _count(self, req: Request, entry: ScheduledRequest, accepted: int, added: int, now: float) -> None:
        st, m = self.stats, req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            st.ttft.append(now - m.arrival_time)
            st.num_prompt_tokens += req.prompt_len
        else:
            st.itl.append(now - m.last_token_time)
        m.last_token_time = now
        st.num_generation_tokens += added
        if entry.num_drafts:
            st.num_drafts += 1
            st.num_draft_tokens += entry.num_drafts
            st.num_accepted_tokens += accepted
            m.num_drafts += 1
            m.num_draft_tokens += entry.num_drafts
            m.num_accepted_tokens += accepted
            if len(st.accepted_per_pos) < entry.num_drafts:
                st.accepted_per_pos += [0] * (entry.num_drafts - len(st.accepted_per_pos))
            for pos in range(accepted):
                st.accepted_per_pos[pos] += 1
            if self.draft_policy is not None:
                self.draft_policy.observe(req, entry.num_drafts, accepted)

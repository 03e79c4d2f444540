"""Drafts from a smaller model that shares the target's tokenizer: a pruned or distilled student,
or the target itself quantized harder.

The draft runs as a little engine of its own: a ModelRunner over the draft model with its own
paged KV cache (as many blocks as the target's, so whatever fits the target fits the draft; the
engine counts both in the KV budget) and its own BlockManager, prefix caching included. Each
engine step, for the requests the scheduler wants drafts for:

1. sync: the target's tokens are now final up to their end. The draft's cache holds KV for a
   verified prefix plus the drafts it fed last time; those stay valid as far as the target
   accepted them, the rest are overwritten.
2. one forward pass over every request's tokens that the draft has not seen (the accepted drafts
   and the target's new token; a new request's prompt, at most `MAX_CATCH_UP` tokens a step),
   sampling each request's first draft;
3. k - 1 more single-token passes, batched over the requests, for the remaining drafts.

Greedy requests take the draft's argmax (a point mass: the target accepts what it would have
picked itself). Sampling requests draw from the draft's distribution q under the request's own
temperature / top-k / top-p / min-p / penalties, and q is kept for the acceptance rule.
"""
from __future__ import annotations

import logging

import torch

from tokenmill.core.block_manager import BlockManager
from tokenmill.core.request import Request
from tokenmill.core.sched_output import DraftRequest, NewRequest, ScheduledRequest, SchedulerOutput
from tokenmill.models.loader import LoadedModel
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling import rejection
from tokenmill.sampling.sampler import SamplingRow, noise_seed
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger("tokenmill")
MAX_CATCH_UP = 512  # tokens one request may feed the draft in one step (a long prompt takes several)
SHORT_CHUNK_ROWS = 32  # a catch-up this short (accepted drafts + the target's token) runs as decode rows
_PROBE = "Speculative decoding: def f(x):\n    return x * 2  # näive café, 東京, émoji 🙂"


def check_compatible(draft: LoadedModel, target: LoadedModel, path: str) -> None:
    """A draft must speak the target's vocabulary: same size, and (where both carry a tokenizer)
    the same ids for the same text."""
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"speculative_config: the draft model {path} has a vocabulary of {draft.arch.vocab_size} "
                         f"tokens but the target's has {target.arch.vocab_size}; a draft must share the target's "
                         "tokenizer.")
    if draft.tokenizer is not None and target.tokenizer is not None:
        a, b = draft.tokenizer.encode(_PROBE), target.tokenizer.encode(_PROBE)
        if a != b:
            raise ValueError(f"speculative_config: the draft model {path} tokenizes text differently from the "
                             "target (a draft must share the target's tokenizer).")


class DraftModelProposer:
    def __init__(self, draft: LoadedModel, num_blocks: int, block_size: int, device: torch.device,
                 kv_dtype: torch.dtype, enable_prefix_caching: bool = True) -> None:
        self.runner = ModelRunner(draft.model, num_blocks, block_size, device, kv_dtype,
                                  short_chunk_rows=SHORT_CHUNK_ROWS)
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.reqs: dict[str, Request] = {}
        self.fed_drafts: dict[str, list[int]] = {}   # drafts whose KV follows the request's verified prefix
        self.probs: dict[str, torch.Tensor] = {}     # (k, V) q of the last drafts of sampling requests
        self.sampler = self.runner.sampler
        self.last_passes = 0  # forward passes of the last propose call, and their rows in all
        self.last_rows = 0    # (the draft policy prices a pass by them)

    # ---------------------------------------------------------------- lifecycle
    def drop(self, req_id: str) -> None:
        rec = self.reqs.pop(req_id, None)
        if rec is not None:
            self.bm.free(rec)
        self.fed_drafts.pop(req_id, None)
        self.probs.pop(req_id, None)
        self.runner.states.pop(req_id, None)

    def preempted(self, req_id: str) -> None:
        self.drop(req_id)  # the target recomputes it; the draft gives its blocks back as well

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        return self.probs.get(req_id)

    # ---------------------------------------------------------------- proposing
    @torch.inference_mode()
    def propose(self, wanted: list[DraftRequest]) -> dict[str, list[int]]:
        sched = SchedulerOutput()
        active: dict[str, DraftRequest] = {}
        for w in wanted:
            entry = self._catch_up(w, sched)
            if entry is not None:
                sched.scheduled.append(entry)
                if entry.sample:
                    active[w.req_id] = w
        drafts: dict[str, list[int]] = {r: [] for r in active}
        probs: dict[str, list[torch.Tensor]] = {r: [] for r in active}
        self.last_passes = self.last_rows = 0
        while sched.scheduled:
            self.last_passes += 1
            self.last_rows += sum(len(e.token_ids) for e in sched.scheduled)
            logits, ids = self.runner.forward(sched)
            sched = SchedulerOutput()
            if logits is None:  # every request was still catching up on its prompt
                break
            rows_for = [active[r] for r in ids]
            toks, q = self._draw(logits, rows_for, drafts)
            for w, tok, qi in zip(rows_for, toks, q):
                drafts[w.req_id].append(tok)
                if qi is not None:
                    probs[w.req_id].append(qi)
                if len(drafts[w.req_id]) < w.num_drafts:  # feed it to get the next one
                    rec = self.reqs[w.req_id]
                    pos = rec.num_tokens + len(drafts[w.req_id]) - 1
                    sched.scheduled.append(ScheduledRequest(w.req_id, [tok], pos, 0, list(rec.block_table), True))
        for req_id, d in drafts.items():
            self.fed_drafts[req_id] = d[:-1]
            if probs[req_id]:
                self.probs[req_id] = torch.stack(probs[req_id])
            else:
                self.probs.pop(req_id, None)
        return {r: d for r, d in drafts.items() if d}

    def _catch_up(self, w: DraftRequest, sched: SchedulerOutput) -> ScheduledRequest | None:
        """The pass-1 entry of one request (its unseen tokens), with the draft's blocks for them
        and its drafts allocated; None when the draft's cache has no room (no drafts this time)."""
        bm, tokens = self.bm, w.token_ids
        rec = self.reqs.get(w.req_id)
        if rec is None:
            rec = self.reqs[w.req_id] = Request(w.req_id, tokens, SamplingParams(), set())
            cached = bm.find_cached_prefix(rec)
            if not bm.allocate(rec, len(cached) * bm.block_size, cached):
                self.drop(w.req_id)
                return None
            rec.num_computed_tokens = len(cached) * bm.block_size
            sched.new_requests.append(NewRequest(w.req_id, [], w.prompt_len, w.params, []))
            self.fed_drafts[w.req_id] = []
        else:
            valid = rec.num_computed_tokens
            for d, t in zip(self.fed_drafts[w.req_id], tokens[valid:]):
                if d != t:
                    break
                valid += 1
            rec.token_ids = tokens  # the step's view, replaced by the next one
            rec.num_computed_tokens = min(valid, len(tokens) - 1)
            bm.cache_full_blocks(rec)
        self.probs.pop(w.req_id, None)
        start = rec.num_computed_tokens
        feed = min(len(tokens) - start, MAX_CATCH_UP)
        sample = start + feed == len(tokens)
        if not bm.allocate(rec, start + feed + (w.num_drafts - 1 if sample else 0)):
            self.drop(w.req_id)
            return None
        rec.num_computed_tokens = start + feed  # once this step's first pass has run
        self.fed_drafts[w.req_id] = []
        return ScheduledRequest(w.req_id, tokens[start:start + feed], start, 0, list(rec.block_table), sample)

    def _draw(self, logits: torch.Tensor, ws: list[DraftRequest], drafts: dict[str, list[int]]):
        """One draft token per row: argmax for greedy requests, else a draw from q (kept)."""
        toks = logits.argmax(dim=-1).tolist()
        q: list[torch.Tensor | None] = [None] * len(ws)
        sampling = [i for i, w in enumerate(ws) if not w.params.greedy]
        if sampling:
            rows = []
            for i in sampling:
                w = ws[i]
                history = w.token_ids + drafts[w.req_id]
                n_out = len(history) - w.prompt_len
                seed = None if w.params.seed is None else noise_seed(w.params.seed ^ rejection.DRAFT_SALT, n_out)
                rows.append(SamplingRow(w.params, history, w.prompt_len, seed, []))
            dist = self.sampler.distribution(logits[sampling], rows)
            drawn = self.sampler.race(dist, [r.seed for r in rows]).tolist()
            for j, i in enumerate(sampling):
                toks[i], q[i] = drawn[j], dist[j]
        return toks, q

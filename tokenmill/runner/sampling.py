"""Sampling one step's logits: every scheduled request's rows (its penalties, min_tokens, seed and
grammar mask; with drafts, one row after each draft prefix), the sampler over the batch, draft
verification (point-mass drafts by comparison, a draft model's by the rejection rule), logprobs,
and the grammar matchers advanced by the emitted tokens. A fault that belongs to one request
(non-finite logits, a grammar dead end, a sampler error on its rows) fails that request only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from tokenmill.core.sched_output import RunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.sampling import rejection
from tokenmill.sampling.sampler import Sampler, SamplingRow, noise_seed, token_logprobs
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger("tokenmill")
NON_FINITE = "the model produced non-finite logits (NaN or infinity) for this request"
DEAD_END = "the structured-output constraint allows no next token here (a dead end in the grammar)"
SAMPLING_FAILED = "sampling this request's next token failed (an internal error; see the server log)"


@dataclass
class ReqState:
    """What the runner keeps of a request between steps (the runner's `states`, by request id)."""
    params: SamplingParams
    token_ids: list[int]          # prompt + output before this step: the scheduler's list, read only
    prompt_len: int
    eos_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    matcher: object | None = None  # llguidance matcher of a constrained request, at its last token


class StepSampler:
    def __init__(self, states: dict[str, ReqState], grammars, proposer) -> None:
        """`states`: the runner's, read here and extended by the emitted tokens; `grammars`: the
        structured-output compiler (None: constraints not enforced); `proposer`: for a draft
        model's distributions."""
        self.states, self.grammars, self.proposer = states, grammars, proposer
        self.sampler = Sampler()

    def sample(self, sched: SchedulerOutput, logits: torch.Tensor, sample_ids: list[str],
                out: RunnerOutput) -> list[ScheduledRequest]:
        """Sample every scheduled request's rows into `out`; the entries that were sampled."""
        entries = [s for s in sched.scheduled if s.sample]  # one row per sampled position, in this order
        masks = self._grammar_masks(entries, out.failed)
        rows_of = {e.req_id: self._rows(e, masks.get(e.req_id)) for e in entries if e.req_id not in out.failed}
        for req_id, req_rows in rows_of.items():  # the grammar allows only tokens banned now (EOS before min_tokens)
            if any(r.allowed is not None and not _any_left(r.allowed, r.banned) for r in req_rows):
                out.failed[req_id] = DEAD_END
        # faults that belong to one request fail that request only (the engine keeps the others):
        # a row with NaN or infinity anywhere (one pass: its sum is then not finite) ...
        bad = {sample_ids[i] for i in (~torch.isfinite(logits.sum(dim=-1))).nonzero()[:, 0].tolist()}
        for req_id in bad:
            out.failed[req_id] = NON_FINITE
        bad |= out.failed.keys()
        if bad:
            keep = [i for i, r in enumerate(sample_ids) if r not in bad]
            logits, entries = logits[keep], [e for e in entries if e.req_id not in bad]
            if not entries:
                return entries
        rows = [row for e in entries for row in rows_of[e.req_id]]
        try:
            self._take(self.sampler(logits, rows), entries, out, logits, rows)
        except Exception:  # noqa: BLE001 - ... and a sampler error: find the request(s) whose rows raise
            log.exception("sampling a batch of %d rows failed; sampling request by request", len(rows))
            offset = 0
            for e in entries:
                n = 1 + e.num_drafts
                part, part_rows = logits[offset:offset + n], rows[offset:offset + n]
                try:
                    self._take(self.sampler(part, part_rows), [e], out, part, part_rows)
                except Exception:  # noqa: BLE001
                    log.exception("sampling request %s failed", e.req_id)
                    out.failed[e.req_id] = SAMPLING_FAILED
                offset += n
        self._advance_grammars(entries, out)
        return entries

    def _grammar_masks(self, entries: list[ScheduledRequest], failed: dict[str, str]) -> dict[str, torch.Tensor]:
        """(1 + k, words) packed masks of the tokens each constrained request may take at each
        scored position: the matcher walks the drafts (and is rolled back), and the rows after a
        draft the grammar refuses repeat that position's mask (the draft is rejected there, so
        they are never used). A position that allows nothing fails its request."""
        masks = {}
        for e in entries:
            m = self.states[e.req_id].matcher
            if m is None:
                continue
            n = 1 + e.num_drafts
            drafts = e.token_ids[len(e.token_ids) - e.num_drafts:]
            mask = torch.zeros((n, self.grammars.mask_words), dtype=torch.int32)
            walked = 0
            for i in range(n):
                m.unsafe_compute_mask_ptr(mask[i].data_ptr(), mask.shape[1] * 4)
                if i == n - 1 or m.try_consume_tokens([drafts[i]]) != 1:
                    mask[i + 1:] = mask[i]
                    break
                walked += 1
            if walked:
                m.rollback(walked)
            if m.is_error() or not bool(mask[0].any()):
                failed[e.req_id] = DEAD_END + (f": {_first_line(m.get_error())}" if m.is_error() else "")
                continue
            masks[e.req_id] = mask
        return masks

    def _advance_grammars(self, entries: list[ScheduledRequest], out: RunnerOutput) -> None:
        """Each constrained request's matcher takes its emitted tokens. A matcher that has stopped
        (the constraint is complete) only allowed an end-of-sequence token, which ends the request
        and is not fed to it."""
        for e in entries:
            m = self.states[e.req_id].matcher
            if m is None or e.req_id not in out.sampled:
                continue
            for tok in out.sampled[e.req_id]:
                if m.is_stopped():
                    break
                if not m.consume_token(tok):
                    out.failed[e.req_id] = f"{DEAD_END}: {_first_line(m.get_error())}"
                    break

    def _take(self, result, entries: list[ScheduledRequest], out: RunnerOutput, logits: torch.Tensor,
              rows: list[SamplingRow]) -> None:
        """Commit a sampler result: each request keeps its accepted drafts and one token from the
        target. Drafts from a model come with their distribution q and take the general rule;
        the rest (prompt lookup, greedy drafts) are point masses. Nothing is recorded unless all
        of it converts."""
        tokens, part = result.token_ids.tolist(), RunnerOutput()
        logprobs = self._logprobs(result, entries) if result.logprobs is not None else None
        offset = 0
        for e in entries:
            n = 1 + e.num_drafts
            drafts = e.token_ids[len(e.token_ids) - e.num_drafts:]
            q = self.proposer.draft_probs(e.req_id) if e.num_drafts and self.proposer is not None else None
            k = self.states[e.req_id].params.logprobs
            if q is None:
                emitted = rejection.accept_point_mass(drafts, tokens[offset:offset + n])
                if k is not None:
                    part.logprobs[e.req_id] = logprobs[offset:offset + len(emitted)]
            else:
                emitted = self._accept_sampled(drafts, q[:len(drafts)], logits[offset:offset + n],
                                               rows[offset:offset + n])
                if k is not None:
                    part.logprobs[e.req_id] = _logprobs_of(logits[offset:offset + len(emitted)], emitted, k)
            part.sampled[e.req_id] = emitted
            offset += n
        out.sampled.update(part.sampled)
        out.logprobs.update(part.logprobs)

    def _accept_sampled(self, drafts: list[int], q: torch.Tensor, logits: torch.Tensor,
                        rows: list[SamplingRow]) -> list[int]:
        p = self.sampler.distribution(logits, rows)
        seed = rows[0].params.seed
        index = len(rows[0].token_ids) - rows[0].prompt_len  # output index of the first scored position
        u_seeds = [None if seed is None else noise_seed(seed ^ rejection.ACCEPT_SALT, index + i)
                   for i in range(len(drafts))]
        u = self.sampler.uniform(len(drafts), u_seeds, logits.device).tolist()

        def draw(weights: torch.Tensor, i: int) -> int:
            return int(self.sampler.race(weights[None], [rows[i].seed])[0])
        return rejection.accept_with_probs(drafts, p, q, u, draw)

    def _rows(self, e: ScheduledRequest, masks: torch.Tensor | None = None) -> list[SamplingRow]:
        """One row per scored position: the plain next-token row, or, with drafts, the rows after
        each draft prefix (their penalties, min_tokens, seed and grammar mask as if those drafts
        were accepted)."""
        st = self.states[e.req_id]
        p = st.params
        drafts = e.token_ids[len(e.token_ids) - e.num_drafts:]
        rows = []
        for i in range(1 + e.num_drafts):
            history = st.token_ids + drafts[:i] if i else st.token_ids
            n_out = len(history) - st.prompt_len
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else st.eos_ids) if n_out < p.min_tokens else []
            seed = None if p.seed is None else noise_seed(p.seed, n_out)
            rows.append(SamplingRow(p, history, st.prompt_len, seed, banned, None if masks is None else masks[i]))
        return rows

    def _logprobs(self, result, entries: list[ScheduledRequest]) -> list[tuple[float, int, list[tuple[int, float]]]]:
        chosen = result.logprobs.tolist()
        ranks = result.ranks.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        ks = [self.states[e.req_id].params.logprobs for e in entries for _ in range(1 + e.num_drafts)]
        return [(chosen[i], ranks[i], list(zip(top_ids[i][:k], top_lps[i][:k])) if k and top_ids is not None else [])
                for i, k in enumerate(ks)]

def _logprobs_of(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Logprob, rank and top-k of `tokens[i]` under row i of the raw logits."""
    chosen, ranks, top_lps, top_ids = token_logprobs(torch.log_softmax(logits, dim=-1),
                                                     torch.tensor(tokens, device=logits.device), k)
    return [(c, r, list(zip(top_ids[i].tolist(), top_lps[i].tolist())) if k else [])
            for i, (c, r) in enumerate(zip(chosen.tolist(), ranks.tolist()))]


def _any_left(allowed: torch.Tensor, banned: list[int]) -> bool:
    """Whether a packed grammar mask allows any token that is not banned."""
    if banned:
        allowed = allowed.clone()
        for t in banned:
            if t // 32 < allowed.shape[0]:
                allowed[t // 32] &= ~(1 << (t % 32))
    return bool(allowed.any())


def _first_line(text: str) -> str:
    """llguidance's messages carry a parser dump after the first line: the user needs the line."""
    return text.strip().split("\n", 1)[0]

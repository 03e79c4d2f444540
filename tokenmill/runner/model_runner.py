"""ModelRunner: turns a SchedulerOutput into tensors, runs the model once, samples (verifying
drafts where the scheduler sent some), proposes the next drafts, and hands back plain Python ints
(one device-to-host copy per step).

Everything it knows about requests comes through the SchedulerOutput: a request's sampling state
(params, tokens so far) and block table arrive when it is first scheduled, the table changes as
deltas, and the state is dropped when its id comes back in `finished_req_ids`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tokenmill.core.sched_output import DraftRequest, RunnerOutput, ScheduledRequest, SchedulerOutput, StepTiming
from tokenmill.layers.attention import AttentionMetadata, PrefillSegment, forward_context
from tokenmill.models import decode_stack
from tokenmill.models.llama import CausalLM
from tokenmill.runner import kv_cache
from tokenmill.sampling import rejection
from tokenmill.sampling.sampler import Sampler, SamplingRow, noise_seed, token_logprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils import gather_in_huge_pages

log = logging.getLogger("tokenmill")
NON_FINITE = "the model produced non-finite logits (NaN or infinity) for this request"
DEAD_END = "the structured-output constraint allows no next token here (a dead end in the grammar)"
SAMPLING_FAILED = "sampling this request's next token failed (an internal error; see the server log)"


@dataclass
class _ReqState:
    params: SamplingParams
    token_ids: list[int]          # prompt + output so far, as the scheduler has them after each step
    prompt_len: int
    eos_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    matcher: object | None = None  # llguidance matcher of a constrained request, at its last token


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, proposer=None, short_chunk_rows: int = 0, grammars=None) -> None:
        """`short_chunk_rows`: chunks of up to this many tokens after a cached context also run as
        decode rows (through the native decode stack, not the layer-by-layer prefill path). Only
        for a model whose numbers need not equal its chunked prefill's: a draft model, whose
        catch-up on the tokens the target accepted is a short chunk every step."""
        self.model = model
        self.short_chunk_rows = short_chunk_rows
        self.device = device
        self.block_size = block_size
        self.cache = kv_cache.allocate(model.cfg, num_blocks, block_size, dtype, device)
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.cache[0, i], self.cache[1, i]
        if device.type == "cpu":  # before the decode stack takes the panels
            gather_in_huge_pages([(qw.panels, f) for qw in model.quantized_weights() if qw.panels is not None
                                  for f, t in vars(qw.panels).items() if isinstance(t, torch.Tensor)])
        model.decode_stack = decode_stack.build(model)
        self.sampler = Sampler()
        self.proposer = proposer  # tokenmill.spec: fills drafts for the next step, or None
        self.grammars = grammars  # tokenmill.structured GrammarCompiler, or None: constraints not enforced
        self._decode_rows = 0     # rows of the last forward pass when all were decode rows, else 0
        self.states: dict[str, _ReqState] = {}

    # ---------------------------------------------------------------- request state
    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.states.pop(req_id, None)
            if self.proposer is not None:
                self.proposer.drop(req_id)
        for new in sched.new_requests:
            st = self.states[new.req_id] = _ReqState(new.params, list(new.token_ids), new.prompt_len,
                                                     new.eos_token_ids)
            if new.params.structured_outputs is not None and self.grammars is not None:
                # compiled (and cached) when the request was added; a recomputed request replays its output
                st.matcher = self.grammars.matcher(new.params.structured_outputs)
                st.matcher.consume_tokens(st.token_ids[st.prompt_len:])
        for s in sched.scheduled:
            table = self.states[s.req_id].block_table
            del table[s.num_kept_blocks:]
            table.extend(s.new_block_ids)
        if self.proposer is not None:
            for req_id in sched.preempted:
                self.proposer.preempted(req_id)

    # ---------------------------------------------------------------- one step
    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[str]]:
        """Take in the step's request changes and run the model: the logits of every sampled
        position (a request with drafts has 1 + k), and whose each row is."""
        self._update_states(sched)
        if not sched.scheduled:
            return None, []
        input_ids, positions, meta, sample_idx, sample_ids = self._prepare(sched)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        if not sample_ids:
            return None, []
        return self.model.compute_logits(hidden[sample_idx]), sample_ids

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        t0 = time.perf_counter()
        logits, sample_ids = self.forward(sched)
        out.timing = StepTiming(time.perf_counter() - t0, self._decode_rows, sum(s.num_drafts for s in sched.scheduled))
        if logits is None:
            return out
        entries = self._sample(sched, logits, sample_ids, out)
        out.timing.step_s = time.perf_counter() - t0
        if self.proposer is not None:
            self._propose_next(entries, out)
        return out

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor, sample_ids: list[str],
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

    def _propose_next(self, entries: list[ScheduledRequest], out: RunnerOutput) -> None:
        wanted = []
        for e in entries:
            if e.num_propose > 0 and e.req_id in out.sampled:
                st = self.states[e.req_id]
                wanted.append(DraftRequest(e.req_id, st.token_ids, st.prompt_len, st.params, e.num_propose))
        if wanted:
            t0 = time.perf_counter()
            out.draft_token_ids = self._propose(wanted)
            out.timing.propose_s = time.perf_counter() - t0
            # a proposer without passes of its own (prompt lookup) counts as one pass of one row each
            out.timing.propose_passes = getattr(self.proposer, "last_passes", 1)
            out.timing.propose_rows = getattr(self.proposer, "last_rows", len(wanted))

    def _propose(self, wanted: list[DraftRequest]) -> dict[str, list[int]]:
        """Drafts are an optimisation: a proposer that fails costs its drafts this step (and its
        state for these requests, so it starts over), never the requests."""
        try:
            return self.proposer.propose(wanted)
        except Exception:  # noqa: BLE001
            log.exception("proposing drafts for %d request(s) failed; they go on without drafts", len(wanted))
            for w in wanted:
                self.proposer.drop(w.req_id)
            return {}

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
        for req_id, emitted in part.sampled.items():
            self.states[req_id].token_ids.extend(emitted)
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

    def _prepare(self, sched: SchedulerOutput):
        """Flat ragged batch: every scheduled request's tokens back to back.

        slot(t) = block_table[t // block_size] * block_size + t % block_size
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, int, list[int]]] = []
        sample_idx: list[int] = []
        sample_ids: list[str] = []
        for s in sched.scheduled:
            table = self.states[s.req_id].block_table
            q_start = len(input_ids)
            n = len(s.token_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            ctx_len = s.start_pos + n
            nb = -(-ctx_len // bs)
            if s.start_pos > 0 and (n == 1 + s.num_drafts or n <= self.short_chunk_rows):
                # a decode, and its drafts: row i attends over the context up to its own position,
                # exactly as the i-th of 1 + k successive decode steps would
                for i in range(n):
                    decode_idx.append(q_start + i)
                    decode_tables.append(table[:nb])
                    decode_lens.append(s.start_pos + i + 1)
            else:
                prefills.append((q_start, n, s.start_pos, table[:nb]))
            if s.sample:
                first = q_start + n - 1 - s.num_drafts
                sample_idx.extend(range(first, q_start + n))
                sample_ids.extend([s.req_id] * (1 + s.num_drafts))

        dev = self.device
        self._decode_rows = 0 if prefills else len(decode_idx)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev))
        if decode_idx:
            width = max(len(t) for t in decode_tables)
            meta.decode_idx = torch.tensor(decode_idx, dtype=torch.long, device=dev)
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables],
                                                    dtype=torch.long, device=dev)
            lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
            meta.decode_context_lens = lens
            meta.decode_mask = (torch.arange(width * bs, device=dev)[None, :] < lens[:, None])[:, None, None, :]
            meta.all_decode = not prefills
        for q_start, n, start, table in prefills:
            seg = PrefillSegment(q_start, q_start + n, start=start)
            seg.block_table = torch.tensor(table, dtype=torch.long, device=dev)
            if start > 0:  # earlier chunks are in the cache: attend over the whole context
                q_pos = torch.arange(start, start + n, device=dev)
                seg.mask = torch.arange(len(table) * bs, device=dev)[None, :] <= q_pos[:, None]
            meta.prefills.append(seg)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta,
                torch.tensor(sample_idx, dtype=torch.long, device=dev), sample_ids)


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

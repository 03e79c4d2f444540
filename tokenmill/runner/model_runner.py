"""ModelRunner: turns a SchedulerOutput into tensors, runs the model once, has the step sampled
(runner/sampling.py: verifying drafts where the scheduler sent some), proposes the next drafts,
and hands back plain Python ints (one device-to-host copy per step).

Everything it knows about requests comes through the SchedulerOutput: a request's sampling state
(params, tokens so far) and block table arrive when it is first scheduled, the table changes as
deltas, and the state is dropped when its id comes back in `finished_req_ids`.
"""
from __future__ import annotations

import logging
import time

import torch

from tokenmill.core.sched_output import DraftRequest, RunnerOutput, ScheduledRequest, SchedulerOutput, StepTiming
from tokenmill.layers.attention import AttentionMetadata, PrefillSegment, forward_context
from tokenmill.models import decode_stack, kv_smoothing
from tokenmill.models.llama import CausalLM
from tokenmill.pooling_params import PoolingParams
from tokenmill.runner import kv_cache, pooler
from tokenmill.runner.lora import LoRAManager
from tokenmill.runner.sampling import ReqState, StepSampler
from tokenmill.utils import gather_in_huge_pages

log = logging.getLogger("tokenmill")


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, proposer=None, short_chunk_rows: int = 0, grammars=None,
                 normalize_embeddings: bool = True, classifier_tokens: tuple[int, int] | None = None,
                 lora_slots: tuple[int, int, str] | None = None) -> None:
        """`normalize_embeddings`: whether a pooling request's embedding (its last token's final
        hidden state) is L2-normalized unless it says otherwise (the model's pooling config).
        `classifier_tokens`: (no, yes) token ids of a decoder reranker (Qwen3-Reranker): a classify
        request's relevance is the probability of yes against no at its last token.
        `short_chunk_rows`: chunks of up to this many tokens after a cached context also run as
        decode rows (through the native decode stack, not the layer-by-layer prefill path). Only
        for a model whose numbers need not equal its chunked prefill's: a draft model, whose
        catch-up on the tokens the target accepted is a short chunk every step.
        `lora_slots`: (max_loras, max_lora_rank, lora_dtype) to serve LoRA adapters (runner/lora.py), or None."""
        self.model = model
        self.short_chunk_rows = short_chunk_rows
        self.device = device
        self.block_size = block_size
        self.cache = kv_cache.allocate(model.cfg, num_blocks, block_size, dtype, device)
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.cache[0, i], self.cache[1, i]
        # int8: keys stored with their large channels pulled in (one forward pass over random tokens)
        kv_smoothing.attach(model, kv_smoothing.key_scales(model) if dtype == torch.int8 else None)
        if device.type == "cpu":  # before the decode stack takes the panels
            gather_in_huge_pages([(qw.panels, f) for qw in model.quantized_weights() if qw.panels is not None
                                  for f, t in vars(qw.panels).items() if isinstance(t, torch.Tensor)])
        # adapter slots beside the projections, before the decode stack takes them
        self.lora = None if lora_slots is None else LoRAManager(model, *lora_slots, device)
        self.lora_of: dict[str, str] = {}  # request -> the adapter it runs under (absent: the base)
        model.decode_stack = decode_stack.build(model)
        self.proposer = proposer  # tokenmill.spec: fills drafts for the next step, or None
        self.grammars = grammars  # tokenmill.structured GrammarCompiler, or None: constraints not enforced
        self._decode_rows = 0     # rows of the last forward pass when all were decode rows, else 0
        self.states: dict[str, ReqState] = {}
        self.pooling: dict[str, PoolingParams] = {}  # the pooling requests among them
        self.normalize_embeddings = normalize_embeddings
        self.classifier_tokens = classifier_tokens
        self.pooled_rows: torch.Tensor | None = None  # set by `forward`, taken by `execute`
        self.step_sampler = StepSampler(self.states, grammars, proposer)
        self.sampler = self.step_sampler.sampler

    # ---------------------------------------------------------------- request state
    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.states.pop(req_id, None)
            self.pooling.pop(req_id, None)
            self.lora_of.pop(req_id, None)
            if self.proposer is not None:
                self.proposer.drop(req_id)
        for new in sched.new_requests:
            st = self.states[new.req_id] = ReqState(new.params, new.token_ids, new.prompt_len,
                                                     new.eos_token_ids)
            if new.pooling is not None:
                self.pooling[new.req_id] = new.pooling
            if new.lora_name is not None:
                if self.lora is None:
                    raise RuntimeError(f"request {new.req_id} names LoRA adapter {new.lora_name!r} but the runner "
                                       "serves none")
                self.lora_of[new.req_id] = new.lora_name
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
        position (a request with drafts has 1 + k), and whose each row is. The final hidden states
        of the pooling requests' last tokens wait in `self.pooled_rows` for `execute`."""
        self._update_states(sched)
        self.pooled_rows = None
        if not sched.scheduled:
            return None, []
        input_ids, positions, meta, sample_idx, sample_ids = self._prepare(sched)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        pool_idx = _last_rows(sched)
        if pool_idx:
            self.pooled_rows = hidden[pool_idx]
        if not sample_ids:
            return None, []
        return self.model.compute_logits(hidden[sample_idx]), sample_ids

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        t0 = time.perf_counter()
        logits, sample_ids = self.forward(sched)
        out.timing = StepTiming(time.perf_counter() - t0, self._decode_rows, sum(s.num_drafts for s in sched.scheduled))
        if self.pooled_rows is not None:  # last-token pooling
            ids = [s.req_id for s in sched.scheduled if s.pool]
            params = [self.pooling[i] for i in ids]
            logits = None
            if any(p.task == "classify" for p in params):  # a decoder reranker: its two tokens' logits
                no, yes = self.classifier_tokens
                both = self.model.compute_logits(self.pooled_rows)[:, [no, yes]]
                logits = both[:, 1:] - both[:, :1]  # sigmoid(yes - no) = softmax over the two
            pooler.finish(out, ids, params, self.pooled_rows, logits, self.normalize_embeddings)
            self.pooled_rows = None
        if logits is None:
            return out
        entries = self.step_sampler.sample(sched, logits, sample_ids, out)
        out.timing.step_s = time.perf_counter() - t0
        if self.proposer is not None:
            self._propose_next(entries, out)
        return out

    def _propose_next(self, entries: list[ScheduledRequest], out: RunnerOutput) -> None:
        wanted = []
        for e in entries:
            if e.num_propose > 0 and e.req_id in out.sampled:
                st = self.states[e.req_id]
                wanted.append(DraftRequest(e.req_id, st.token_ids + out.sampled[e.req_id], st.prompt_len, st.params,
                                            e.num_propose))
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
        if self.lora is not None:
            meta.lora = self.lora.rows([(self.lora_of.get(s.req_id), len(s.token_ids)) for s in sched.scheduled], dev)
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


def _last_rows(sched: SchedulerOutput) -> list[int]:
    """Rows of the flat batch holding each pooled request's last prompt token."""
    rows, end = [], 0
    for s in sched.scheduled:
        end += len(s.token_ids)
        if s.pool:
            rows.append(end - 1)
    return rows

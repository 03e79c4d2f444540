"""ModelRunner: turns a SchedulerOutput into tensors, runs the model once, samples, and hands
back plain Python ints (one device-to-host copy per step).

It keeps per-request sampling state (params, tokens so far, seeded generator) between steps,
registered by the engine with `add_request` and dropped with `remove_request`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.layers.attention import AttentionMetadata, PrefillSegment, forward_context
from tokenmill.models import decode_stack
from tokenmill.models.llama import CausalLM
from tokenmill.runner import kv_cache
from tokenmill.sampling.sampler import Sampler, SamplingRow
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils import gather_in_huge_pages

log = logging.getLogger("tokenmill")
NON_FINITE = "the model produced non-finite logits (NaN or infinity) for this request"
SAMPLING_FAILED = "sampling this request's next token failed (an internal error; see the server log)"


@dataclass
class _ReqState:
    params: SamplingParams
    token_ids: list[int]
    prompt_len: int
    eos_ids: list[int]
    generator: torch.Generator | None


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.cache = kv_cache.allocate(model.cfg, num_blocks, block_size, dtype, device)
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.cache[0, i], self.cache[1, i]
        if device.type == "cpu":  # before the decode stack takes the panels
            gather_in_huge_pages([(qw.panels, f) for qw in model.quantized_weights() if qw.panels is not None
                                  for f in ("q", "s", "m") if hasattr(qw.panels, f)])
        model.decode_stack = decode_stack.build(model)
        self.sampler = Sampler()
        self.states: dict[str, _ReqState] = {}

    # ---------------------------------------------------------------- request state
    def add_request(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_ids: set[int]) -> None:
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        self.states[req_id] = _ReqState(params, list(prompt_token_ids), len(prompt_token_ids),
                                        sorted(eos_ids), gen)

    def remove_request(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    # ---------------------------------------------------------------- one step
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, meta, sample_idx, sample_ids = self._prepare(sched)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        out = RunnerOutput()
        if not sample_ids:
            return out
        logits = self.model.compute_logits(hidden[sample_idx])
        # faults that belong to one request fail that request only (the engine keeps the others):
        # a row with NaN or infinity anywhere (one pass: its sum is then not finite) ...
        bad = (~torch.isfinite(logits.sum(dim=-1))).nonzero()[:, 0].tolist()
        if bad:
            for i in bad:
                out.failed[sample_ids[i]] = NON_FINITE
            keep = sorted(set(range(len(sample_ids))) - set(bad))
            logits, sample_ids = logits[keep], [sample_ids[i] for i in keep]
            if not sample_ids:
                return out
        rows = [self._row(req_id) for req_id in sample_ids]
        try:
            self._take(self.sampler(logits, rows), sample_ids, out)
        except Exception:  # noqa: BLE001 - ... and a sampler error: find the row(s) that raise
            log.exception("sampling a batch of %d failed; sampling its rows one by one", len(rows))
            for i, req_id in enumerate(sample_ids):
                try:
                    self._take(self.sampler(logits[i:i + 1], rows[i:i + 1]), [req_id], out)
                except Exception:  # noqa: BLE001
                    log.exception("sampling request %s failed", req_id)
                    out.failed[req_id] = SAMPLING_FAILED
        return out

    def _take(self, result, sample_ids: list[str], out: RunnerOutput) -> None:
        """Commit a sampler result: nothing is recorded unless all of it converts."""
        tokens, part = result.token_ids.tolist(), RunnerOutput()
        if result.logprobs is not None:
            self._collect_logprobs(result, sample_ids, part)
        for req_id, tok in zip(sample_ids, tokens):
            out.sampled[req_id] = tok
            self.states[req_id].token_ids.append(tok)
        out.logprobs.update(part.logprobs)

    def _row(self, req_id: str) -> SamplingRow:
        st = self.states[req_id]
        p = st.params
        banned = []
        if len(st.token_ids) - st.prompt_len < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else st.eos_ids)
        return SamplingRow(p, st.token_ids, st.prompt_len, st.generator, banned)

    def _collect_logprobs(self, result, sample_ids: list[str], out: RunnerOutput) -> None:
        chosen = result.logprobs.tolist()
        ranks = result.ranks.tolist()
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        for i, req_id in enumerate(sample_ids):
            k = self.states[req_id].params.logprobs
            if k is None:
                continue
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k and top_ids is not None else []
            out.logprobs[req_id] = (chosen[i], ranks[i], top)

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
            q_start = len(input_ids)
            n = len(s.token_ids)
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + n)
            positions.extend(pos)
            slots.extend(s.block_table[p // bs] * bs + p % bs for p in pos)
            ctx_len = s.start_pos + n
            nb = -(-ctx_len // bs)
            if n == 1 and s.start_pos > 0:
                decode_idx.append(q_start)
                decode_tables.append(s.block_table[:nb])
                decode_lens.append(ctx_len)
            else:
                prefills.append((q_start, n, s.start_pos, s.block_table[:nb]))
            if s.sample:
                sample_idx.append(q_start + n - 1)
                sample_ids.append(s.req_id)

        dev = self.device
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

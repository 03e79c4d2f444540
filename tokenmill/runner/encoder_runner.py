"""EncoderRunner: the runner of an encoder model (models/encoder.py), behind the same
`execute(SchedulerOutput) -> RunnerOutput` contract as the decoders' ModelRunner.

An encoder keeps no KV cache: the scheduler sends every input whole in one step (its
`whole_prompts` mode; block ids there are bookkeeping only), and each one ends that step with its
vector: the pooled embedding (the checkpoint's sentence-transformers config) or, for a
cross-encoder, its classifier's probabilities.
"""
from __future__ import annotations

import time

import torch

from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput, StepTiming
from tokenmill.models.encoder import Encoder
from tokenmill.models.pooling import PoolingConfig
from tokenmill.pooling_params import PoolingParams
from tokenmill.runner import pooler


class EncoderRunner:
    def __init__(self, model: Encoder, pooling: PoolingConfig, device: torch.device) -> None:
        self.model, self.pooling, self.device = model, pooling, device
        self.params: dict[str, PoolingParams] = {}  # requests scheduled and not yet reported finished

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        for req_id in sched.finished_req_ids:
            self.params.pop(req_id, None)
        for new in sched.new_requests:
            if new.pooling is None:
                raise ValueError(f"request {new.req_id} asks an encoder to generate; the engine admits only "
                                 "pooling requests to one.")
            self.params[new.req_id] = new.pooling
        out = RunnerOutput()
        if not sched.scheduled:
            return out
        t0 = time.perf_counter()
        entries = sched.scheduled
        params = [self.params[e.req_id] for e in entries]
        lengths = [len(e.token_ids) for e in entries]
        ids = torch.tensor([t for e in entries for t in e.token_ids], dtype=torch.long, device=self.device)
        hidden = self.model(ids, lengths, self._token_types(params, lengths))
        ids = [e.req_id for e in entries]
        vectors = self.pooling(hidden, lengths) if any(p.task == "embed" for p in params) else None
        logits = self.model.classify(hidden, lengths) if any(p.task == "classify" for p in params) else None
        pooler.finish(out, ids, params, vectors, logits, self.pooling.normalize)
        out.timing = StepTiming(time.perf_counter() - t0, 0)
        return out

    def _token_types(self, params: list[PoolingParams], lengths: list[int]) -> torch.Tensor | None:
        """Token type 1 from where a pair's second text begins (BERT); RoBERTa-style models have
        one type and tell the texts apart by their separators."""
        if self.model.cfg.type_vocab_size < 2 or all(p.pair_start is None for p in params):
            return None
        types = [[0] * n if p.pair_start is None else [0] * p.pair_start + [1] * (n - p.pair_start)
                 for p, n in zip(params, lengths)]
        return torch.tensor([t for row in types for t in row], dtype=torch.long, device=self.device)

"""The last stage of a pooling request, shared by the decoder and encoder runners: from a pooled
vector (or a classifier's logits) to what the request gets back, as plain floats.

Matryoshka truncation comes before normalization (the models were trained to be cut there and
then normalized); a classifier with one output is a relevance score (sigmoid, as
sentence-transformers' CrossEncoder and vLLM's score API give it), with several a softmax. A
request whose vector is not finite fails alone, as a sampled request with non-finite logits does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.core.sched_output import RunnerOutput
from tokenmill.pooling_params import PoolingParams

NON_FINITE = "the model produced a non-finite vector (NaN or infinity) for this request"


def embeddings(vectors: torch.Tensor, params: list[PoolingParams], normalize: bool) -> list[list[float]]:
    """(B, dim) pooled vectors -> each request's embedding; `normalize`: the model's default."""
    out = []
    for v, p in zip(vectors.float(), params):
        if p.dimensions is not None:
            v = v[:p.dimensions]
        if normalize if p.normalize is None else p.normalize:
            v = F.normalize(v, dim=-1)
        out.append(v.tolist())
    return out


def probabilities(logits: torch.Tensor) -> list[list[float]]:
    """(B, labels) classifier logits -> each request's probabilities (one label: its sigmoid)."""
    logits = logits.float()
    probs = torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
    return probs.tolist()


def finish(out: RunnerOutput, req_ids: list[str], params: list[PoolingParams], vectors: torch.Tensor | None,
           logits: torch.Tensor | None, normalize: bool) -> None:
    """Fill `out.pooled` (or `out.failed`) for the step's pooled requests: `vectors` (B, dim) their
    pooled states (read by embed requests), `logits` (B, labels) their classifier's (classify)."""
    for task, source in (("embed", vectors), ("classify", logits)):
        rows = [i for i, p in enumerate(params) if p.task == task]
        if not rows:
            continue
        values = source[rows].float()
        finite = torch.isfinite(values).all(dim=-1).tolist()
        made = embeddings(values, [params[i] for i in rows], normalize) if task == "embed" else probabilities(values)
        for i, ok, v in zip(rows, finite, made):
            if ok:
                out.pooled[req_ids[i]] = v
            else:
                out.failed[req_ids[i]] = NON_FINITE

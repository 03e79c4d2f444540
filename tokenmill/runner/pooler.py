"""The last stage of a pooling request, shared by the decoder and encoder runners: from a pooled
vector (or a classifier's logits) to what the request gets back, as plain floats.

Matryoshka truncation comes before normalization (the models were trained to be cut there and
then normalized); a classifier with one output is a relevance score (sigmoid, as
sentence-transformers' CrossEncoder and vLLM's score API give it), with several a softmax.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.pooling_params import PoolingParams


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

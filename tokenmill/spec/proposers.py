"""What a proposer is to the runner, and the one a speculative config asks for."""
from __future__ import annotations

from typing import Protocol

import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.models import loader
from tokenmill.models.loader import LoadedModel
from tokenmill.spec.ngram import NgramProposer
from tokenmill.core.sched_output import DraftRequest


class Proposer(Protocol):
    def propose(self, wanted: list[DraftRequest]) -> dict[str, list[int]]:
        """Drafts for the requests that have any."""

    def draft_probs(self, req_id: str):
        """The distributions the request's last drafts were drawn from, (k, V), or None where
        they are point masses (prompt lookup; a draft model's greedy drafts)."""

    def preempted(self, req_id: str) -> None:
        """The request lost its KV blocks; a proposer with a cache of its own may drop it too."""

    def drop(self, req_id: str) -> None:
        """The request finished: forget it."""


def load_draft(spec: SpeculativeConfig, target: LoadedModel, dtype: str, device: torch.device) -> LoadedModel:
    """The draft model of a `draft_model` config, checked against the target's vocabulary."""
    from tokenmill.spec.draft_model import check_compatible

    draft = loader.load(spec.model, dtype, device, load_tokenizer=target.tokenizer is not None,
                        quantization=spec.quantization)
    check_compatible(draft, target, spec.model)
    return draft


def build(spec: SpeculativeConfig, draft: LoadedModel | None, num_blocks: int, block_size: int,
          device: torch.device, kv_dtype: torch.dtype, enable_prefix_caching: bool) -> Proposer:
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from tokenmill.spec.draft_model import DraftModelProposer

    return DraftModelProposer(draft, num_blocks, block_size, device, kv_dtype, enable_prefix_caching)

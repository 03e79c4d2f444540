"""What the runner asks a proposer for: plain data."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sampling_params import SamplingParams


@dataclass
class DraftRequest:
    req_id: str
    token_ids: list[int]   # prompt + output so far (the runner's list: read, never change it)
    prompt_len: int
    params: SamplingParams
    num_drafts: int        # most drafts wanted

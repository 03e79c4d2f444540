"""PoolingParams: what a user may ask of one embedding or score, validated at the door (vLLM's
class of the same name). A pooling request runs its prompt through the model once and gets one
vector back instead of generated tokens; nothing of it stays in the KV cache but the prefix
blocks other requests may share."""
from __future__ import annotations

from dataclasses import dataclass

TASKS = ("embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: keep the first this many dimensions of the embedding (Matryoshka models;
    before normalization, as they were trained). `normalize`: L2-normalize the embedding (None:
    as the model's pooling config says). `task` is set by the caller of the engine: "embed" (a
    vector) or "classify" (a sequence-classification head's probabilities: a cross-encoder's
    relevance score). `pair_start`: where the second text of a cross-encoder pair begins in the
    prompt's tokens (its token type is 1), None for one text."""
    dimensions: int | None = None
    normalize: bool | None = None
    task: str = "embed"
    pair_start: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"pooling task must be one of {list(TASKS)}, got {self.task!r}.")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r:.50}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r:.50}.")
        if self.dimensions is not None and self.task != "embed":
            raise ValueError("dimensions applies to embeddings only.")

"""What a model serves — generate, embed, classify — decided once when the engine is built, and the
checks a pooling request passes against it before it is queued.

A decoder generates, and embeds by its last token's final hidden state unless its pooling config
asks for another pooling; given two classifier tokens (no, yes) it is a reranker instead
(Qwen3-Reranker: relevance = P(yes) against P(no) after the pair). An encoder embeds, or
classifies when it has a sequence-classification head (a cross-encoder).
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.models import pooling
from tokenmill.models.pooling import PoolingConfig
from tokenmill.pooling_params import PoolingParams


@dataclass(frozen=True)
class Tasks:
    tasks: frozenset[str]
    pooling: PoolingConfig | None            # how an embedding is made (None: the model does not embed)
    embedding_size: int
    matryoshka: bool                         # `dimensions` may cut its embeddings
    classifier_tokens: tuple[int, int] | None = None  # a decoder reranker's (no, yes) token ids

    def check(self, params: PoolingParams, num_tokens: int, max_model_len: int) -> None:
        """ValueError saying why this model cannot serve the pooling request."""
        if params.task not in self.tasks:
            raise ValueError(f"this model serves {sorted(self.tasks)}, not {params.task!r} requests.")
        if params.dimensions is not None:
            if not self.matryoshka:
                raise ValueError("this model's embeddings cannot be shortened: its config declares no Matryoshka "
                                 "dimensions; leave dimensions unset.")
            if params.dimensions > self.embedding_size:
                raise ValueError(f"dimensions {params.dimensions} is more than the model's {self.embedding_size}.")
        if num_tokens > max_model_len:
            raise ValueError(f"the input has {num_tokens} tokens but the model's context (max_model_len) is "
                             f"{max_model_len}; shorten it or ask for truncation.")
        if params.pair_start is not None and not 0 < params.pair_start < num_tokens:
            raise ValueError(f"pair_start {params.pair_start} is not inside the input's {num_tokens} tokens.")


def for_encoder(path: str, task: str, num_labels: int, pooled: PoolingConfig, hidden_size: int,
                matryoshka: bool) -> Tasks:
    served = "classify" if num_labels and task != "embed" else "embed"
    if task not in ("auto", served):
        raise ValueError(f"{path} is an encoder{' with a classification head' if num_labels else ''}; it serves "
                         f"task {served!r}, not {task!r}.")
    return Tasks(frozenset([served]), pooled, pooled.dim(hidden_size), matryoshka)


def for_decoder(path: str, task: str, hidden_size: int, classifier_tokens: tuple[int, int] | None) -> Tasks:
    if classifier_tokens is not None:
        if task not in ("auto", "classify"):
            raise ValueError(f"classifier_from_token makes a reranker (task classify), not task {task!r}.")
        return Tasks(frozenset(["classify"]), None, hidden_size, False, classifier_tokens)
    if task == "classify":
        raise ValueError(f"{path} is a decoder; task 'classify' needs classifier_from_token (a yes/no reranker) "
                         "or an encoder with a sequence-classification head.")
    try:
        pooled = pooling.for_decoder(path)
    except ValueError:
        if task == "embed":
            raise
        pooled = None  # it only generates: its pooling config asks for what a decoder cannot do
    served = {"generate": ["generate"], "embed": ["embed"]}.get(
        task, ["generate"] + (["embed"] if pooled is not None else []))
    return Tasks(frozenset(served), pooled, hidden_size, pooling.declares_matryoshka(path))


def token_id(tokenizer, vocab_size: int, token: str) -> int:
    """A classifier token given as its text (one token of the vocabulary) or its id."""
    tid = int(token) if token.isdigit() else None
    if tid is None and tokenizer is not None:
        tid = tokenizer.tok.token_to_id(token)
        if tid is None:
            ids = tokenizer.encode(token, add_special_tokens=False)
            tid = ids[0] if len(ids) == 1 else None
    if tid is None or not 0 <= tid < vocab_size:
        raise ValueError(f"classifier_from_token: {token!r} is not one token of this model's vocabulary.")
    return tid

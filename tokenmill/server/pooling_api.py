"""The pooling routes: OpenAI's `/v1/embeddings`, Jina/Cohere's `/rerank` (and `/v1/rerank`) and
vLLM's `/score` (and `/v1/score`), over the same EngineClient as generation.

Every input becomes one pooling request (PoolingParams), all submitted at once so the engine
batches them. Relevance comes from the model's classifier where it is a cross-encoder (each
query-document pair one input), else from the cosine similarity of the two texts' embeddings,
as vLLM scores with an embedding model.
"""
from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.pooling_params import PoolingParams
from tokenmill.server.errors import APIError
from tokenmill.server.guard import cache_salt
from tokenmill.server.responses import timings
from tokenmill.server.streaming import collect_all, start_all, until_disconnected

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted, no effect (OpenAI's abuse-monitoring tag)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM: -1 cuts to the context
    normalize: bool | None = None
    priority: int = 0
    cache_salt: str | None = None


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    query: str
    documents: list[str | dict]
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = 0


def add_routes(app: FastAPI, client, check_model, off_loop, model_name: str) -> None:
    """`check_model(name)`: None for the base model, the adapter's name for a LoRA adapter (the
    requests run under it), 404 for anything else."""
    def truncation(value: int | None) -> int | None:
        if value == 0:
            raise APIError(400, "truncate_prompt_tokens must be -1 (the context length) or positive",
                           param="truncate_prompt_tokens")
        return client.max_model_len if value == -1 else value

    def need(task: str, what: str) -> None:
        if task not in client.tasks:
            raise APIError(400, f"this model serves {sorted(client.tasks)}; {what} needs a model that serves "
                                f"'{task}'", param="model")

    async def encode(texts: list[str | list[int]], truncate: int | None, pair: list[str] | None = None
                     ) -> list[tuple[list[int], int | None]]:
        """(token ids, where the second text begins) of each input, special tokens added."""
        tok = client.tokenizer
        if tok is None and any(isinstance(t, str) for t in texts):
            raise APIError(400, "this server runs without a tokenizer; send token ids", param="input")

        def one(i: int):
            t = texts[i]
            if not isinstance(t, str):
                return (t[:truncate] if truncate else t), None
            try:
                return tok.encode_input(t, None if pair is None else pair[i], truncate)
            except Exception as e:  # noqa: BLE001 - tokenizers' truncation errors are plain Exceptions
                raise APIError(400, f"cannot cut the input to {truncate} tokens: {e}",
                               param="truncate_prompt_tokens") from None
        return await off_loop(lambda: [one(i) for i in range(len(texts))])

    async def run(raw: Request, prefix: str, inputs, params: list[PoolingParams], priority: int = 0,
                  salt: str | None = None, lora: str | None = None):
        streams = [client.generate(f"{prefix}-{i}", ids, p, priority, salt, lora)
                   for i, ((ids, _), p) in enumerate(zip(inputs, params))]
        firsts = await until_disconnected(raw, start_all(streams), streams)
        return await until_disconnected(raw, collect_all(streams, firsts), streams)

    async def relevance(raw: Request, rid: str, queries: list[str], docs: list[str], truncate: int | None,
                        priority: int, lora: str | None) -> tuple[list[float], int]:
        """Each (query, document) pair's score and the prompt tokens read."""
        if "classify" in client.tasks:
            inputs = await encode(queries, truncate, docs)
            outs = await run(raw, rid, inputs, [PoolingParams(task="classify", pair_start=s) for _, s in inputs],
                             priority, lora=lora)
            if len(outs[0].outputs.data) != 1:
                raise APIError(400, f"this classifier has {len(outs[0].outputs.data)} labels; a relevance score "
                                    "needs a cross-encoder with one", param="model")
            return [o.outputs.data[0] for o in outs], sum(len(o.prompt_token_ids) for o in outs)
        need("embed", "scoring")
        unique = list(dict.fromkeys(queries + docs))
        inputs = await encode(unique, truncate)
        outs = await run(raw, rid, inputs, [PoolingParams(normalize=True)] * len(unique), priority, lora=lora)
        vec = {t: o.outputs.data for t, o in zip(unique, outs)}
        return ([sum(x * y for x, y in zip(vec[q], vec[d])) for q, d in zip(queries, docs)],
                sum(len(o.prompt_token_ids) for o in outs))

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request):
        lora = check_model(req.model)
        need("embed", "/v1/embeddings")
        texts = _inputs(req.input)
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        except ValueError as e:
            raise APIError(400, str(e), param="dimensions" if "dimensions" in str(e) else "normalize") from None
        rid = f"embd-{uuid.uuid4().hex}"
        inputs = await encode(texts, truncation(req.truncate_prompt_tokens))
        outs = await run(raw, rid, inputs, [params] * len(inputs), req.priority, cache_salt(raw, req.cache_salt), lora)
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(o.outputs.data) if req.encoding_format == "base64" else o.outputs.data}
                for i, o in enumerate(outs)]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        first = timings(outs[0])
        body = {"id": rid, "object": "list", "created": int(time.time()), "model": req.model or model_name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "timings": first.model_dump() if first else None}
        # serialized once here: FastAPI's encoder would first walk every float of every vector
        return Response(json.dumps(body), media_type="application/json")

    async def rerank(req: RerankRequest, raw: Request):
        lora = check_model(req.model)
        docs = [_document_text(d, i) for i, d in enumerate(req.documents)]
        if not docs:
            raise APIError(400, "documents must not be empty", param="documents")
        rid = f"rerank-{uuid.uuid4().hex}"
        scores, tokens = await relevance(raw, rid, [req.query] * len(docs), docs,
                                         truncation(req.truncate_prompt_tokens), req.priority, lora)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or len(docs)]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})} for i in order]
        return {"id": rid, "model": req.model or model_name, "usage": {"total_tokens": tokens}, "results": results}

    app.post("/rerank")(rerank)
    app.post("/v1/rerank")(rerank)

    async def score(req: ScoreRequest, raw: Request):
        lora = check_model(req.model)
        one = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        two = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        if not one or not two:
            raise APIError(400, "text_1 and text_2 must not be empty", param="text_1" if not one else "text_2")
        if len(one) == 1:
            one = one * len(two)
        elif len(one) != len(two):
            raise APIError(400, f"text_1 has {len(one)} texts and text_2 {len(two)}: give one text_1, or lists of "
                                "one length", param="text_2")
        rid = f"score-{uuid.uuid4().hex}"
        scores, tokens = await relevance(raw, rid, one, two, truncation(req.truncate_prompt_tokens), req.priority, lora)
        return {"id": rid, "object": "list", "created": int(time.time()), "model": req.model or model_name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    app.post("/score")(score)
    app.post("/v1/score")(score)


def _inputs(value) -> list[str | list[int]]:
    """OpenAI's `input`: a string, strings, token ids, or lists of token ids; never empty."""
    if isinstance(value, str):
        texts = [value]
    elif value and all(isinstance(v, int) for v in value):
        texts = [value]
    else:
        texts = list(value)
    if not texts or any(len(t) == 0 for t in texts):
        raise APIError(400, "input must not be empty, nor hold an empty text", param="input")
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(texts)} texts; at most {MAX_INPUTS} per request", param="input")
    return texts


def _document_text(doc: str | dict, i: int) -> str:
    """A document as text: a string, or Cohere's {"text": ...}."""
    if isinstance(doc, str):
        return doc
    text = doc.get("text")
    if not isinstance(text, str) or set(doc) != {"text"}:
        raise APIError(400, f"documents[{i}] must be a string or an object with only a 'text' string",
                       param="documents")
    return text


def _base64(vec: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values little-endian, base64 of the bytes."""
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()

"""Embeddings per second: C concurrent clients each posting B texts per request (one query at a
time: B=1; a document indexer's batches: B=32) to an OpenAI-compatible /v1/embeddings
(tokenmill serve, llama-server --embeddings), or
sentence-transformers' `encode` over the same texts in-process (its own batching, no HTTP: the
library as a RAG pipeline calls it). One JSON line per run.

    python embed_client.py server URL --words N --num M --concurrency C [--batch B]
    python embed_client.py st HF_DIR --words N --num M
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

sys.path.insert(0, __import__("os").path.dirname(__file__))
import make_bert  # noqa: E402


def texts(num: int, n_words: int, seed: int = 0) -> list[str]:
    """`num` texts of `n_words` whole-word tokens each (n_words + 2 tokens with [CLS] and [SEP])."""
    rng = random.Random(seed)
    ws = make_bert.words(make_bert.vocabulary())
    return [" ".join(rng.choices(ws, k=n_words)) for _ in range(num)]


async def serve(url: str, items: list[str], concurrency: int, batch: int) -> dict:
    import httpx

    queue = [items[i:i + batch] for i in range(0, len(items), batch)][::-1]
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            texts = queue.pop()
            r = await client.post(url + "/v1/embeddings",
                                  json={"model": "bench", "input": texts[0] if batch == 1 else texts})
            r.raise_for_status()
            body = r.json()
            assert len(body["data"]) == len(texts) and all(d["embedding"] for d in body["data"]), body
            tokens += body["usage"]["prompt_tokens"]

    # this process's own start-up (imports, the texts) keeps a core busy for a second or two, beside
    # the server: let that pass before the clock starts, as no client starts beside a real server
    await asyncio.sleep(3)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:
        (await client.post(url + "/v1/embeddings", json={"model": "bench", "input": "warm up"})).raise_for_status()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"embeddings_per_s": len(items) / elapsed, "tokens_per_s": tokens / elapsed, "elapsed_s": elapsed}


def st(path: str, items: list[str]) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    model.encode(items[:32])  # warm-up
    t0 = time.perf_counter()
    with torch.inference_mode():
        vecs = model.encode(items, batch_size=32)
    elapsed = time.perf_counter() - t0
    assert len(vecs) == len(items)
    return {"embeddings_per_s": len(items) / elapsed, "elapsed_s": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["server", "st"])
    ap.add_argument("target")
    ap.add_argument("--words", type=int, required=True)
    ap.add_argument("--num", type=int, required=True)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="texts per request")
    ap.add_argument("--peer", required=True)
    args = ap.parse_args()
    items = texts(args.num, args.words)
    res = asyncio.run(serve(args.target, items, args.concurrency, args.batch)) if args.kind == "server" else st(args.target, items)
    print(json.dumps({"peer": args.peer, "tokens_per_text": args.words + 2, "texts": args.num,
                      "concurrency": args.concurrency if args.kind == "server" else None,
                      "batch": args.batch if args.kind == "server" else 32, **res}))


if __name__ == "__main__":
    main()

"""Structured outputs' cost, measured through a running OpenAI-compatible server: the same chat
prompts with and without a JSON schema (response_format), alternated request by request at
concurrency 1 and C, and the time to first token of a request whose schema the server has not seen
against one whose schema it has (what compiling a new schema adds). Outputs end where the model or
the schema ends them (no ignore_eos: a schema decides where the output ends), so speeds are output
tokens over decode time. Appends JSON lines to --out.

    python benchmarks/structured_client.py --base-url http://127.0.0.1:8020 --concurrency 1,16 --out r.jsonl
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

from openai import AsyncOpenAI

PEOPLE = ["a retired sailor from Brest", "a chemistry student in Lyon", "a baker who runs marathons",
          "a pianist touring Japan", "a nurse in a mountain village", "a software engineer who paints",
          "a beekeeper in Provence", "a taxi driver in Marseille"]
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "job", "hobbies", "bio"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 40},
                         "job": {"type": "string", "maxLength": 60},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
                         "bio": {"type": "string", "maxLength": 400}}}


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Invent {PEOPLE[i % len(PEOPLE)]}. Give their name, age, city, job, "
                                        "hobbies and a short biography, as JSON."}]


async def one(client: AsyncOpenAI, model: str, i: int, schema: dict | None, max_tokens: int) -> dict:
    kw = {} if schema is None else {"response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": schema}}}
    t0 = time.perf_counter()
    first = last = None
    usage = finish = None
    text = []
    stream = await client.chat.completions.create(model=model, messages=messages(i), max_tokens=max_tokens,
                                                  temperature=0.7, seed=i, stream=True,
                                                  stream_options={"include_usage": True}, **kw)
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
            text.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    valid = None
    if schema is not None and finish == "stop":  # an output cut by max_tokens is not expected to parse
        try:
            json.loads("".join(text))
            valid = True
        except ValueError:
            valid = False
    return {"tokens": usage.completion_tokens, "ttft": (first or t0) - t0,
            "decode_s": (last - first) if first else 0.0, "end": time.perf_counter(), "start": t0, "valid": valid,
            "finish": finish}


async def load(client, model, n: int, conc: int, schema, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(conc)

    async def run(i):
        async with sem:
            return await one(client, model, i, schema, max_tokens)
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(run(i) for i in range(n)))
    wall = max(r["end"] for r in rs) - t0
    toks = sum(r["tokens"] for r in rs)
    dec = sum(max(r["tokens"] - 1, 0) for r in rs) / max(sum(r["decode_s"] for r in rs), 1e-9)
    return {"requests": n, "output_tokens": toks, "throughput_tok_s": toks / wall,
            "decode_tok_s_per_stream": dec, "ttft_median_s": statistics.median(r["ttft"] for r in rs),
            "invalid_json": sum(r["valid"] is False for r in rs), "cut_by_max_tokens": sum(r["finish"] == "length" for r in rs)}


async def compile_cost(client, model, n: int) -> dict:
    """TTFT with a schema the server has never seen (a fresh property name makes it new) vs the
    same schema again (cached), alternated; one token each."""
    fresh, cached = [], []
    for _ in range(n):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"][f"f{uuid.uuid4().hex[:8]}"] = {"type": "string", "maxLength": 8}
        for bucket in (fresh, cached):
            r = await one(client, model, 0, schema, 1)
            bucket.append(r["ttft"])
    return {"ttft_new_schema_ms": 1e3 * statistics.median(fresh), "ttft_cached_schema_ms": 1e3 * statistics.median(cached),
            "compile_ms": 1e3 * (statistics.median(fresh) - statistics.median(cached))}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model-name", default="default")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=0, help="per mode and concurrency (default 8 x concurrency, >= 16)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--label", default="tokenmill")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    client = AsyncOpenAI(base_url=args.base_url + "/v1", api_key="none", timeout=600, max_retries=0)
    await one(client, args.model_name, 0, SCHEMA, 8)  # warm-up (and the schema compiled once)
    rows = []
    for conc in map(int, args.concurrency.split(",")):
        n = args.requests or max(16, 4 * conc)
        for mode, schema in (("plain", None), ("json_schema", SCHEMA), ("plain", None), ("json_schema", SCHEMA)):
            r = await load(client, args.model_name, n, conc, schema, args.max_tokens)
            rows.append({"label": args.label, "mode": mode, "concurrency": conc, **r})
            print(f"{mode:12s} c={conc:<3d} {r['throughput_tok_s']:7.1f} tok/s  per stream "
                  f"{r['decode_tok_s_per_stream']:6.1f}  invalid {r['invalid_json']}  cut {r['cut_by_max_tokens']}",
                  flush=True)
    c = await compile_cost(client, args.model_name, 10)
    rows.append({"label": args.label, "mode": "compile", **c})
    print(f"new schema TTFT {c['ttft_new_schema_ms']:.1f} ms, cached {c['ttft_cached_schema_ms']:.1f} ms", flush=True)
    with open(args.out, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    asyncio.run(main())

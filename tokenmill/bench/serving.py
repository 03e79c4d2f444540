"""`tokenmill bench serve`: load any OpenAI-compatible server (tokenmill, llama.cpp, vLLM) with
streaming requests, closed-loop at fixed concurrency or open-loop with Poisson arrivals.

Metric definitions follow vLLM's benchmark_serving: TTFT = send -> first text chunk; TPOT =
(E2E - TTFT) / (output tokens - 1) per request; ITL = gaps between text chunks, pooled; E2E =
send -> end of stream. Output tokens come from the server's usage report when it sends one.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from tokenmill.bench.workload import Item


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0
    itl: list[float] = field(default_factory=list)


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> Result:
    res = Result(max_tokens=body["max_tokens"])
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    res.output_tokens = data["usage"].get("completion_tokens", 0)
                    res.prompt_tokens = data["usage"].get("prompt_tokens", 0)
                choices = data.get("choices") or []
                text = "".join((c.get("text") or (c.get("delta") or {}).get("content") or "") for c in choices)
                if not text:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = last is not None
        if not res.ok:
            res.error = "no text streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _body(item: Item, model: str, endpoint: str, eos_mode: str) -> dict:
    body = {"model": item.model or model, "max_tokens": item.max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, **(item.extra or {})}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    if "ignore_eos" in eos_mode:
        body["ignore_eos"] = True
    if "min_tokens" in eos_mode:
        body["min_tokens"] = item.max_tokens
    return body


async def run(base_url: str, model: str, items: list[Item], concurrency: int, request_rate: float | None,
              endpoint: str = "completions", eos_mode: str = "ignore_eos", api_key: str | None = None,
              seed: int = 0) -> dict:
    url = base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)

        async def worker(item: Item) -> None:
            async with sem:
                results.append(await _one(client, url, _body(item, model, endpoint, eos_mode), headers))

        t0 = time.perf_counter()
        if request_rate:
            rng = random.Random(seed)
            tasks = []
            for item in items:
                tasks.append(asyncio.ensure_future(worker(item)))
                await asyncio.sleep(rng.expovariate(request_rate))
            await asyncio.gather(*tasks)
        else:
            await asyncio.gather(*(worker(it) for it in items))
        wall = time.perf_counter() - t0
    return summarize(results, wall, concurrency, request_rate, items)


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[Result], wall: float, concurrency: int, rate: float | None, items: list[Item]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [g for r in ok for g in r.itl]
    summary = {
        "concurrency": concurrency, "request_rate": rate, "num_requests": len(results), "completed": len(ok),
        "errors": len(results) - len(ok), "error_samples": [r.error for r in results if not r.ok][:3],
        "short_outputs": sum(1 for r in ok if r.output_tokens < r.max_tokens),
        "wall_s": wall, "requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / wall,
        "ttft_values": [r.ttft for r in ok],
    }
    for name, vals in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("itl", itl), ("e2e", [r.e2e for r in ok])):
        summary[f"{name}_mean_s"] = statistics.fmean(vals) if vals else None
        for p in (50, 90, 99):
            summary[f"{name}_p{p}_s"] = _pct(vals, p)
    return summary


def plot(summaries: list[dict], path: str) -> None:
    """Throughput vs concurrency and the TTFT CDF of every run, side by side, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [s["concurrency"] for s in summaries]
    a.plot(xs, [s["output_tokens_per_s"] for s in summaries], marker="o")
    a.set_xlabel("concurrent streams")
    a.set_ylabel("output tokens/s")
    a.set_title("throughput")
    for s in summaries:
        v = sorted(s["ttft_values"])
        b.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=f"c={s['concurrency']}")
    b.set_xlabel("TTFT (s)")
    b.set_ylabel("fraction of requests")
    b.set_title("TTFT CDF")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)

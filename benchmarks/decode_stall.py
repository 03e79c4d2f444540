#!/usr/bin/env python3
"""Decode stalls: 8 streams decode; after --delay seconds one long prompt (~2,000 tokens)
arrives. Reports the inter-token latency of the 8 running streams — over the whole run, before the
prompt arrives, and over the window while the long prompt is being prefilled (from its arrival to its answer), which is
where a server without chunked prefill stalls every stream at once. Prints one JSON line."""
import argparse
import asyncio
import json
import time

import httpx

ap = argparse.ArgumentParser()
ap.add_argument("--base-url", required=True)
ap.add_argument("--model-name", default="smollm2")
ap.add_argument("--long-prompt-file", required=True)
ap.add_argument("--long-words", type=int, default=1500, help="words of the file to send (~2,000 tokens)")
ap.add_argument("--streams", type=int, default=8)
ap.add_argument("--max-tokens", type=int, default=160)
ap.add_argument("--delay", type=float, default=3.0)
ap.add_argument("--label", default="")
a = ap.parse_args()


async def stream(client, i, gaps):
    body = {"model": a.model_name, "prompt": f"Story {i}: once upon a time", "max_tokens": a.max_tokens,
            "stream": True, "ignore_eos": True, "temperature": 0}
    last = None
    async with client.stream("POST", a.base_url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                now = time.perf_counter()
                if last is not None:
                    gaps.append((last, now))
                last = now


async def main():
    long_text = " ".join(open(a.long_prompt_file, encoding="utf-8").read().split()[: a.long_words])
    gaps: list[tuple[float, float]] = []
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.ensure_future(stream(client, i, gaps)) for i in range(a.streams)]
        await asyncio.sleep(a.delay)
        t0 = time.perf_counter()
        r = await client.post(a.base_url + "/v1/completions",
                              json={"model": a.model_name, "prompt": long_text, "max_tokens": 1, "temperature": 0})
        t1 = time.perf_counter()
        usage = r.json().get("usage", {})
        await asyncio.gather(*tasks)
    every = sorted(b - s for s, b in gaps)
    window = sorted(b - s for s, b in gaps if b > t0 and s < t1)  # gaps overlapping the prefill
    before = sorted(b - s for s, b in gaps if b <= t0)  # the same streams before the prompt arrived

    def pct(v, p):
        return v[min(len(v) - 1, int(p / 100 * len(v)))] if v else None

    print(json.dumps({"label": a.label, "itl_p50_s": pct(every, 50), "itl_p99_s": pct(every, 99),
                      "itl_max_s": every[-1], "window_itl_p50_s": pct(window, 50), "window_itl_p99_s": pct(window, 99),
                      "window_gaps": len(window),
                      "before_itl_p50_s": pct(before, 50), "before_itl_p99_s": pct(before, 99), "long_prompt_tokens": usage.get("prompt_tokens"),
                      "long_prompt_latency_s": t1 - t0, "num_gaps": len(every)}))


asyncio.run(main())

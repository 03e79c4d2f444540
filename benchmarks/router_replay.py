#!/usr/bin/env python3
"""Replays a multi-turn or shared-prefix chat workload against an OpenAI-compatible server (the
router) and reports TTFT, throughput and the replicas' prefix-cache hit rate (from the router's
/metrics/replicas, where the replicas' counters carry a `replica` label).

  mtbench: MT-Bench conversations, turn 2 sent with turn 1's question and answer, C at a time;
  system:  N chat requests, each one of P long system prompts (cut from WikiText-2) + an MT-Bench
           question, in a seeded random order, C at a time (P tenants sharing a deployment).
Streaming and greedy, so every policy does the same work. mtbench: answers end at EOS or
--max-tokens (turn 2 then carries turn 1's answer as the model wrote it, as a chat client does).
system: ignore_eos, each answer's length drawn (seeded, per request) between --min-tokens and
--max-tokens. Never equal lengths: they synchronise a closed loop (a replica's clients all come
back at once and each wave's prefills queue behind each other, which measures the waves).
"""
import argparse
import asyncio
import json
import random
import re
import statistics
import time

import httpx


def counters(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in re.finditer(r"^(tokenmill:[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", text, re.M):
        name, labels = m.group(1), m.group(2) or ""
        key = name + ("{" + ",".join(p for p in labels.strip("{}").split(",") if p.startswith("reason=")) + "}"
                      if "reason=" in labels else "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def length(a, *key) -> int:  # a request's answer length, the same in every run
    return random.Random(hash((a.seed,) + key) & 0xFFFFFFFF).randint(a.min_tokens, a.max_tokens)


async def chat(c: httpx.AsyncClient, url: str, model: str, messages: list, max_tokens: int,
               ignore_eos: bool = True) -> dict:
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                return {"error": d["error"]["message"]}
            usage = d.get("usage") or usage
            for ch in d.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "text": "".join(text),
            "tokens": (usage or {}).get("completion_tokens", 0), "replica": r.headers.get("x-tokenmill-replica")}


async def run(a) -> dict:
    questions = [json.loads(line)["turns"] for line in open(a.mt_bench, encoding="utf-8")]
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}) as c:
        async def scrape():
            return counters((await c.get(a.url + "/metrics")).text + (await c.get(a.url + "/metrics/replicas")).text)
        before = await scrape()
        sem = asyncio.Semaphore(a.concurrency)
        t0 = time.perf_counter()
        if a.mode == "mtbench":
            async def conversation(i, turns):
                async with sem:
                    msgs = [{"role": "user", "content": turns[0]}]
                    r1 = await chat(c, a.url, a.model, msgs, a.max_tokens, ignore_eos=False)
                    results.append({**r1, "turn": 1})
                    if "error" in r1:
                        return
                    msgs += [{"role": "assistant", "content": r1["text"]}, {"role": "user", "content": turns[1]}]
                    results.append({**await chat(c, a.url, a.model, msgs, a.max_tokens, ignore_eos=False), "turn": 2})
            await asyncio.gather(*(conversation(i, t) for i, t in enumerate(questions[: a.num])))
        else:
            wiki = open(a.wikitext, encoding="utf-8").read()
            step = len(wiki) // (a.prompts + 1)
            systems = [f"You are assistant #{i} of a team. Use these notes when relevant.\n"
                       + wiki[i * step: i * step + a.prefix_chars] for i in range(a.prompts)]
            rng = random.Random(a.seed)
            order = [(rng.randrange(a.prompts), questions[i % len(questions)][0]) for i in range(a.num)]

            async def one(i, p, q):
                async with sem:
                    msgs = [{"role": "system", "content": systems[p]}, {"role": "user", "content": q}]
                    results.append({**await chat(c, a.url, a.model, msgs, length(a, i)), "turn": 1})
            await asyncio.gather(*(one(i, p, q) for i, (p, q) in enumerate(order)))
        elapsed = time.perf_counter() - t0
        after = await scrape()
    ok = [r for r in results if "error" not in r]
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    q, h = d.get("tokenmill:prefix_cache_queries_total", 0.0), d.get("tokenmill:prefix_cache_hits_total", 0.0)
    ttft = [r["ttft"] for r in ok]
    t1 = [r["ttft"] for r in ok if r["turn"] == 1]
    t2 = [r["ttft"] for r in ok if r["turn"] == 2]
    return {"mode": a.mode, "label": a.label, "requests": len(results), "errors": len(results) - len(ok),
            "elapsed_s": round(elapsed, 2), "output_tokens_per_s": round(sum(r["tokens"] for r in ok) / elapsed, 1),
            "ttft_p50_s": round(statistics.median(ttft), 4), "ttft_mean_s": round(statistics.mean(ttft), 4),
            "ttft_p90_s": round(statistics.quantiles(ttft, n=10)[-1], 4),
            "turn1_ttft_p50_s": round(statistics.median(t1), 4),
            "turn2_ttft_p50_s": round(statistics.median(t2), 4) if t2 else None,
            "prefix_hit_rate": round(h / q, 4) if q else None, "prefix_queries": q,
            "decisions": {k.split("{")[1].rstrip("}"): v for k, v in d.items()
                          if k.startswith("tokenmill:router_routing_decisions_total") and v},
            "per_replica": {x: sum(1 for r in ok if r["replica"] == x) for x in sorted({r["replica"] for r in ok})},
            "first_error": next((r["error"] for r in results if "error" in r), None)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--mode", choices=["mtbench", "system"], required=True)
    ap.add_argument("--mt-bench", required=True)
    ap.add_argument("--wikitext", help="system mode: where the system prompts are cut from")
    ap.add_argument("--num", type=int, default=40, help="conversations (mtbench) or requests (system)")
    ap.add_argument("--prompts", type=int, default=8, help="system mode: distinct system prompts")
    ap.add_argument("--prefix-chars", type=int, default=4000, help="system mode: characters per system prompt")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None, help="append the JSON row here")
    a = ap.parse_args()
    row = asyncio.run(run(a))
    print(json.dumps(row))
    if a.out:
        with open(a.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

"""Soak: the real default model behind the real server, hundreds to thousands of mixed requests,
clients that vanish at random points, and a KV cache small enough to force preemption; then the
books must balance. `tests/test_soak.py` runs a CI-sized round; `make soak` a long one:

    python tests/soak.py --requests 3000 --concurrency 32 --out soak.json

The server runs in this process (uvicorn on a loopback port, on a thread) so that afterwards the
engine itself can be asked: no request left in the scheduler, the engine or the server's stream
table, every KV block free, the block manager's integrity check passing. Clients speak HTTP to it
like any other (the official `openai` client, and httpx where a client must disconnect mid-way).

Every request that was not deliberately cancelled must finish with a finish_reason (streams: one
per choice, then `[DONE]`); `lost` counts those that did not. RSS is sampled after each fifth of
the requests: the first is the warm figure (kernels, caches, allocator pools), a leak would keep
growing through the rest.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import threading
import time
from dataclasses import asdict, dataclass, field

MODEL = "smollm2"
WORDS = ("the of and to in is was for on that with as by at from his an were are which this be has or had "
         "not but first one their its new after who they have her she two been other when there all during "
         "into school time may years more most only over city some world would where later up such used many "
         "can state about national out known university united then made").split()


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0          # the client left on purpose (mid-stream, or while waiting)
    lost: int = 0               # neither: an error, a missing finish_reason or [DONE]
    streams: int = 0
    n_gt_1: int = 0
    with_stop: int = 0
    long_prompts: int = 0
    generated_tokens: int = 0
    errors: list[str] = field(default_factory=list)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _one(i: int, rng: random.Random, base: str, tally: Tally, max_new: int) -> None:
    import httpx
    import openai

    chat = rng.random() < 0.5
    stream = rng.random() < 0.6
    n = rng.choice([1, 1, 1, 2, 3])
    long = rng.random() < 0.15
    prompt = _text(rng, rng.randint(250, 330) if long else rng.randint(3, 40))
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, max_new), "n": n, "temperature": rng.choice([0, 0.7, 1.0]),
                  "seed": rng.randint(0, 2**31), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.25:
        body["stop"] = rng.sample(WORDS, rng.randint(1, 4))
        tally.with_stop += 1
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    cancel_after = rng.randint(1, 20) if rng.random() < 0.15 else None  # chunks (streams) before leaving
    tally.requests += 1
    tally.streams += stream
    tally.n_gt_1 += n > 1
    tally.long_prompts += long
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        if cancel_after is not None:
            async with httpx.AsyncClient(base_url=base, timeout=600) as http:
                if stream:
                    async with http.stream("POST", path, json={**body, "stream": True}) as r:
                        got = 0
                        async for line in r.aiter_lines():
                            got += line.startswith("data: ")
                            if got >= cancel_after:
                                break
                else:  # a client that stops waiting (while queued, or generating)
                    try:
                        await http.post(path, json=body, timeout=rng.uniform(0.05, 2.0))
                    except httpx.TimeoutException:
                        pass
            tally.cancelled += 1
            return
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)
        extra = {k: body.pop(k) for k in ("ignore_eos",)}
        create = client.chat.completions.create if chat else client.completions.create
        if stream:
            finish: dict[int, str] = {}
            tokens = 0
            done = False
            async with await create(**body, stream=True, extra_body=extra,
                                    stream_options={"include_usage": True}) as chunks:
                async for chunk in chunks:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                        done = True
                    for c in chunk.choices:
                        if c.finish_reason is not None:
                            finish[c.index] = c.finish_reason
            ok = done and sorted(finish) == list(range(n)) and set(finish.values()) <= {"stop", "length"}
            if not ok:
                raise AssertionError(f"stream ended without every finish_reason / usage: {finish}")
        else:
            r = await create(**body, extra_body=extra)
            reasons = [c.finish_reason for c in r.choices]
            if len(reasons) != n or not set(reasons) <= {"stop", "length"}:
                raise AssertionError(f"finish reasons {reasons}")
            tokens = r.usage.completion_tokens
        await client.close()
        tally.completed += 1
        tally.generated_tokens += tokens
    except Exception as e:  # noqa: BLE001 - every failure is counted and shown
        tally.lost += 1
        tally.errors.append(f"request {i} ({path}, stream={stream}, n={n}): {type(e).__name__}: {e}"[:400])


async def _load(base: str, requests: range, concurrency: int, seed: int, tally: Tally, max_new: int) -> None:
    queue: asyncio.Queue = asyncio.Queue()
    for i in requests:
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            await _one(i, random.Random(seed * 1_000_003 + i), base, tally, max_new)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def _rss_anon() -> int:
    """This process's resident anonymous memory in bytes (RssAnon, Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def run(requests: int = 300, concurrency: int = 24, seed: int = 0, kv_cache_memory: str = "12MiB",
        max_model_len: int = 512, max_new: int = 96) -> dict:
    """`max_new`: requests ask for 1..max_new tokens (what leaks is per request, not per token: a
    short CI soak keeps the request count and shortens the answers)."""
    import psutil
    import uvicorn

    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.api import ServerConfig, build_app
    from tokenmill.server.metrics import Metrics
    from tokenmill.server.transport import bounded_http

    engine = LLMEngine(EngineConfig.from_kwargs(kv_cache_memory=kv_cache_memory, max_model_len=max_model_len,
                                                max_num_seqs=64))
    metrics = Metrics(MODEL)
    preemptions = [0]

    def record(st) -> None:
        preemptions[0] += st.num_preemptions
        metrics.record(st)

    client = AsyncEngine(engine, stat_logger=record)
    app = build_app(client, ServerConfig(served_model_names=[MODEL], api_keys=[]), metrics)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=bounded_http(30.0, 4096)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    tally = Tally()
    proc = psutil.Process()
    t0 = time.monotonic()
    fifths = [requests * k // 5 for k in range(6)]
    # after each fifth of the requests: a leak grows with the count, a warm-up levels off. Anonymous
    # memory is what leaks; the resident total also counts the embedding table's file pages, which
    # a model maps as its tokens are first looked up (the page cache's, bounded by the table)
    rss, anon = [], []
    try:
        for lo, hi in zip(fifths, fifths[1:]):
            asyncio.run(_load(base, range(lo, hi), concurrency, seed, tally, max_new))
            rss.append(round(proc.memory_info().rss / 2**20, 1))
            anon.append(round(_rss_anon() / 2**20, 1))
        wall = time.monotonic() - t0
        deadline = time.monotonic() + 60  # aborts of the last cancelled requests reach the engine thread
        while time.monotonic() < deadline and (engine.has_unfinished_requests() or client._streams):
            time.sleep(0.1)
        bm = engine.block_manager
        leaked_requests = engine.get_num_unfinished_requests() + engine.num_running() + engine.num_waiting()
        integrity = "ok"
        try:
            bm.check_integrity([])
        except AssertionError as e:
            integrity = f"failed: {e}"
        report = {
            **{k: v for k, v in asdict(tally).items() if k != "errors"}, "errors": tally.errors[:20],
            "concurrency": concurrency, "seed": seed, "kv_cache_tokens": engine.kv_capacity_tokens,
            "preemptions": preemptions[0], "leaked_requests": leaked_requests,
            "leaked_streams": len(client._streams), "leaked_blocks": bm.num_blocks - bm.num_free_blocks,
            "block_integrity": integrity, "rss_mib_by_fifth": rss, "anon_mib_by_fifth": anon,
            "rss_warm_mib": rss[0], "rss_end_mib": rss[-1],
            "wall_s": round(wall, 1),
        }
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        client.shutdown()
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", default="12MiB")
    ap.add_argument("--out", default=None, help="write the report (JSON) here too")
    args = ap.parse_args()
    report = run(args.requests, args.concurrency, args.seed, args.kv_cache_memory)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    ok = (report["lost"] == 0 and report["leaked_blocks"] == 0 and report["leaked_requests"] == 0
          and report["block_integrity"] == "ok")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

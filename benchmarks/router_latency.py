#!/usr/bin/env python3
"""What the router adds to one request: N one-token completions sent one at a time, alternating
between the replica directly and the router in front of it (so drift hits both alike); medians of
time to first byte (streaming) and of the whole request (non-streaming), and their differences."""
import argparse
import json
import statistics
import time

import httpx

ap = argparse.ArgumentParser()
ap.add_argument("--direct", required=True)
ap.add_argument("--router", required=True)
ap.add_argument("-n", type=int, default=200)
ap.add_argument("--out", default=None)
a = ap.parse_args()
body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 1, "temperature": 0}
times: dict[str, dict[str, list[float]]] = {k: {"ttfb": [], "total": []} for k in ("direct", "router")}
with httpx.Client(timeout=60) as c:
    for i in range(a.n + 10):
        for name, base in (("direct", a.direct), ("router", a.router))[:: 1 if i % 2 else -1]:
            t0 = time.perf_counter()
            with c.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as r:
                chunks = r.iter_raw()
                next(chunks)
                ttfb = time.perf_counter() - t0
                for _ in chunks:
                    pass
            t1 = time.perf_counter()
            assert c.post(base + "/v1/completions", json=body).status_code == 200
            total = time.perf_counter() - t1
            if i >= 10:  # warm-up
                times[name]["ttfb"].append(ttfb)
                times[name]["total"].append(total)
med = {k: {m: statistics.median(v) * 1000 for m, v in d.items()} for k, d in times.items()}
row = {"n": a.n, "direct_ttfb_ms": round(med["direct"]["ttfb"], 3), "router_ttfb_ms": round(med["router"]["ttfb"], 3),
       "added_ttfb_ms": round(med["router"]["ttfb"] - med["direct"]["ttfb"], 3),
       "direct_total_ms": round(med["direct"]["total"], 3), "router_total_ms": round(med["router"]["total"], 3),
       "added_total_ms": round(med["router"]["total"] - med["direct"]["total"], 3)}
print(json.dumps(row))
if a.out:
    with open(a.out, "a", encoding="utf-8") as f:
        f.write(json.dumps({"peer": "one-token requests, alternated", **row}) + "\n")

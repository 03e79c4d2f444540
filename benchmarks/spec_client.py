"""Single-stream decode speed of any OpenAI-compatible server on a file of chat prompts (one JSON
list of messages per line), for benchmarks/spec.sh. Greedy, one request at a time, streamed; a
request's decode speed is (completion tokens - 1) / (last chunk - first chunk), and the run's is
the sum of those tokens over the sum of those times. Appends one JSON line to --out.

    python benchmarks/spec_client.py --base-url http://127.0.0.1:8020 --prompts code.jsonl \\
        --label tokenmill-ngram --set code --out results/spec.jsonl
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time

from openai import OpenAI


def run_one(client: OpenAI, model: str, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    text, usage, extra = [], None, {}
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or now
            last = now
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
        extra.update({k: v for k, v in (chunk.model_extra or {}).items() if k == "timings"})
    n = usage.completion_tokens if usage is not None else None
    out = {"tokens": n, "ttft": (first or t0) - t0, "decode_s": (last - first) if first else 0.0,
           "sha": hashlib.sha1("".join(text).encode()).hexdigest()[:12]}
    t = extra.get("timings") or {}
    if "accepted_draft_tokens" in t:  # tokenmill's per-request timings
        out["draft_tokens"], out["accepted"] = t["draft_tokens"], t["accepted_draft_tokens"]
    if "draft_n" in t:  # llama-server's
        out["draft_tokens"], out["accepted"] = t["draft_n"], t.get("draft_n_accepted", 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model-name", default="default")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--label", required=True)
    ap.add_argument("--set", required=True, help="name of the prompt set, for the results")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url + "/v1", api_key="none", timeout=600)
    convs = [json.loads(line) for line in open(args.prompts, encoding="utf-8")]
    run_one(client, args.model_name, convs[0], 8)  # warm-up
    reqs = [run_one(client, args.model_name, c, args.max_tokens) for c in convs]
    toks = sum(max(r["tokens"] - 1, 0) for r in reqs)
    secs = sum(r["decode_s"] for r in reqs)
    summary = {"label": args.label, "set": args.set, "requests": len(reqs),
               "output_tokens": sum(r["tokens"] for r in reqs),
               "decode_tokens_per_s": toks / secs if secs else 0.0, "per_request": reqs}
    drafted = sum(r.get("draft_tokens", 0) for r in reqs)
    if drafted:
        summary["acceptance_rate"] = sum(r.get("accepted", 0) for r in reqs) / drafted
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(summary) + "\n")
    print(f"{args.label:28s} {args.set:8s} {summary['decode_tokens_per_s']:7.1f} tok/s  "
          f"{summary['output_tokens']} tokens" + (f"  acceptance {summary['acceptance_rate']:.2f}" if drafted else ""))


if __name__ == "__main__":
    main()

"""Decode speed alone and beside a CPU hog: a busy loop pinned to the last core the engine may use,
as a second process on a shared machine is. Prints one JSON line per (threads, condition).

    python benchmarks/contention.py [--model M] [--tokens 256] [--reps 3] [--threads 0 1]

threads 0 = the engine's default (all usable cores, fewer while contended).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HOG = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"


def measure(model: str | None, threads: int, tokens: int, reps: int) -> list[dict]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=model, threads=threads or None)
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(["Hello"], SamplingParams(max_tokens=8))
    rows = []
    core = max(os.sched_getaffinity(0))
    for cond in ("alone", "hog", "alone-after"):
        hog = subprocess.Popen([sys.executable, "-c", HOG, str(core)]) if cond == "hog" else None
        try:
            time.sleep(0.5)
            rates = []
            for _ in range(reps):
                t = time.perf_counter()
                llm.generate(["Tell me a long story about a lighthouse keeper."], sp)
                rates.append(tokens / (time.perf_counter() - t))
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
        rows.append({"threads": threads or "default", "condition": cond, "tok_s": [round(r, 1) for r in rates]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:  # one engine per process: the thread pool is process-wide
        for row in measure(args.model, args.child, args.tokens, args.reps):
            print(json.dumps(row), flush=True)
        return
    for threads in args.threads:
        cmd = [sys.executable, __file__, "--child", str(threads), "--tokens", str(args.tokens), "--reps", str(args.reps)]
        subprocess.run(cmd + (["--model", args.model] if args.model else []), check=True)


if __name__ == "__main__":
    main()

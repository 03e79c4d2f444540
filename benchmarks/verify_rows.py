"""What scoring 1 + k positions per request costs against one: the decode step of B requests, each
with k drafts (the runner scores them as B * (1 + k) decode rows through the native decode stack),
at a ~300-token context. The marginal cost of a draft row, relative to a one-row step, is the prior
`tokenmill.core.speculation.ROW_COST` (the draft policy then fits it on the steps it runs); the cost
at larger B is what `disable_by_batch_size` guards against.

    python benchmarks/verify_rows.py [--model M] [--batches 1,4,8,16] [--drafts 0,1,2,4,8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.block_manager import BlockManager
from tokenmill.core.request import Request
from tokenmill.core.sched_output import NewRequest, ScheduledRequest, SchedulerOutput
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--drafts", default="0,1,2,4,8")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig.from_kwargs(model=args.model, kv_cache_memory="512MiB"))
    runner, bs = engine.runner, engine.block_size
    bm = BlockManager(engine.block_manager.num_blocks, bs, enable_prefix_caching=False)
    batches = [int(b) for b in args.batches.split(",")]
    drafts = [int(k) for k in args.drafts.split(",")]
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(max(batches)):  # prefill each request's context once
        ids = torch.randint(0, engine.arch.vocab_size, (args.context,), generator=g).tolist()
        r = Request(f"r{i}", ids, SamplingParams(temperature=0), set())
        assert bm.allocate(r, args.context + max(drafts) + 1)
        runner.forward(SchedulerOutput([ScheduledRequest(r.req_id, ids, 0, 0, list(r.block_table), False)],
                                       [NewRequest(r.req_id, ids, len(ids), r.params, [])]))
        reqs.append(r)
    rows = []
    for b in batches:
        for k in drafts:
            entries = [ScheduledRequest(r.req_id, [1] * (1 + k), args.context, len(r.block_table), [], True, k)
                       for r in reqs[:b]]
            sched = SchedulerOutput(entries)
            times = []
            for _ in range(args.repeats + 3):
                t0 = time.perf_counter()
                runner.forward(sched)
                times.append(time.perf_counter() - t0)
            rows.append({"batch": b, "drafts": k, "rows": b * (1 + k), "ms": statistics.median(times[3:]) * 1e3})
    one = {r["batch"]: r["ms"] for r in rows if r["drafts"] == 0}
    print(f"{'batch':>5} {'drafts':>6} {'rows':>5} {'ms/step':>8} {'x plain':>8} {'per draft row':>14}")
    for r in rows:
        r["vs_plain"] = r["ms"] / one[r["batch"]]
        r["row_cost"] = (r["vs_plain"] - 1) / r["drafts"] if r["drafts"] else 0.0
        print(f"{r['batch']:>5} {r['drafts']:>6} {r['rows']:>5} {r['ms']:>8.2f} {r['vs_plain']:>8.2f} "
              f"{r['row_cost']:>14.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

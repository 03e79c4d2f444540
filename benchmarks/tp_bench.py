#!/usr/bin/env python3
"""Tensor parallelism on this host. `decode`: one engine configuration in this process (run it once
per configuration, one alive at a time): decode tok/s at 1 and 16 streams (short prompts, ignore_eos,
so decode dominates), the steps' median time, appended to --out. `allreduce`: two ranks pinned to
cores 0 and 1, the median time of one all-reduce of (rows, hidden) float32 through shared memory
and through gloo, as a decode step does 2 per layer (+1 for the embedding); and of float64 through
shared memory, what the row-parallel projections' int kernels hand over (`_f64` keys)."""
import argparse
import json
import os
import statistics
import sys
import time


def decode(a) -> None:
    from tokenmill import LLM, SamplingParams

    llm = LLM(a.model, tensor_parallel_size=a.tp, threads=a.threads, kv_cache_memory="512MiB")
    row = {"label": a.label, "tp": a.tp, "threads_per_rank": a.threads,
           "shm": os.environ.get("TOKENMILL_TP_SHM", "1") != "0"}
    for streams in (1, 16):
        prompts = [f"Story number {i}: once upon a time" for i in range(streams)]
        params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        best = 0.0
        for _ in range(a.reps):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            took = time.perf_counter() - t0
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / took)
        row[f"decode_tok_s_{streams}"] = round(best, 1)
    llm.engine.shutdown()
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(row)


def _allreduce_rank(rank, shapes, port, out):
    import torch
    import torch.distributed as dist

    from tokenmill.distributed.tensor_parallel import shared_memory_all_reduce

    os.sched_setaffinity(0, [rank])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    shm = shared_memory_all_reduce(dist.group.WORLD, rank, 2)
    res = {}
    for rows, hidden in shapes:
        t, t64 = torch.randn(rows, hidden), torch.randn(rows, hidden, dtype=torch.float64)
        for name, fn in (("shm", lambda: shm.all_reduce_(t)), ("gloo", lambda: dist.all_reduce(t)),
                         ("shm_f64", lambda: shm.all_reduce_(t64))):
            n = 200 if name == "gloo" else 2000
            for _ in range(20):
                fn()
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            res[f"{name}_{rows}x{hidden}_us"] = round(statistics.median(times) * 1e6, 1)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def allreduce(a) -> None:
    import multiprocessing as mp

    from tokenmill.utils import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    shapes = [(1, a.hidden), (16, a.hidden), (256, a.hidden)]
    procs = [ctx.Process(target=_allreduce_rank, args=(r, shapes, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = out.get(timeout=600)
    for p in procs:
        p.join()
    row = {"label": "allreduce", "layers": a.layers, **res}
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(row)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("decode", "allreduce"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--label", default="")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sys.exit(decode(a) if a.what == "decode" else allreduce(a))

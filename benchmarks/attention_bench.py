#!/usr/bin/env python3
"""Microbenchmark of attention over the paged KV cache for one layer: a prompt chunk of NEW tokens
after START cached ones (a prefix-cache hit, or a later chunk of a chunked prefill), as
gather + SDPA with a mask (the reference path) and as tokenmill's paged context kernel; and decode
rows (BATCH sequences of START tokens) through the paged decode kernel. SmolLM2's heads by default.

    python benchmarks/attention_bench.py                          # 48 new tokens after 1,008 cached
    python benchmarks/attention_bench.py --start 768 --new 256    # a chunked-prefill chunk
    python benchmarks/attention_bench.py --start 1000 --batch 1 --layers 30   # decode over 30 layers'
                                              # caches: DRAM-resident, as in a model's decode step
    python benchmarks/attention_bench.py --start 3840 --new 256 --heads 24 --kv-heads 8 --head-dim 128
                                              # the last chunk of a 4k prompt on a Llama-3.2-3B shape
    python benchmarks/attention_bench.py --start 2000 --batch 16 --layers 30 --kv-dtype int8
                                              # the 8-bit caches (int8, fp8_e5m2) against float16
On the amx variant the prompt chunk also runs on AMX tiles (amx_kernel).
"""
import argparse
import json
import time

import torch

from tokenmill import kernels
from tokenmill.layers.attention import EIGHT_BIT, _attend, read_blocks, store_kv_quantized
from tokenmill.utils import huge_page_zeros

ap = argparse.ArgumentParser()
ap.add_argument("--start", type=int, default=1008, help="cached tokens before the chunk")
ap.add_argument("--new", type=int, default=48, help="tokens in the chunk")
ap.add_argument("--batch", type=int, default=16, help="decode rows for the decode kernel")
ap.add_argument("--heads", type=int, default=9)
ap.add_argument("--kv-heads", type=int, default=3)
ap.add_argument("--head-dim", type=int, default=64)
ap.add_argument("--block-size", type=int, default=16)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--small-pages", action="store_true", help="caches in plain 4 KiB pages (torch.randn) instead")
ap.add_argument("--kv-dtype", default="float16", choices=["float32", "float16", "int8", "fp8_e5m2"],
                help="the cache's dtype, as --kv-cache-dtype")
ap.add_argument("--layers", type=int, default=1,
                help="decode over this many layers' caches (scattered blocks of their own), one step's worth")
a = ap.parse_args()
torch.set_num_threads(a.threads)
if not kernels.available():
    raise SystemExit("tokenmill's CPU kernels did not build")
bs, d, scale = a.block_size, a.head_dim, a.head_dim ** -0.5
width = -(-(a.start + a.new) // bs)
num_blocks = max(width, a.batch * -(-a.start // bs)) + 8


kv_dtype = torch.float8_e5m2 if a.kv_dtype == "fp8_e5m2" else getattr(torch, a.kv_dtype)
row_width = d + 4 if kv_dtype == torch.int8 else d


def cache() -> torch.Tensor:
    """A KV cache as the engine allocates it (huge pages where THP allows), filled at random (8-bit
    caches: rows quantized as the engine writes them)."""
    shape = (num_blocks, bs, a.kv_heads, row_width)
    c = torch.zeros(shape, dtype=kv_dtype) if a.small_pages else huge_page_zeros(shape, kv_dtype)
    x = torch.randn(num_blocks * bs, a.kv_heads, d)
    if kv_dtype in EIGHT_BIT:
        store_kv_quantized(x, x, c, c, torch.arange(num_blocks * bs), use_kernel=False)
        return c
    return c.copy_(x.view(shape))


kc, vc = cache(), cache()
table = torch.randperm(num_blocks)[:width]
q = torch.randn(a.new, a.heads, d)
mask = torch.arange(width * bs)[None, :] <= torch.arange(a.start, a.start + a.new)[:, None]


def gather_sdpa():
    k, v = read_blocks(kc, table[None], d, torch.float32), read_blocks(vc, table[None], d, torch.float32)
    return _attend(q[None], k, v, scale, mask[None, None])[0]


def context_kernel():  # the FMA kernel (context_attention.cpp), whatever the variant
    return torch.ops.tokenmill.paged_context_attention(q, kc, vc, table, a.start, scale, 0)


def amx_kernel():  # both products on AMX tiles (amx_attention.cpp; the amx variant only)
    return torch.ops.tokenmill.amx_context_attention(q, kc, vc, table, a.start, scale, 0)


dw = -(-a.start // bs)
tables = torch.randperm(num_blocks)[:a.batch * dw].view(a.batch, dw)
lens = torch.full((a.batch,), a.start)
qd = torch.randn(a.batch, a.heads, d)


layer_caches = [(kc, vc)] + [(cache(), cache()) for _ in range(a.layers - 1)]


def decode_kernel():
    for k, v in layer_caches:
        out = kernels.paged_decode_attention(qd, k, v, tables, lens, scale)
    return out


def timed(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


assert (gather_sdpa() - context_kernel()).abs().max() < 1e-4
chunk_flop = 4 * a.new * a.heads * d * (a.start + (a.new + 1) / 2)
decode_flop = 4 * a.batch * a.heads * d * a.start * a.layers
row = {"start": a.start, "new": a.new, "batch": a.batch, "layers": a.layers, "kv_dtype": a.kv_dtype}
runs = [("gather_sdpa", gather_sdpa, chunk_flop), ("context_kernel", context_kernel, chunk_flop)]
if a.start:  # decode rows over START cached tokens
    runs.append(("decode_kernel", decode_kernel, decode_flop))
if kernels.isa() == "amx" and kernels.amx() and kv_dtype in (torch.float32, torch.float16):  # tiles (amx_attention.cpp)
    assert (gather_sdpa() - amx_kernel()).abs().max() < 5e-2  # Q, K, V, P rounded to bfloat16
    runs.insert(2, ("amx_kernel", amx_kernel, chunk_flop))
for name, fn, flop in runs:
    t = timed(fn)
    row[f"{name}_us"] = round(t * 1e6, 1)
    row[f"{name}_gflops"] = round(flop / t / 1e9, 1)
if a.start:
    kv_bytes = 2 * a.batch * a.start * a.kv_heads * row_width * kc.element_size() * a.layers  # K and V rows read
    row["decode_kernel_kv_GBps"] = round(kv_bytes / (row["decode_kernel_us"] * 1e-6) / 1e9, 1)
print(json.dumps(row))

#!/usr/bin/env python3
"""Microbenchmark of the matmul kernels tokenmill can use on CPU, for one layer shape, across
batch rows: PyTorch's int4 (`_weight_int4pack_mm_for_cpu`, bf16 and fp32 activations), int8
(`_weight_int8pack_mm`) and float32 GEMM. Explains the choices in quant/ and layers/linear.py.

    python benchmarks/kernels.py                      # a 1536x576 MLP matrix of SmolLM2
    python benchmarks/kernels.py --n 49152 --k 576    # its output head
"""
import argparse
import json
import time

import torch

from tokenmill.quant import int4, int8

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=1536)
ap.add_argument("--k", type=int, default=576)
ap.add_argument("--rows", default="1,4,16,32,64,256")
ap.add_argument("--threads", type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads)
w = torch.randn(a.n, a.k)
w4 = int4.pack(*int4.quantize_rtn(w, 32), 32)
w8 = int8.quantize_rtn(w)


def timed(fn, reps):
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


for m in [int(r) for r in a.rows.split(",")]:
    x = torch.randn(m, a.k)
    xb = x.to(torch.bfloat16)
    reps = max(3, 2000 // (m * max(1, a.n // 1536)))
    row = {"rows": m,
           "int4_bf16_us": timed(lambda: torch._weight_int4pack_mm_for_cpu(xb, w4.packed, 32, w4.scales_zeros), reps),
           "int8_bf16_us": timed(lambda: torch._weight_int8pack_mm(xb, w8.q, w8.scale), reps),
           "fp32_gemm_us": timed(lambda: torch.nn.functional.linear(x, w), reps)}
    if m == 1:
        sz32 = w4.scales_zeros.float()
        try:
            row["int4_fp32_us"] = timed(lambda: torch._weight_int4pack_mm_for_cpu(x, w4.packed, 32, sz32), 20)
        except RuntimeError as e:
            row["int4_fp32_us"] = f"unsupported: {str(e)[:60]}"
        x16 = x.to(torch.float16)
        sz16 = w4.scales_zeros.to(torch.float16)
        try:
            row["int4_fp16_us"] = timed(lambda: torch._weight_int4pack_mm_for_cpu(x16, w4.packed, 32, sz16), 20)
        except RuntimeError as e:
            row["int4_fp16_us"] = f"unsupported: {str(e)[:60]}"
    print(json.dumps({"n": a.n, "k": a.k, **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}}))

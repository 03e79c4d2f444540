#!/usr/bin/env python3
"""Microbenchmark of the matmul kernels tokenmill can use on CPU, for one layer shape, across
batch rows: tokenmill's int4/int8 panel kernels (tokenmill/kernels; on VNNI CPUs with 16-bit and,
as `_a8`, 8-bit activations), PyTorch's int4
(`_weight_int4pack_mm_for_cpu`, bf16 activations), int8 (`_weight_int8pack_mm`) and float32 GEMM.
On the `amx` variant also the AMX tile product (`_amx`, bfloat16 activations; the integer columns
then run with AMX off); there and on CPUs with AVX512-BF16 PyTorch's bfloat16 GEMM (oneDNN): where their crossover with
the integer kernels lies is kernels.AMX_MIN_ROWS. Explains the choices in quant/ and layers/linear.py. (Not named kernels.py: transformers imports
any importable module of that name.)

    python benchmarks/kernel_bench.py                      # a 1536x576 MLP matrix of SmolLM2
    python benchmarks/kernel_bench.py --n 49152 --k 576    # its output head
    python benchmarks/kernel_bench.py --n 8192 --k 2048 --rows 16,32,64,128,256,512   # a 1B MLP, AMX
    python benchmarks/kernel_bench.py --n 576 --k 1536 --segment 256   # down_proj summed as under TP
                                                                       # (`_seg` columns)
"""
import argparse
import json
import time

import torch

from tokenmill import kernels
from tokenmill.kernels import build
from tokenmill.quant import int4, int8

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=1536)
ap.add_argument("--k", type=int, default=576)
ap.add_argument("--rows", default="1,4,16,32,64,256")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--segment", type=int, default=0,
                help="also time the dot kernels summing this many inputs per float32 run (layers/linear.py)")
a = ap.parse_args()
torch.set_num_threads(a.threads)
w = torch.randn(a.n, a.k)
parts4 = int4.quantize_rtn(w, 32)
q8, s8 = int8.rtn_parts(w)
tm4 = kernels.pack_int4(*parts4) if kernels.available() else None
tm8 = kernels.pack_int8(q8, s8) if kernels.available() else None
# PyTorch's layouts
sz = torch.stack([parts4[1].t(), (parts4[2] + 8 * parts4[1]).t()], dim=-1).to(torch.bfloat16).contiguous()
packed4 = torch._convert_weight_to_int4pack_for_cpu(parts4[0].to(torch.int32), 1)
scale8 = s8.to(torch.bfloat16)
amx = kernels.amx()
# AVX512-BF16 without AMX (AMD Zen 4/5): oneDNN's bfloat16 GEMM runs on VDPBF16PS, with the weights
# already bfloat16 — the ceiling of any bf16 path for quantized weights, which must unpack them first
BF16 = "avx512_bf16" in build.cpu_flags()
wb = w.to(torch.bfloat16)
kernels.AMX["min_rows"] = 0  # the integer kernels' own columns


def tiles(x, w):
    kind, tensors = w.stack_args()
    return torch.ops.tokenmill.amx_linear(x, int(kind), *tensors, w.out_features)


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
    row = {"rows": m}
    if tm4 is not None:
        for bits in (16, 8) if tm4.dot else (16,):  # activation bits: only the dot layout has a choice
            tm4.act_bits = tm8.act_bits = bits
            tag = "" if bits == 16 else "_a8"
            row[f"tokenmill_int4{tag}_us"] = timed(lambda: kernels.int4_linear(x, tm4), reps)
            row[f"tokenmill_int8{tag}_us"] = timed(lambda: kernels.int8_linear(x, tm8), reps)
            if a.segment and tm4.dot:
                tm4.segment = tm8.segment = a.segment
                row[f"tokenmill_int4{tag}_seg_us"] = timed(lambda: kernels.int4_linear(x, tm4), reps)
                row[f"tokenmill_int8{tag}_seg_us"] = timed(lambda: kernels.int8_linear(x, tm8), reps)
                tm4.segment = tm8.segment = 0
        row["tokenmill_layout"] = "dot" if tm4.dot else "float"
        if amx:
            row["tokenmill_int4_amx_us"] = timed(lambda: tiles(x, tm4), reps)
            row["tokenmill_int8_amx_us"] = timed(lambda: tiles(x, tm8), reps)
    if amx or BF16:
        row["bf16_gemm_us"] = timed(lambda: torch.nn.functional.linear(xb, wb), reps)
    row.update({"torch_int4_bf16_us": timed(lambda: torch._weight_int4pack_mm_for_cpu(xb, packed4, 32, sz), reps),
                "torch_int8_bf16_us": timed(lambda: torch._weight_int8pack_mm(xb, q8, scale8), reps),
                "fp32_gemm_us": timed(lambda: torch.nn.functional.linear(x, w), reps)})
    print(json.dumps({"n": a.n, "k": a.k, **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}}))

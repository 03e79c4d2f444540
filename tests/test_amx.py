"""Prompt chunks on AMX tiles (kernels/amx.cpp): every format with a tile decoder gives the product
of x and the file's weights both rounded to bfloat16 (float32 sums), and the integer kernels' product
within that rounding; the many-row products of the layers take that path from AMX_MIN_ROWS rows.
Runs where the CPU has AMX (the `amx` variant loads); elsewhere it skips, saying why."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tokenmill import kernels
from tokenmill.kernels import build
from tokenmill.quant import int4, int8, kquant
from test_kquant import random_blocks, reference

HAS_AMX = "amx" in build.executable()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX (amx_tile, amx_bf16)")


@pytest.fixture(scope="module")
def amx():
    if not kernels.amx():
        pytest.skip(f"the loaded kernels are {kernels.isa()!r}, not amx with tile state granted")


def _bf16_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double() @ w.bfloat16().double().t()


def _tile_product(w, x: torch.Tensor) -> torch.Tensor:
    kind, tensors = w.panels.stack_args()
    return torch.ops.tokenmill.amx_linear(x, int(kind), *tensors, w.out_features)


@needs_amx
@pytest.mark.parametrize("kind", kquant.KINDS)
@pytest.mark.parametrize("n,k,m", [(48, 512, 33), (40, 256, 7), (80, 768, 64)])  # 40, 80: a partial / odd panel
def test_tiles_multiply_the_file_weights_in_bfloat16(amx, kind, n, k, m, integer_kernels):
    rng = np.random.default_rng(n + k + m)
    raw = random_blocks(rng, n, k, kind)
    w = kquant.from_blocks(kind, n, k, lambda a, b: raw[a:b])
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    wf = reference(kind, raw, k)
    y = _tile_product(w, x)
    assert y.shape == (m, n) and y.dtype == torch.float32 and y.is_contiguous()
    exact = _bf16_reference(x, wf)
    assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < 2e-6  # float32 summation only
    integer = w.matmul(x).double()  # the VNNI kernels, 16-bit activations: float32-level
    assert ((y.double() - integer).abs().max() / integer.abs().max()).item() < 1e-2  # bfloat16's rounding


@needs_amx
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_and_int8_checkpoints_run_on_tiles(amx, group, integer_kernels):
    torch.manual_seed(group)
    w = torch.randn(72, 512)
    x = torch.randn(45, 512)
    q, scale, minimum = int4.quantize_rtn(w, group)
    packed = int4.pack(q, scale, minimum, group)
    wf = int4.dequantize(q, scale.half().float(), minimum.half().float())
    exact = _bf16_reference(x, wf)
    assert ((_tile_product(packed, x).double() - exact).abs().max() / exact.abs().max()).item() < 2e-6
    w8 = int8.quantize_rtn(w)  # per-channel int8 (float32 scales)
    exact8 = _bf16_reference(x, int8.dequantize(w8))
    assert ((_tile_product(w8, x).double() - exact8).abs().max() / exact8.abs().max()).item() < 2e-6


@needs_amx
def test_layers_take_the_tiles_from_the_threshold(amx):
    raw = random_blocks(np.random.default_rng(0), 64, 512, "Q4_K")
    w = kquant.from_blocks("Q4_K", 64, 512, lambda a, b: raw[a:b])
    rows = kernels.AMX_MIN_ROWS
    x = torch.randn(rows, 512)
    assert torch.equal(w.matmul(x), _tile_product(w, x))  # a prompt chunk: the tiles
    few = x[: rows - 1]
    assert not torch.equal(w.matmul(few), _tile_product(w, few))  # decode batches: the integer kernels
    # a row-parallel rank's float64 partial sums stay on the integer kernels (TP=N gives TP=1's bits)
    assert w.matmul(x, partial=True).dtype == torch.float64


def test_amx_variant_is_refused_where_the_cpu_lacks_it():
    without = build.VARIANTS["avx512vnni"][1]
    assert "amx" not in build.executable(without) and build.best(without) == "avx512vnni"
    assert build.best(build.VARIANTS["amx"][1]) == "amx"
    if HAS_AMX:
        return
    env = {**os.environ, build.ISA_ENV: "amx"}
    out = subprocess.run([sys.executable, "-m", "tokenmill.kernels"], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "amx" in out.stderr and "lacks" in out.stderr

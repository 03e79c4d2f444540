"""Prompt chunks as bfloat16 products (kernels/amx.cpp: AMX tiles, or VDPBF16PS on the avx512bf16
variant): every format with a tile decoder gives the product
of x and the file's weights both rounded to bfloat16 (float32 sums), and the integer kernels' product
within that rounding; the many-row products of the layers and of the decode stack take that path from kernels.amx_rows rows.
A prompt chunk's attention (kernels/amx_attention.cpp) gives attention over Q, K, V rounded to
bfloat16 within the rounding of P, and the float32 kernel's within bfloat16's.
The products run where the CPU has AMX or AVX512-BF16 (the `amx` or `avx512bf16` variant loads), the
attention where it has AMX; elsewhere they skip, saying why."""
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
HAS_BF16MM = bool({"amx", "avx512bf16"} & set(build.executable()))
needs_bf16mm = pytest.mark.skipif(not HAS_BF16MM, reason="this CPU has neither AMX nor AVX512-BF16")


@pytest.fixture(scope="module")
def amx():
    if not kernels.amx():
        pytest.skip(f"the loaded kernels are {kernels.isa()!r}, not amx (with tile state granted) or avx512bf16")


def _bf16_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double() @ w.bfloat16().double().t()


def _tile_product(w, x: torch.Tensor) -> torch.Tensor:
    kind, tensors = w.panels.stack_args()
    return torch.ops.tokenmill.amx_linear(x, int(kind), *tensors, w.out_features)


@needs_bf16mm
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


@needs_bf16mm
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


@needs_bf16mm
def test_layers_take_the_tiles_from_the_threshold(amx, monkeypatch):
    raw = random_blocks(np.random.default_rng(0), 64, 512, "Q4_K")
    w = kquant.from_blocks("Q4_K", 64, 512, lambda a, b: raw[a:b])
    least = kernels.AMX_MIN_ROWS if kernels.isa() == "amx" else kernels.BF16_MIN_ROWS
    assert kernels.AMX["min_rows"] == least and kernels.amx_rows(4096, 1024) == least
    rows = kernels.amx_rows(64, 512)  # a small product: from more rows, where a call's fixed costs weigh more
    assert rows == max(least, kernels.AMX_SMALL[1])
    x = torch.randn(rows, 512)
    assert torch.equal(w.matmul(x), _tile_product(w, x))  # a prompt chunk: the tiles
    few = x[: rows - 1]
    assert not torch.equal(w.matmul(few), _tile_product(w, few))  # decode batches: the integer kernels
    # a row-parallel rank's float64 partial sums stay on the integer kernels (TP=N gives TP=1's bits)
    assert w.matmul(x, partial=True).dtype == torch.float64
    w.panels.act_bits = 8
    eight = w.matmul(x)
    assert torch.equal(eight, _tile_product(w, x)) != kernels.AMX["keep_8bit"]
    monkeypatch.setitem(kernels.AMX, "min_rows", 0)
    assert torch.equal(w.matmul(x), eight) == kernels.AMX["keep_8bit"]  # avx512bf16: the 8-bit VNNI kernels, faster


@needs_bf16mm
def test_decode_steps_of_many_sequences_take_the_tiles(amx, tiny_llama, monkeypatch):
    """The native decode stack sends a step's products to the tiles from the rows Linear does, so
    both still give the same bits; with the tiles off the same steps give other bits."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(tiny_llama, quantization="int4", quantization_group_size=32, kv_cache_memory="16MiB",
              enable_prefix_caching=False, skip_tokenizer_init=True)
    model = llm.engine.runner.model
    prompts = [{"prompt_token_ids": [5 + i, 7 + 2 * i, 3]} for i in range(max(kernels.AMX["min_rows"], kernels.AMX_SMALL[1]))]
    sp = SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)

    def run() -> list[list[float]]:
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

    assert model.decode_stack is not None
    tiles = run()
    stack, model.decode_stack = model.decode_stack, None
    assert run() == tiles  # the Python layers: the same rows on the tiles
    monkeypatch.setitem(kernels.AMX, "min_rows", 0)
    assert run() != tiles  # the integer kernels
    stack.set_amx_rows(0, 0, 0, False)
    model.decode_stack = stack
    integer = run()
    model.decode_stack = None
    assert run() == integer


LOG2E = 1.4426950408889634


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("start,n,bs,hq,hkv,d", [
    (0, 37, 16, 9, 3, 64),       # SmolLM2's heads, a fresh prompt: causal only; a partial row block
    (1008, 48, 16, 9, 3, 64),    # a chunk after 1,000 cached tokens
    (100, 200, 16, 24, 8, 128),  # Llama-3.2-3B's heads; several query tiles per head
    (250, 33, 8, 14, 2, 64),     # Qwen2.5-0.5B's grouping (7 per KV head); short blocks
    (7, 64, 32, 16, 1, 32),      # 16 query heads per KV head, 32-wide heads, blocks longer than a step
])
@pytest.mark.parametrize("window", [0, 9, 100])
def test_context_attention_on_tiles(amx, start, n, bs, hq, hkv, d, dtype, window):
    from tokenmill.layers.attention import _attend, gather_blocks
    g = torch.Generator().manual_seed(start + n + d)
    width = -(-(start + n) // bs)
    kc = torch.randn(width + 6, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(width + 6, bs, hkv, d, generator=g).to(dtype)
    table = torch.randperm(width + 6, generator=g)[:width]
    q = 2 * torch.randn(n, hq, d, generator=g)  # sharper than unit scores: P's rounding shows
    scale = d ** -0.5
    q_pos = torch.arange(start, start + n)[:, None]
    mask = torch.arange(width * bs)[None, :] <= q_pos
    if window:
        mask &= torch.arange(width * bs)[None, :] > q_pos - window
    k, v = gather_blocks(kc, table[None]).float(), gather_blocks(vc, table[None]).float()
    exact = _attend(q[None].double(), k.double(), v.double(), scale, mask[None, None])[0]
    # the tiles' operands: Q scaled into log2 units, K and V, each rounded to bfloat16
    qb = (q.double() * scale * LOG2E).bfloat16().double() / LOG2E
    rounded = _attend(qb[None], k.bfloat16().double(), v.bfloat16().double(), 1.0, mask[None, None])[0]
    if window:  # blocks wholly before the first query's window are never read
        table = table.clone()
        table[:max(0, start - window + 1) // bs] = -1
    got = torch.ops.tokenmill.amx_context_attention(q, kc, vc, table, start, scale, window)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert (got.double() - rounded).abs().max() < 1.5e-2  # P in bfloat16 (8-bit mantissa)
    assert (got.double() - exact).abs().max() < 6e-2
    assert (got.double() - exact).abs().mean() < 4e-3
    with pytest.raises(RuntimeError, match="does not cover"):
        torch.ops.tokenmill.amx_context_attention(q, kc, vc, table[:-1], start, scale, window)


@needs_amx
def test_prompt_chunks_attend_on_tiles_from_the_threshold(amx):
    kc, vc = torch.randn(20, 16, 2, 64).half(), torch.randn(20, 16, 2, 64).half()
    table = torch.arange(20)
    rows = kernels.AMX_MIN_ROWS
    q = torch.randn(rows, 8, 64)
    tiles = torch.ops.tokenmill.amx_context_attention(q, kc, vc, table, 100, 0.125, 0)
    assert torch.equal(kernels.paged_context_attention(q, kc, vc, table, 100, 0.125), tiles)
    few = q[: rows - 1]
    fma = torch.ops.tokenmill.paged_context_attention(few, kc, vc, table, 100, 0.125, 0)
    assert torch.equal(kernels.paged_context_attention(few, kc, vc, table, 100, 0.125), fma)
    assert not torch.equal(fma, tiles[: rows - 1])


def test_amx_variant_is_refused_where_the_cpu_lacks_it():
    without = build.VARIANTS["avx512vnni"][1]
    assert "amx" not in build.executable(without) and build.best(without) == "avx512vnni"
    assert build.best(build.VARIANTS["avx512bf16"][1]) == "avx512bf16"  # Zen 4/5
    assert build.best(build.VARIANTS["amx"][1]) == "amx"
    if HAS_AMX:
        return
    env = {**os.environ, build.ISA_ENV: "amx"}
    out = subprocess.run([sys.executable, "-m", "tokenmill.kernels"], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "amx" in out.stderr and "lacks" in out.stderr

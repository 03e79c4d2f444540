"""tokenmill's own CPU kernels: int4/int8 weight-only linear layers that reuse each unpacked
weight across the rows of a batch (linear.cpp; integer dot products on AVX2, AVX-VNNI and
AVX512-VNNI), paged attention (decode, and prompt chunks over a cached context) that reads K/V
blocks in place (attention.cpp), all decoder layers of a decode step in one call (stack.cpp), and
one-pass RMSNorm, rotary embedding, SiLU-and-multiply and row argmax (pointwise.cpp).

Compiled on first use for one instruction-set variant (build.py: avx2, avxvnni, avx512,
avx512vnni, avx512bf16, amx; the best this CPU runs, or TOKENMILL_CPU_ISA), cached on disk under a
key that includes the variant. On amx (Xeons with AMX) prompt chunks multiply on AMX tiles, on
avx512bf16 (AVX512-BF16 without AMX: AMD Zen 4/5) with VDPBF16PS, in bfloat16 (amx.cpp). Where
no variant runs (no compiler, not x86-64, no AVX2) the callers keep PyTorch's kernels and say so once.

This package owns the kernels and their weight layouts (panels.py, re-exported here) only; it
imports nothing from tokenmill.
`TOKENMILL_KERNELS=0` turns them off (the PyTorch reference path), for comparisons.
"""
from __future__ import annotations

import logging
import os
import platform
import threading

import torch

from . import build
from .panels import (AMX, AMX_SMALL, LANES, PACK_ROWS, Int4Panels, Int8Panels, LutPanels, Q4KPanels, Q6KPanels,  # noqa: F401
                     Q23KPanels, StackKind, _panels, amx_rows, fifth_bit_panels, int4_dot_panels, int4_linear,
                     int8_dot_panels, int8_linear, lut_linear, per_panel, q4k_linear, q6k_linear, q23k_linear,
                     symmetric, unpack_int8, _pad_rows)

logger = logging.getLogger(__name__)

ACT_BITS = (8, 16)  # activation integer widths of the dot layout
# Rows from which a product (panels.amx_rows: more for small ones) and a prompt chunk's attention run
# on AMX tiles (amx variant): below it the integer and FMA kernels are faster (benchmarks/kernel_bench.py,
# decode_batch.py and attention_bench.py measure the crossovers)
AMX_MIN_ROWS = 12
# The same bfloat16 products on VDPBF16PS (avx512bf16 variant: AVX512-BF16 without AMX, AMD Zen 4/5):
# from this many rows they beat the 16-bit integer kernels (benchmarks/kernel_bench.py).
BF16_MIN_ROWS = 64
AMX_ENV = "TOKENMILL_AMX"  # "0": prompt chunks stay on the integer kernels (comparisons, TP=N's bits)
_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": result of the one attempt to build/load; "isa", "dot"


def enabled() -> bool:
    return os.environ.get("TOKENMILL_KERNELS", "1") != "0"


def available() -> bool:
    """True once the extension is built and loaded; builds it on the first call. Raises
    build.UnsupportedISA when TOKENMILL_CPU_ISA asks for a variant this CPU cannot run."""
    if not enabled():
        return False
    if "loaded" not in _state:
        with _lock:
            if "loaded" not in _state:
                _state["loaded"] = _load()
    return bool(_state["loaded"])


def _load() -> bool:
    isa = build.requested()  # raises on a forced variant this CPU cannot execute
    if isa is None:
        why = "they need x86-64 with AVX2" if not build.is_x86() else "this CPU has no AVX2"
        logger.warning("tokenmill CPU kernels unavailable (%s; %s); using PyTorch's kernels, which are slower.",
                       why, platform.machine())
        return False
    try:
        path = build.load(isa)
    except Exception as e:  # no compiler, no ninja, unsupported platform: PyTorch's kernels serve
        lines = [ln for ln in str(e).splitlines() if "error" in ln.lower()] or str(e).splitlines()[-1:]
        logger.warning("tokenmill CPU kernels unavailable (%s: %s); using PyTorch's kernels, which are "
                       "slower.", type(e).__name__, " | ".join(lines[:3]))
        return False
    built = torch.ops.tokenmill.isa()
    if built != isa:  # a library of another variant was already loaded into this process
        raise RuntimeError(f"tokenmill kernels: asked for {isa} but {built} is loaded ({path}).")
    _state["isa"], _state["path"] = isa, str(path)
    _state["dot"] = torch.ops.tokenmill.layout() == "dot"
    if isa in ("amx", "avx512bf16") and os.environ.get(AMX_ENV, "1") != "0":
        refused = torch.ops.tokenmill.amx_status()  # asks the OS for tile state, once per process
        if refused:
            logger.warning("tokenmill: %s; prompt chunks run on the AVX512-VNNI kernels instead.", refused)
        else:
            AMX["min_rows"] = AMX_MIN_ROWS if isa == "amx" else BF16_MIN_ROWS
            AMX["keep_8bit"] = isa != "amx"
    logger.info("tokenmill CPU kernels: %s variant (%s layout)", isa, torch.ops.tokenmill.layout())
    return True


def amx() -> bool:
    """True where prompt chunks run as bfloat16 products (amx.cpp): on AMX tiles (the amx variant
    loaded and tile state granted by the OS) or on VDPBF16PS (the avx512bf16 variant)."""
    return available() and AMX["min_rows"] > 0


def isa() -> str | None:
    """The loaded kernel variant (avx2, avxvnni, avx512, avx512vnni, avx512bf16, amx), or None where they are not
    loaded (not used yet, e.g. on a GPU, or unavailable: PyTorch's kernels serve)."""
    return str(_state["isa"]) if _state.get("loaded") else None


def auto_activation_bits() -> int:
    """What `activation_bits="auto"` means: 16 on every variant. 8-bit activations (llama.cpp's Q8
    arithmetic) halve the integer products per weight but cost perplexity on the default model
    (benchmarks/ppl.sh) and flip near-tied greedy answers (it then misnames the capital of France on every
    variant); at real sizes decode streams weights from memory, where the second product per weight
    is nearly free (benchmarks/RESULTS.md). `--activation-bits 8` remains for prompt-heavy loads."""
    return 16


def dot_layout() -> bool:
    """True where the kernels multiply in integers (every variant: VPDPBUSD on AVX512-VNNI and
    AVX-VNNI, VPMADDUBSW/VPMADDWD on AVX2): weights then use the dot layout and activations are
    rounded to 16- or 8-bit integers per 32 inputs inside the product."""
    return available() and bool(_state.get("dot", False))


# --------------------------------------------------------------------------- packing (the loaded variant's layout)
def pack_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, alloc=None) -> Int4Panels:
    """q: (N, K) integers 0..15; scale, minimum: (N, G) per group of K/G inputs."""
    n, k = q.shape
    g = scale.shape[1]
    if k % g or (k // g) % 2:
        raise ValueError(f"int4 panels need an even group size dividing {k}; got {g} groups.")
    if dot_layout() and (k // g) % 32 == 0:
        # float16 scales and minimums: what GGUF, AWQ and GPTQ store; float32 would add a third to
        # the bytes a batch-1 decode streams per weight (4-bit weight + 2 x 32 bits per 32 weights)
        # symmetric weights (GGUF Q4_0: m = -8 s) keep no minimums: the file's own bytes per weight
        m = None if symmetric(scale, minimum, 8) else per_panel(minimum).half()
        return Int4Panels(_panels(n, (k // 8, 4 * LANES), torch.uint8, lambda r0, r1: int4_dot_panels(q[r0:r1]), alloc),
                          per_panel(scale).half(), m, n, dot=True)

    def pairs(r0: int, r1: int) -> torch.Tensor:
        qp = _pad_rows(q[r0:r1].to(torch.uint8))
        return (qp[:, 0::2] | (qp[:, 1::2] << 4)).reshape(-1, LANES, k // 2).transpose(1, 2)  # (P, K/2, 16)
    return Int4Panels(_panels(n, (k // 2, LANES), torch.uint8, pairs, alloc), per_panel(scale), per_panel(minimum), n)


def pack_int8(q: torch.Tensor, scale: torch.Tensor, alloc=None) -> Int8Panels:
    """q: (N, K) int8; scale: (N,)."""
    n, k = q.shape
    if k % 2:
        raise ValueError(f"int8 panels need an even input dimension, got {k}.")
    s = _pad_rows(scale.float().reshape(n, 1)).reshape(-1).contiguous()
    if dot_layout() and k % 32 == 0:
        return Int8Panels(_panels(n, (k // 4, 4 * LANES), torch.uint8, lambda r0, r1: int8_dot_panels(q[r0:r1]), alloc),
                          s, n, dot=True)

    def cols(r0: int, r1: int) -> torch.Tensor:
        return _pad_rows(q[r0:r1].to(torch.int8)).reshape(-1, LANES, k).transpose(1, 2)  # (P, K, 16)
    return Int8Panels(_panels(n, (k, LANES), torch.int8, cols, alloc), s, n)


# --------------------------------------------------------------------------- ops
def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int = 0) -> torch.Tensor:
    """q (B, Hq, D); caches (num_blocks, block_size, Hkv, D); block_tables (B, W) and
    context_lens (B,) int64 -> (B, Hq, D). window > 0: each query sees its `window` latest positions."""
    if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:  # strided rows are fine; strided heads are not
        q = q.contiguous()
    return torch.ops.tokenmill.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, window)


def paged_context_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, start: int, scale: float, window: int = 0) -> torch.Tensor:
    """One sequence's prompt chunk over its cached context: q (T, Hq, D) at positions start..start+T-1,
    whose K/V are already in the cache; block_table (W,) int64 -> (T, Hq, D), causal (and within
    `window` positions when window > 0)."""
    q = q.contiguous()
    if (AMX["min_rows"] and _state["isa"] == "amx" and q.shape[0] >= AMX["min_rows"] and q.shape[2] % 32 == 0  # tiles
            and k_cache.dtype in (torch.float32, torch.float16)):  # 8-bit caches: the FMA kernel widens them
        return torch.ops.tokenmill.amx_context_attention(q, k_cache, v_cache, block_table, start, scale, window)
    return torch.ops.tokenmill.paged_context_attention(q, k_cache, v_cache, block_table, start, scale, window)


def encoder_attention_for(x: torch.Tensor, head_dim: int, longest: int) -> bool:
    """Whether encoder_attention serves these activations: float32 or bfloat16 (widened for the
    kernel: the attention of a bfloat16 encoder then sums in float32) outside autograd, a head size
    of 16s; on the AVX-512 variants any length, on AVX2 inputs of at most 384 tokens (past them
    SDPA's flash schedule, its keys in blocks, overtakes the kernel's whole rows of scores:
    benchmarks/RESULTS.md §6)."""
    return (head_dim % 16 == 0 and head_dim <= 256 and x.dtype in (torch.float32, torch.bfloat16)
            and x.device.type == "cpu" and not torch.is_grad_enabled() and available()
            and (isa() in ("avx512", "avx512vnni", "avx512bf16", "amx") or longest <= 384))


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention within each input of a ragged batch: q, k, v (T, H, D) float32 (or
    bfloat16, widened), input i's tokens at starts[i]..starts[i+1]-1 -> (T, H, D) in q's dtype."""
    dtype = q.dtype
    q, k, v = (t.float().contiguous() for t in (q, k, v))
    return torch.ops.tokenmill.encoder_attention(q, k, v, starts, scale).to(dtype)


def usable_for(x: torch.Tensor) -> bool:
    """The row-wise kernels take float32 CPU tensors outside autograd (training keeps PyTorch's ops)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled() and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of a float32 tensor, in one pass."""
    return torch.ops.tokenmill.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x (T, H, D) -> contiguous (T, H, D); cos/sin (T, D/2)."""
    return torch.ops.tokenmill.rotary(x, cos.reshape(x.shape[0], -1), sin.reshape(x.shape[0], -1))


def head_rms_norm_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every head of x (T, H, D) in place (rows may be strided), one weight (D,)."""
    torch.ops.tokenmill.head_rms_norm_(x, weight, eps)
    return x


def argmax(x: torch.Tensor) -> torch.Tensor:
    """(N, V) float32 -> (N,) int64 index of each row's largest value, the first one on ties and
    the first NaN if any, as torch.argmax (which is slow at a vocabulary's width: a noticeable part of a
    batched decode step)."""
    return torch.ops.tokenmill.argmax_rows(x)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up] float32 -> silu(gate) * up, (T, I), in one pass."""
    return torch.ops.tokenmill.silu_mul(gate_up)


def lora_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
              slots: torch.Tensor, offsets: list[int]) -> None:
    """y (T, N) += each row's LoRA delta: row t under adapter slot slots[t] (-1: none), A (S, K, P R),
    B (S, R, N) with the scale folded in, ranks (S, P), part p's columns [offsets[p], offsets[p+1])
    (lora.cpp)."""
    torch.ops.tokenmill.lora_add_(y, x, a, b, ranks, slots, offsets)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, k_smooth: torch.Tensor | None = None) -> None:
    """Each token's K/V rows, k/v (T, Hkv, D) float32, into its cache slot in the cache's format
    (float32, float16, fp8_e5m2 rounded to nearest even; int8 with a float32 scale per row, K divided
    by k_smooth (Hkv, D) per channel first where given)."""
    torch.ops.tokenmill.store_kv(_heads_contiguous(k), _heads_contiguous(v), k_cache, v_cache, slots, k_smooth)


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


KV_DTYPES = (torch.float32, torch.float16, torch.int8, torch.float8_e5m2)  # caches the kernels read


def supports_attention(q_dtype: torch.dtype, cache: torch.Tensor, num_heads: int) -> bool:
    """What the paged attention kernels handle: float32 queries, float32/float16/int8/fp8_e5m2 CPU caches
    (an int8 cache's rows: head_dim + 4 bytes), head_dim a multiple of 16 up to 256, up to 16 query heads
    per KV head."""
    hkv, d = cache.shape[2], cache.shape[3] - (4 if cache.dtype == torch.int8 else 0)
    return (cache.device.type == "cpu" and cache.dtype in KV_DTYPES and q_dtype == torch.float32
            and d % LANES == 0 and d <= 256 and num_heads % hkv == 0 and num_heads // hkv <= 16
            and cache.is_contiguous() and available())

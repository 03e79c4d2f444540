"""Pre-quantized Hugging Face checkpoints (AWQ GEMM, GPTQ): read `quantization_config`, and turn
each layer's packed tensors into what `Linear.weight_loader` takes — the dequantized float
weight plus the exact integer parts, so the int4/int8 kernels run the stored values unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from tokenmill.quant import int4, packed

_PARTS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales")}


@dataclass(frozen=True)
class PrequantConfig:
    method: str        # awq | gptq
    bits: int
    group_size: int    # -1: one group per row

    @classmethod
    def from_hf(cls, qcfg: dict) -> "PrequantConfig":
        method = str(qcfg.get("quant_method", "")).lower()
        if method not in _PARTS:
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported; "
                             f"tokenmill loads {sorted(_PARTS)} checkpoints.")
        bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
        group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
        if method == "awq":
            version = str(qcfg.get("version", "gemm")).lower()
            if bits != 4 or version != "gemm" or not qcfg.get("zero_point", True):
                raise ValueError(f"AWQ checkpoints load in the 4-bit GEMM layout with zero points; this one has "
                                 f"bits={bits}, version={version!r}, zero_point={qcfg.get('zero_point')}.")
        elif bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoints load with 4 or 8 bits; this one has {bits}.")
        if str(qcfg.get("checkpoint_format", "gptq")).lower() not in ("gptq", "awq", "gemm"):
            raise ValueError(f"checkpoint_format {qcfg.get('checkpoint_format')!r} is not supported "
                             "(tokenmill reads the v1 'gptq' layout).")
        return cls(method, bits, group)


def convert(weights: Iterator[tuple[str, torch.Tensor]], cfg: PrequantConfig) -> Iterator[tuple]:
    """Pass float tensors through; collect each quantized layer's tensors (they may arrive in any
    order, across files) and emit `(prefix.weight, float weight, extras)` once complete."""
    needed = _PARTS[cfg.method] + (("g_idx",) if cfg.method == "gptq" else ())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf not in needed:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if all(p in parts for p in needed):
            yield _layer(prefix, pending.pop(prefix), cfg)
    # GPTQ checkpoints may omit g_idx (no act-order): whatever is still pending is complete then
    for prefix, parts in pending.items():
        if not all(p in parts for p in _PARTS[cfg.method]):
            missing = [p for p in _PARTS[cfg.method] if p not in parts]
            raise ValueError(f"quantized layer {prefix!r} lacks {missing}; the checkpoint is incomplete.")
        yield _layer(prefix, parts, cfg)


def _layer(prefix: str, parts: dict[str, torch.Tensor], cfg: PrequantConfig) -> tuple:
    if cfg.method == "awq":
        q, zeros, scales = packed.unpack_awq(parts)
        g_idx = None
    else:
        q, zeros, scales, g_idx = packed.unpack_gptq(parts, cfg.bits)
    k = q.shape[1]
    groups = scales.shape[1]
    if g_idx is None:
        g_idx = packed.default_g_idx(k, cfg.group_size if groups > 1 else -1)
    if int(g_idx.max()) + 1 != groups:
        raise ValueError(f"{prefix}: {groups} groups of scales do not match group size {cfg.group_size} "
                         f"over {k} input channels.")
    weight = packed.dequantize(q, zeros, scales, g_idx)
    if cfg.bits == 8:
        if groups != 1 or not bool((zeros == 128).all()):
            return prefix + ".weight", weight, {"quantized": True}  # no exact int8 kernel form: float + RTN
        return prefix + ".weight", weight, {"quantized": True,
                                            "int8_parts": ((q.to(torch.int16) - 128).to(torch.int8), scales[:, 0])}
    try:
        perm, _, group_map = packed.kernel_layout(g_idx, int4.GROUP_SIZES)
    except ValueError:
        return prefix + ".weight", weight, {"quantized": True}  # no int4 kernel form: float, int8 at load
    if perm is not None:  # act-order: columns in group order; the layer permutes its input to match
        q = q[:, perm]
    scales, zeros = scales[:, group_map], zeros[:, group_map]
    minimum = -scales * zeros.float()
    return prefix + ".weight", weight, {"quantized": True, "int4_parts": (q.to(torch.uint8), scales, minimum),
                                        "input_perm": perm}

"""`tokenmill quantize`: a float model -> an AWQ or GPTQ checkpoint (or an RTN baseline in the
GPTQ layout) that `LLM(model=dir)` serves with the int4/int8 kernels and other engines read.

Calibrated methods walk the model one decoder layer at a time (`calib.LayerWalk`): record the
layer's linear inputs, quantize its four linear layers (fused QKV, O, fused gate/up, down), put
the dequantized weights back, and feed the next layer what the quantized layer outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tokenmill.compress import calib, qalgo
from tokenmill.compress.calib import LayerWalk, linears
from tokenmill.compress.export import split_rows
from tokenmill.compress.stream import LayerStream
from tokenmill.layers.linear import Linear
from tokenmill.models.llama import CausalLM, DecoderLayer
from tokenmill.quant import int4, packed

METHODS = ("rtn-int8", "rtn-int4", "awq", "gptq")


@dataclass(frozen=True)
class QuantizeConfig:
    method: str
    group_size: int = 128
    calib_samples: int = 128
    calib_seq_len: int = 512
    # GPTQ: columns by decreasing activation energy, groups kept contiguous (qalgo.gptq). None: on for
    # GPTQ — in-domain and out-of-domain perplexity both fell with it (benchmarks/quantize_ood.sh)
    act_order: bool | None = None
    damp: float = 0.01                 # GPTQ: diagonal damping, a fraction of the mean diagonal
    allow_partial_groups: bool = False  # a group size that does not divide K: the last group is shorter
    compute_dtype: str = "auto"        # the calibration's matrix products (calib.compute_dtype)
    shrink: float = 0.25               # GPTQ: H's off-diagonal shrinkage toward its diagonal (qalgo.gptq)
    # AWQ: search each group's clipping range after the scales (qalgo.awq_clip). Off: on Qwen2.5-Coder-0.5B
    # it made the model worse than plain rounding at every group size, though it helps the default
    # model (benchmarks/RESULTS.md §5)
    awq_clip: bool = False

    @property
    def bits(self) -> int:
        return 8 if self.method == "rtn-int8" else 4

    @property
    def uses_act_order(self) -> bool:
        return self.method == "gptq" and self.act_order is not False

    @property
    def calibrated(self) -> bool:
        return self.method in ("awq", "gptq")

    def validate(self, model: CausalLM) -> None:
        """Every reason to refuse, before any work is done."""
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {list(METHODS)}, got {self.method!r}.")
        if self.calibrated and (self.calib_samples < 1 or self.calib_seq_len < 16):
            raise ValueError("need --calib-samples >= 1 and --calib-seq-len >= 16.")
        calib.compute_dtype(self.compute_dtype)
        if not 0 <= self.shrink < 1:
            raise ValueError(f"--hessian-shrink must lie in [0, 1), got {self.shrink}.")
        if not 0 < self.damp < 1:
            raise ValueError(f"--damp must lie in (0, 1), got {self.damp}.")
        if self.awq_clip and self.method != "awq":
            raise ValueError(f"--awq-clip turns on AWQ's clip search; it does not apply to {self.method}.")
        if self.act_order is not None and self.method != "gptq":
            raise ValueError(f"--act-order orders GPTQ's columns; it does not apply to {self.method}.")
        if self.method == "rtn-int8":
            return  # per output channel: no groups
        if self.group_size not in int4.GROUP_SIZES:
            raise ValueError(f"--group-size must be one of {list(int4.GROUP_SIZES)} (what the int4 kernels run), "
                             f"got {self.group_size}.")
        dims = sorted({m.in_features for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head})
        bad = [k for k in dims if k % self.group_size]
        if bad and not self.allow_partial_groups:
            ok = [g for g in int4.GROUP_SIZES if all(k % g == 0 for k in dims)]
            raise ValueError(f"group size {self.group_size} does not divide the input dimension {bad[0]} of this "
                             f"model's linear layers (input dimensions: {dims}); use one of {ok}, or pass "
                             f"--allow-partial-groups to quantize the last {bad[0] % self.group_size} inputs of "
                             "such rows as a shorter group (GPTQ's convention; AutoAWQ-style loaders refuse it).")
        if any(k % 32 for k in dims):
            raise ValueError(f"input dimensions {dims} are not multiples of 32; the int4 kernels cannot run them.")

    def hf_quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        group = -1 if self.method == "rtn-int8" else self.group_size
        return {"quant_method": "gptq", "bits": self.bits, "group_size": group, "sym": self.method == "rtn-int8",
                "desc_act": self.uses_act_order, "damp_percent": self.damp,
                "true_sequential": False, "checkpoint_format": "gptq",
                "quantizer": [f"tokenmill:{self.method}"]}


def quantize_model(model: CausalLM, cfg: QuantizeConfig, samples: list[torch.Tensor] | None,
                   progress: bool = True, stream: LayerStream | None = None,
                   on_layer: Callable[[dict[str, qalgo.QuantizedWeight]], None] | None = None,
                   ) -> dict[str, qalgo.QuantizedWeight]:
    """Quantize every decoder linear layer in place (weights become their dequantized values, AWQ
    scales are folded into the preceding norms / projections) and return the integer forms by
    module name. Embeddings, norms and the output projection stay float, as in AWQ and GPTQ.
    With `stream`, each layer's weights are read just before it is quantized and dropped once it
    has fed the next layer; `on_layer` then takes each linear layer's integers as they are made
    (to pack them at once) instead of the returned dict holding every layer's."""
    cfg.validate(model)
    layers = list(model.model.layers)
    walk = LayerWalk(model, samples, calib.compute_dtype(cfg.compute_dtype)) if cfg.calibrated else None
    results: dict[str, qalgo.QuantizedWeight] = {}

    def emit(name: str, qw: qalgo.QuantizedWeight) -> None:
        if on_layer is None:
            results[name] = qw
        else:  # packed at once: one linear layer's integers alive at a time
            qw.source = None
            on_layer({name: qw})

    bar = _bar(len(layers), f"quantize {cfg.method}", progress)
    for i, layer in enumerate(layers):
        if stream is not None:
            stream.load_layer(i)
        if cfg.method == "gptq":
            stats = walk.stats(layer, want_xtx=True, want_sums=False)
            for name, m in linears(layer).items():
                emit(f"model.layers.{i}.{name}", _apply(
                    m, qalgo.gptq(m.weight.data, stats[name].xtx, 4, cfg.group_size, act_order=cfg.uses_act_order,
                                  damp=cfg.damp, shrink=cfg.shrink, keep_source=on_layer is None)))
            del stats
        elif cfg.method == "awq":
            for name, qw in _awq_layer(model, layer, walk, cfg).items():
                emit(f"model.layers.{i}.{name}", qw)
        else:
            for name, m in linears(layer).items():
                group = -1 if cfg.method == "rtn-int8" else cfg.group_size
                emit(f"model.layers.{i}.{name}", _apply(
                    m, qalgo.rtn(m.weight.data, cfg.bits, group, sym=cfg.method == "rtn-int8",
                                 keep_source=on_layer is None)))
        if walk is not None and i + 1 < len(layers):  # the last layer's outputs feed nothing
            walk.advance(layer)
        if stream is not None:
            stream.release_layer(i)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results


def _apply(m: Linear, qw: qalgo.QuantizedWeight) -> qalgo.QuantizedWeight:
    m.weight.data.copy_(qw.dequantize())
    return qw


def _awq_layer(model: CausalLM, layer: DecoderLayer, walk: LayerWalk, cfg: QuantizeConfig
               ) -> dict[str, qalgo.QuantizedWeight]:
    """Scale search for the four input groups on float weights, fold the scales into what
    precedes each group, clip search on the scaled weights, then round."""
    stats = walk.stats(layer, want_xtx=True)
    hess = {name: st.xtx.to(walk.dtype) for name, st in stats.items()}
    mods = linears(layer)
    attn, mlp = layer.self_attn, layer.mlp
    scales: dict[str, torch.Tensor] = {}
    for name, m in mods.items():
        if name == "self_attn.o_proj" and attn.num_heads != attn.num_kv_heads:
            continue  # o_proj's inputs come from several query heads per v row: nothing to fold into
        st = stats[name]
        scales[name], _, _ = qalgo.awq_scales(m.weight.data, hess[name], st.mean_abs, st.num_rows, 4, cfg.group_size)
    with torch.no_grad():
        for name, s in scales.items():
            mods[name].weight.data.mul_(s)
        _fold_into_norm(layer.input_layernorm, scales["self_attn.qkv_proj"], model.cfg.norm_offset)
        _fold_into_norm(layer.mlp_norm, scales["mlp.gate_up_proj"], model.cfg.norm_offset)
        mlp.gate_up_proj.weight.data[mlp.inter:].div_(scales["mlp.down_proj"][:, None])
        if "self_attn.o_proj" in scales:
            v = slice(attn.q_size + attn.kv_size, None)
            attn.qkv_proj.weight.data[v].div_(scales["self_attn.o_proj"][:, None])
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias.data[v].div_(scales["self_attn.o_proj"])
    out = {}
    for name, m in mods.items():
        clip = None
        if cfg.awq_clip and name != "self_attn.qkv_proj":  # clipping q/k distorts attention scores (AWQ skips them too)
            h = stats[name].xtx
            if name in scales:  # the scaled layer's inputs are x / s
                h = h / (scales[name][:, None] * scales[name][None, :])
            clip = qalgo.awq_clip(m.weight.data, h.to(walk.dtype), 4, cfg.group_size)
        out[name] = _apply(m, qalgo.rtn(m.weight.data, 4, cfg.group_size, clip=clip))
    return out


def _fold_into_norm(norm, s: torch.Tensor, offset: float) -> None:
    """RMSNorm output times (w + offset); dividing that by s means w' = (w + offset) / s - offset."""
    norm.weight.data.copy_((norm.weight.data + offset) / s - offset)


def checkpoint_tensors(model: CausalLM, results: dict[str, qalgo.QuantizedWeight], cfg: QuantizeConfig
                       ) -> dict[str, torch.Tensor]:
    """The packed tensors of every quantized layer under Hugging Face names, fused layers split."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, qw in results.items():
        m = modules[name]
        rows = {k: split_rows(name, m, t) for k, t in (("q", qw.q), ("zeros", qw.zeros), ("scales", qw.scales))}
        for shard in rows["q"]:
            q, zeros, scales = rows["q"][shard], rows["zeros"][shard], rows["scales"][shard]
            if cfg.method == "awq":
                tensors = packed.pack_awq(q, zeros, scales)
            else:
                tensors = packed.pack_gptq(q, zeros, scales, qw.g_idx, cfg.bits)
            out.update({f"{shard}.{k}": v for k, v in tensors.items()})
    return out


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="layer")

"""LoRA adapter files -> per-projection low-rank pairs placed on this model's layers.

Two formats: PEFT's directory (`adapter_config.json` + `adapter_model.safetensors`: `r`,
`lora_alpha`, `target_modules`, rsLoRA, `rank_pattern` / `alpha_pattern`) and llama.cpp's LoRA GGUF
(`general.type` adapter, `adapter.lora.alpha`, tensors `blk.N.<name>.weight.lora_a|lora_b`, Q/K
rows in llama.cpp's rotary order for Llama-family files). Either becomes `AdapterWeights`: for every
targeted projection of the model (`model.layers.N.self_attn.qkv_proj`, ...), per output part its
A (r, K), B (n, r) and scale. Everything a model cannot run is refused here, before any request
uses the adapter: another base model's shapes, modules it has no place for (embeddings, the output
head, experts), DoRA, trained biases, a rank over the engine's limit, an unknown format.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from tokenmill.layers.linear import Linear
from tokenmill.models.llama import CausalLM

# the checkpoint's projection -> (our fused layer, part index)
_PROJ = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2), "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
    # fused in the checkpoint too (Phi-3): one A, B split over the parts
    "self_attn.qkv_proj": ("self_attn.qkv_proj", None), "mlp.gate_up_proj": ("mlp.gate_up_proj", None),
}
TARGETS = sorted({k.rsplit(".", 1)[1] for k in _PROJ})
_GGUF_PROJ = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
              "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PEFT_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])(?:\.default)?\.weight$")
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


@dataclass
class AdapterWeights:
    """One adapter, placed: layer path -> {part: (A (r, K), B (n_part, r), scale)}."""
    name: str
    path: str
    rank: int
    modules: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]]

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for parts in self.modules.values() for a, b, _ in parts.values())


def load(name: str, path: str, model: CausalLM, max_rank: int) -> AdapterWeights:
    """Read and check the adapter at `path` against `model`; ValueError says what does not fit."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        pairs, scales, rank = _read_peft(path)
    elif os.path.isfile(path) and _is_gguf(path):
        pairs, scales, rank = _read_gguf(path, model)
    elif not os.path.exists(path):
        raise ValueError(f"LoRA adapter {name!r}: {path} does not exist.")
    else:
        raise ValueError(f"LoRA adapter {name!r}: {path} is neither a PEFT adapter directory (adapter_config.json + "
                         "adapter_model.safetensors) nor a llama.cpp LoRA GGUF file.")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, over this engine's max_lora_rank {max_rank}; "
                         f"start it with --max-lora-rank {_next_rank(rank)} or more.")
    return AdapterWeights(name, path, rank, _place(name, pairs, scales, model))


def _place(name: str, pairs: dict, scales: dict, model: CausalLM) -> dict:
    layers = dict(model.named_modules())
    placed: dict[str, dict[int, tuple]] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {proj} has lora_{'A' if 'A' in ab else 'B'} "
                             "without its pair; the file is incomplete.")
        if proj not in _PROJ:
            raise ValueError(f"LoRA adapter {name!r} targets {proj} in layer {layer}; tokenmill runs adapters on "
                             f"the attention and MLP projections ({', '.join(TARGETS)}) only.")
        if layer >= model.cfg.num_layers:
            raise ValueError(f"LoRA adapter {name!r} has weights for layer {layer}, but the model has "
                             f"{model.cfg.num_layers} layers: it was trained on another model.")
        ours, part = _PROJ[proj]
        target = layers.get(f"model.layers.{layer}.{ours}")
        if not isinstance(target, Linear):
            raise ValueError(f"LoRA adapter {name!r} targets {proj} in layer {layer}, which this model does not "
                             "have as a dense projection (a mixture-of-experts layer?).")
        a, b = ab["A"].to(torch.float32), ab["B"].to(torch.float32)
        sizes = target.part_sizes()
        width = sizes[part] if part is not None else sum(sizes)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape != (width, a.shape[0]):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {proj} has A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)}, but this model's projection takes {target.in_features} inputs to "
                             f"{width} outputs: the adapter was trained on another model.")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {proj} holds non-finite values.")
        scale = scales[(layer, proj)]
        slot = placed.setdefault(f"model.layers.{layer}.{ours}", {})
        if part is not None:
            slot[part] = (a.contiguous(), b.contiguous(), scale)
        else:
            for p, (lo, n) in enumerate(target.shard_offsets.values()):
                slot[p] = (a.contiguous(), b[lo:lo + n].contiguous(), scale)
    if not placed:
        raise ValueError(f"LoRA adapter {name!r} holds no LoRA weights.")
    return placed


def _read_peft(path: str) -> tuple[dict, dict, int]:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path} has no adapter_config.json: not a PEFT adapter directory.")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path} is not readable JSON: {e}.") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object.")
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"{path} is a PEFT {kind} adapter; tokenmill serves LoRA adapters.")
    if cfg.get("use_dora"):
        raise ValueError(f"{path} is a DoRA adapter (use_dora); tokenmill serves plain LoRA.")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{path} trains biases (bias {cfg['bias']!r}); tokenmill serves adapters with bias 'none'.")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{path} saves whole modules ({cfg['modules_to_save']}); tokenmill serves low-rank "
                         "pairs on the attention and MLP projections only.")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"{path} stores fan_in_fan_out weights (GPT-2 style), which no model here uses.")
    weights = _peft_tensors(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in weights.items():
        m = _PEFT_KEY.search(key)
        if m is None:
            raise ValueError(f"{path}: tensor {key!r} is not a LoRA A/B weight of a decoder layer's projection "
                             f"(tokenmill runs adapters on {', '.join(TARGETS)}).")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rs = bool(cfg.get("use_rslora", False))
    patterns = cfg.get("alpha_pattern") or {}
    scales, rank = {}, 0
    for (layer, proj), ab in pairs.items():
        r = ab["A"].shape[0] if "A" in ab else ab["B"].shape[-1]
        rank = max(rank, r)
        full = f"model.layers.{layer}.{proj}"
        a = next((float(v) for k, v in patterns.items() if re.fullmatch(rf"(.*\.)?{k}", full)), alpha)
        scales[(layer, proj)] = a / (math.sqrt(r) if rs else r)
    return pairs, scales, rank


def _peft_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st):
        found = sorted(os.listdir(path))
        raise ValueError(f"{path} has no adapter_model.safetensors (found {found[:8]}); save the adapter with "
                         "safe_serialization (PEFT's default).")
    from safetensors.torch import load_file

    try:
        return load_file(st)
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise ValueError(f"{st} is not a readable safetensors file ({type(e).__name__}).") from None


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _read_gguf(path: str, model: CausalLM) -> tuple[dict, dict, int]:
    from tokenmill.models.gguf_loader import GGUFFile, _unpermute

    f = GGUFFile(path)
    if f.meta.get("general.type") != "adapter" or f.meta.get("adapter.type") != "lora":
        raise ValueError(f"{path} is a GGUF file but not a LoRA adapter (general.type {f.meta.get('general.type')!r}, "
                         f"adapter.type {f.meta.get('adapter.type')!r}).")
    permute = f.architecture in ("llama", "mistral")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tname, info in f.tensors.items():
        m = _GGUF_KEY.fullmatch(tname)
        if m is None or m.group(2) not in _GGUF_PROJ:
            raise ValueError(f"{path}: tensor {tname!r} is not a LoRA weight of a decoder layer's projection "
                             f"(tokenmill runs adapters on {', '.join(sorted(_GGUF_PROJ))}).")
        t = torch.from_numpy(f._dequantize(info).copy())
        layer, proj, kind = int(m.group(1)), _GGUF_PROJ[m.group(2)], m.group(3).upper()
        if kind == "B" and permute and proj in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = model.cfg.num_heads if proj == "self_attn.q_proj" else model.cfg.num_kv_heads
            if t.shape[0] % (2 * heads) == 0:  # wrong shapes are refused with the rest in `_place`
                t = _unpermute(t, heads)
        pairs.setdefault((layer, proj), {})[kind] = t
    alpha = float(f.meta.get("adapter.lora.alpha") or 0.0)
    scales, rank = {}, 0
    for key, ab in pairs.items():
        r = ab["A"].shape[0] if "A" in ab else ab["B"].shape[-1]
        rank = max(rank, r)
        scales[key] = alpha / r if alpha else 1.0  # llama.cpp: no alpha means scale 1
    return pairs, scales, rank


def _next_rank(rank: int) -> int:
    from tokenmill.config import MAX_LORA_RANKS

    return next((r for r in MAX_LORA_RANKS if r >= rank), rank)

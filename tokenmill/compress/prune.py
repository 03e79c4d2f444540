"""`tokenmill prune`: unstructured (magnitude, Wanda), semi-structured (2:4) and structured
(attention heads, FFN channels, whole layers) pruning of a float model.

Unstructured methods zero weights in place (the checkpoint keeps its shapes). Structured methods
return a genuinely smaller model: the same number of heads / channels is removed from every layer,
so the result is again a plain Llama/Qwen2/Gemma config that any engine loads. Importance comes
from calibration activations (Wanda's |w| * ||x||; for layers, the Block Influence of ShortGPT:
1 - cos(layer input, layer output)).
"""
from __future__ import annotations

import dataclasses

import torch

from tokenmill.compress.calib import LayerWalk, linears
from tokenmill.compress.export import float_tensors
from tokenmill.models.arch import ArchConfig
from tokenmill.models.llama import CausalLM

METHODS = ("magnitude", "wanda", "2:4", "heads", "ffn", "layers")
STRUCTURED = ("heads", "ffn", "layers")


def validate(method: str, sparsity: float | None) -> float:
    if method not in METHODS:
        raise ValueError(f"--method must be one of {list(METHODS)}, got {method!r}.")
    if method == "2:4":
        if sparsity not in (None, 0.5):
            raise ValueError(f"2:4 pruning removes exactly half the weights; --sparsity must be 0.5 or omitted, "
                             f"got {sparsity}.")
        return 0.5
    if sparsity is None or not 0 < sparsity < 1:
        raise ValueError(f"--sparsity must lie strictly between 0 and 1, got {sparsity}.")
    return sparsity


def needs_calibration(method: str) -> bool:
    return method != "magnitude"


# ------------------------------------------------------------------ unstructured
@torch.no_grad()
def prune_unstructured(model: CausalLM, method: str, sparsity: float, samples: list[torch.Tensor] | None) -> dict:
    """Zero weights of every decoder linear layer in place; returns per-layer achieved sparsity."""
    walk = LayerWalk(model, samples) if needs_calibration(method) else None
    for layer in model.model.layers:
        stats = walk.stats(layer) if walk is not None else None
        for name, m in linears(layer).items():
            w = m.weight.data
            if method == "magnitude":
                _zero_lowest(w.abs().flatten(), w.view(-1), round(sparsity * w.numel()))
            else:
                score = w.abs() * stats[name].sq.sqrt()[None, :]          # Wanda: |w_ij| * ||x_j||
                if method == "wanda":
                    k = round(sparsity * w.shape[1])                      # per output row, as the paper
                    idx = torch.topk(score, k, dim=1, largest=False).indices
                    w.scatter_(1, idx, 0.0)
                else:                                                     # 2:4 by the same score
                    g = score.view(w.shape[0], -1, 4)
                    idx = torch.topk(g, 2, dim=-1, largest=False).indices
                    w.view(w.shape[0], -1, 4).scatter_(-1, idx, 0.0)
        if walk is not None:
            walk.advance(layer)
    return {"sparsity": sparsity_of(model)}


def _zero_lowest(score: torch.Tensor, flat: torch.Tensor, k: int) -> None:
    if k > 0:
        flat[torch.topk(score, k, largest=False).indices] = 0.0


def sparsity_of(model: CausalLM) -> float:
    """Share of zeros over the decoder linear layers' weights."""
    zeros = total = 0
    for layer in model.model.layers:
        for m in linears(layer).values():
            zeros += int((m.weight.data == 0).sum())
            total += m.weight.numel()
    return zeros / total


# ------------------------------------------------------------------ structured
@torch.no_grad()
def prune_structured(model: CausalLM, method: str, sparsity: float, samples: list[torch.Tensor]
                     ) -> tuple[ArchConfig, dict[str, torch.Tensor], dict]:
    """Returns the smaller model's config, its tensors (Hugging Face names) and what was removed."""
    cfg = model.cfg
    tensors = float_tensors(model)
    walk = LayerWalk(model, samples)
    if method == "layers":
        drop = round(sparsity * cfg.num_layers)
        if not 0 < drop < cfg.num_layers:
            raise ValueError(f"sparsity {sparsity} removes {drop} of {cfg.num_layers} layers; choose a value that "
                             "removes at least one and keeps at least one.")
        influence = []
        for layer in model.model.layers:
            before = walk.hidden
            walk.advance(layer)
            cos = [torch.nn.functional.cosine_similarity(a, b, dim=-1).mean() for a, b in zip(before, walk.hidden)]
            influence.append(float(1 - torch.stack(cos).mean()))
        removed = sorted(sorted(range(cfg.num_layers), key=lambda i: influence[i])[:drop])
        kept = [i for i in range(cfg.num_layers) if i not in removed]
        out = {k: v for k, v in tensors.items() if not k.startswith("model.layers.")}
        for new, old in enumerate(kept):
            prefix = f"model.layers.{old}."
            out.update({f"model.layers.{new}.{k[len(prefix):]}": v for k, v in tensors.items() if k.startswith(prefix)})
        return (dataclasses.replace(cfg, num_layers=len(kept)), out,
                {"removed_layers": removed, "block_influence": [round(x, 5) for x in influence]})
    if method == "ffn":
        return _prune_ffn(model, walk, tensors, sparsity)
    return _prune_heads(model, walk, tensors, sparsity)


def _prune_ffn(model: CausalLM, walk: LayerWalk, tensors: dict, sparsity: float):
    cfg = model.cfg
    inter = cfg.intermediate_size
    keep = int(round((1 - sparsity) * inter / 32)) * 32  # multiples of 32 keep the int4 kernels usable
    if not 0 < keep < inter:
        raise ValueError(f"sparsity {sparsity} keeps {keep} of {inter} FFN channels; choose a value that keeps "
                         "at least 32 and removes at least 32.")
    for i, layer in enumerate(model.model.layers):
        stats = walk.stats(layer)
        down = layer.mlp.down_proj.weight.data
        score = stats["mlp.down_proj"].sq.sqrt() * down.norm(dim=0)       # channel j: ||x_j|| * ||W_down[:, j]||
        idx = torch.sort(torch.topk(score, keep).indices).values
        p = f"model.layers.{i}.mlp."
        for proj in ("gate_proj", "up_proj"):
            tensors[p + proj + ".weight"] = tensors[p + proj + ".weight"][idx]
        tensors[p + "down_proj.weight"] = tensors[p + "down_proj.weight"][:, idx]
        walk.advance(layer)
    return dataclasses.replace(cfg, intermediate_size=keep), tensors, {"intermediate_size": [inter, keep]}


def _prune_heads(model: CausalLM, walk: LayerWalk, tensors: dict, sparsity: float):
    """Remove the same number of query heads from every KV group of every layer (GQA stays
    regular); with one query head per group, whole KV groups go."""
    cfg = model.cfg
    per_group = cfg.num_heads // cfg.num_kv_heads
    units = per_group if per_group > 1 else cfg.num_kv_heads   # what one layer chooses among
    drop = round(sparsity * units)
    if not 0 < drop < units:
        where = "query heads per KV group" if per_group > 1 else "heads per layer"
        raise ValueError(f"sparsity {sparsity} removes {drop} of {units} {where}; choose a value that removes "
                         "at least one and keeps at least one.")
    d = cfg.head_dim
    for i, layer in enumerate(model.model.layers):
        stats = walk.stats(layer)
        o = layer.self_attn.o_proj.weight.data
        chan = stats["self_attn.o_proj"].sq.sqrt() * o.norm(dim=0)        # per o_proj input channel
        head_score = chan.view(cfg.num_heads, d).sum(-1)
        p = f"model.layers.{i}.self_attn."
        if per_group > 1:
            grouped = head_score.view(cfg.num_kv_heads, per_group)
            keep_in_group = torch.sort(torch.topk(grouped, per_group - drop, dim=1).indices, dim=1).values
            heads = (keep_in_group + torch.arange(cfg.num_kv_heads)[:, None] * per_group).flatten()
            kv_heads = torch.arange(cfg.num_kv_heads)
        else:
            kv_heads = torch.sort(torch.topk(head_score, units - drop).indices).values
            heads = kv_heads
        rows = (heads[:, None] * d + torch.arange(d)[None, :]).flatten()
        kv_rows = (kv_heads[:, None] * d + torch.arange(d)[None, :]).flatten()
        for name, r in (("q_proj", rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            for leaf in ("weight", "bias"):
                if f"{p}{name}.{leaf}" in tensors:
                    tensors[f"{p}{name}.{leaf}"] = tensors[f"{p}{name}.{leaf}"][r]
        tensors[p + "o_proj.weight"] = tensors[p + "o_proj.weight"][:, rows]
        walk.advance(layer)
    new = dataclasses.replace(cfg, num_heads=int(heads.numel()), num_kv_heads=int(kv_heads.numel()))
    return new, tensors, {"num_heads": [cfg.num_heads, new.num_heads], "num_kv_heads": [cfg.num_kv_heads,
                                                                                       new.num_kv_heads]}

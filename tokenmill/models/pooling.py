"""From hidden states to one vector per input, as the checkpoint's sentence-transformers config
says (`modules.json`: Transformer -> Pooling -> optional Dense -> optional Normalize).

Pooling modes, concatenated in sentence-transformers' order when several are set: the first (CLS)
token, the per-dimension max, the mean, the mean scaled by sqrt(length), the last token (decoder
embedders: Qwen3-Embedding, e5-mistral). A Dense module is a linear layer with an activation.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

MODES = ("cls", "max", "mean", "mean_sqrt_len", "last")
_ST_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
            "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_lasttoken": "last"}
_ST_NAMES = {"cls": "cls", "max": "max", "mean": "mean", "mean_sqrt_len_tokens": "mean_sqrt_len", "lasttoken": "last"}
_ACTIVATIONS = {"torch.nn.modules.linear.Identity": lambda x: x, "torch.nn.modules.activation.Tanh": torch.tanh}


@dataclass(frozen=True)
class Dense:
    weight: torch.Tensor                 # (out, in)
    bias: torch.Tensor | None
    activation: str


@dataclass(frozen=True)
class PoolingConfig:
    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    dense: tuple[Dense, ...] = field(default=())

    @classmethod
    def from_dir(cls, path: str, default: tuple[str, ...] = ("mean",)) -> PoolingConfig:
        """Read `modules.json` and its modules' configs; without one, `default` and no normalization."""
        spec = os.path.join(path, "modules.json")
        if not os.path.isfile(spec):
            return cls(default)
        with open(spec, encoding="utf-8") as f:
            modules = json.load(f)
        modes, normalize, dense = default, False, []
        for m in modules:
            kind = m.get("type", "").rsplit(".", 1)[-1]
            where = os.path.join(path, m.get("path", ""))
            if kind == "Transformer":
                continue
            if kind == "Pooling":
                modes = _pooling_modes(where)
            elif kind == "Normalize":
                normalize = True
            elif kind == "Dense":
                dense.append(_dense(where))
            else:
                raise ValueError(f"{spec}: module type {m.get('type')!r} is not supported "
                                 "(Transformer, Pooling, Dense, Normalize).")
        return cls(tuple(modes), normalize, tuple(dense))

    def dim(self, hidden_size: int) -> int:
        """Length of the vectors this pooling makes from hidden states of `hidden_size`."""
        return self.dense[-1].weight.shape[0] if self.dense else hidden_size * len(self.modes)

    def __call__(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """(B, dim) vectors of inputs whose hidden states (T, hidden) lie back to back."""
        parts = torch.split(hidden.float(), lengths)
        out = torch.cat([torch.stack([_pool(p, mode) for p in parts]) for mode in self.modes], dim=-1)
        for d in self.dense:
            out = _ACTIVATIONS[d.activation](torch.nn.functional.linear(out, d.weight, d.bias))
        return torch.nn.functional.normalize(out, dim=-1) if self.normalize else out


def for_decoder(path: str) -> PoolingConfig:
    """A decoder's pooling: last token, as its sentence-transformers config says (Qwen3-Embedding)
    or by default, normalized by default (vLLM's default for decoder embedders). Only the last
    token: chunked prefill keeps no earlier token's hidden state."""
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, "modules.json"))):
        return PoolingConfig(("last",), normalize=True)
    cfg = PoolingConfig.from_dir(path, default=("last",))
    if cfg.modes != ("last",) or cfg.dense:
        raise ValueError(f"{path}/modules.json pools with {list(cfg.modes)}{' and a Dense layer' if cfg.dense else ''}; "
                         "a decoder embeds with last-token pooling only.")
    return cfg


def declares_matryoshka(path: str) -> bool:
    """Whether the checkpoint says its embeddings may be cut short (`dimensions`): config.json's
    `matryoshka_dimensions` or `is_matryoshka`, as vLLM reads them."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return False
    with open(file, encoding="utf-8") as f:
        cfg = json.load(f)
    return bool(cfg.get("matryoshka_dimensions") or cfg.get("is_matryoshka"))


def _pool(h: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "cls":
        return h[0]
    if mode == "last":
        return h[-1]
    if mode == "max":
        return h.amax(0)
    if mode == "mean":
        return h.mean(0)
    return h.sum(0) / h.shape[0] ** 0.5  # mean_sqrt_len


def _pooling_modes(where: str) -> tuple[str, ...]:
    """The modes of a Pooling config: sentence-transformers 6's `pooling_mode` (a name or a list,
    in output order) or the older `pooling_mode_*` flags (in their fixed order)."""
    with open(os.path.join(where, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("include_prompt") is False:
        raise ValueError(f"{where}: pooling without the prompt's tokens (include_prompt false, INSTRUCTOR-style) "
                         "is not supported.")
    named = cfg.get("pooling_mode")
    if named is not None:
        names = [named] if isinstance(named, str) else list(named)
        unknown = [n for n in names if n not in _ST_NAMES]
        if unknown:
            raise ValueError(f"{where}: pooling mode {unknown[0]!r} is not supported ({sorted(_ST_NAMES)}).")
        return tuple(_ST_NAMES[n] for n in names)
    if cfg.get("pooling_mode_weightedmean_tokens"):
        raise ValueError(f"{where}: weighted-mean pooling is not supported (cls, max, mean, mean_sqrt_len, last).")
    modes = tuple(mode for key, mode in _ST_KEYS.items() if cfg.get(key))
    if not modes:
        raise ValueError(f"{where}/config.json sets no pooling mode.")
    return modes


def _dense(where: str) -> Dense:
    from safetensors.torch import load_file

    with open(os.path.join(where, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    act = cfg.get("activation_function", "torch.nn.modules.linear.Identity")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{where}: Dense activation {act!r} is not supported ({sorted(_ACTIVATIONS)}).")
    file = os.path.join(where, "model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"{where} has no model.safetensors (a Dense module saved as .bin is not read).")
    t = load_file(file)
    return Dense(t["linear.weight"].float(), t["linear.bias"].float() if "linear.bias" in t else None, act)

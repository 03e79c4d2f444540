"""Encoder models of the BERT family (BERT, RoBERTa, XLM-RoBERTa: the encoders under bge, e5, gte,
multilingual-e5 and the bge-reranker cross-encoders), for embeddings and reranking.

What sets them apart from the decoders in llama.py: every token attends to every other token of
its own input (no causal mask, so no KV cache and no chunking: an input runs whole), post-norm
residual blocks with LayerNorm, learned absolute positions (RoBERTa's start after the padding id)
and token types. The forward takes a ragged batch, inputs back to back, as the decoders' prefill
does. A sequence-classification head (a cross-encoder's relevance score) is optional.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import Linear

_ACTS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
_FAMILIES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta"}
HEADS = ("BertForSequenceClassification", "RobertaForSequenceClassification",
         "XLMRobertaForSequenceClassification")


@dataclass(frozen=True)
class EncoderConfig:
    family: str                 # "bert" or "roberta" (RoBERTa, XLM-RoBERTa)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    eps: float
    hidden_act: str
    pad_token_id: int
    num_labels: int = 0         # outputs of the sequence-classification head; 0: no head

    @classmethod
    def from_hf(cls, cfg: dict) -> EncoderConfig:
        family = _FAMILIES.get(cfg.get("model_type", ""))
        if family is None:
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not an encoder tokenmill runs; "
                             f"supported: {sorted(_FAMILIES)}.")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {cfg['position_embedding_type']!r} is not supported "
                             "(absolute positions only).")
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {sorted(_ACTS)}.")
        head = any(a in HEADS for a in cfg.get("architectures") or [])
        labels = len(cfg["id2label"]) if head and cfg.get("id2label") else int(cfg.get("num_labels", 2)) if head else 0
        return cls(family, cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"],
                   cfg["num_attention_heads"], cfg["intermediate_size"], cfg["max_position_embeddings"],
                   cfg.get("type_vocab_size", 2), cfg.get("layer_norm_eps", 1e-12), act,
                   cfg.get("pad_token_id", 0) or 0, labels)

    @property
    def position_offset(self) -> int:
        """RoBERTa numbers positions from the padding id + 1 (fairseq's convention)."""
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def max_tokens(self) -> int:
        """The longest input the position table covers."""
        return self.max_positions - self.position_offset


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.qkv = Linear(h, 3 * h, bias=True)
        self.attn_out = Linear(h, h, bias=True)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.eps)
        self.up = Linear(h, cfg.intermediate_size, bias=True)
        self.down = Linear(cfg.intermediate_size, h, bias=True)
        self.out_norm = nn.LayerNorm(h, eps=cfg.eps)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, runs: list[tuple[torch.Tensor | None, int]]) -> torch.Tensor:
        """`runs`: the inputs of each length (`_same_length_runs`)."""
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)   # (T, H, D) each
        a = torch.empty_like(q)
        for idx, n in runs:
            # the inputs of one length as a batch (B, H, n, D), each attending over itself only, both
            # directions; with a batch dimension SDPA takes its fused CPU kernel
            b = [(t if idx is None else t[idx]).view(-1, n, self.num_heads, self.head_dim).transpose(1, 2)
                 for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*b).transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)
            if idx is None:
                a = out
            else:
                a[idx] = out
        a = a.reshape(x.shape)
        x = self.attn_norm(x + self.attn_out(a))
        return self.out_norm(x + self.down(self.act(self.up(x))))


def _same_length_runs(lengths: list[int], device: torch.device) -> list[tuple[torch.Tensor | None, int]]:
    """(token indices, length) of each group of inputs of one length, inputs back to back; None
    for the indices when every input has that length (the whole batch, in order)."""
    if len(set(lengths)) == 1:
        return [(None, lengths[0])]
    starts, at = {}, 0
    for n in lengths:
        starts.setdefault(n, []).append(at)
        at += n
    return [(torch.tensor([s + i for s in group for i in range(n)], device=device), n) for n, group in starts.items()]


class Encoder(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word = nn.Embedding(cfg.vocab_size, h)
        self.position = nn.Embedding(cfg.max_positions, h)
        self.token_type = nn.Embedding(max(cfg.type_vocab_size, 1), h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        # BERT's head: tanh(pooler(CLS)) -> classifier; RoBERTa's: tanh(dense(CLS)) -> out_proj
        self.head_dense = Linear(h, h, bias=True) if cfg.num_labels else None
        self.head_out = Linear(h, cfg.num_labels, bias=True) if cfg.num_labels else None

    def positions(self, lengths: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(n) for n in lengths]) + self.cfg.position_offset

    def forward(self, input_ids: torch.Tensor, lengths: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (T, hidden) of inputs given back to back (`lengths` of each)."""
        if any(n > self.cfg.max_tokens for n in lengths):
            raise ValueError(f"an input of {max(lengths)} tokens is longer than the model's "
                             f"{self.cfg.max_tokens} positions.")
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word(input_ids) + self.position(self.positions(lengths).to(input_ids.device)) + self.token_type(types)
        x = self.embed_norm(x)
        runs = _same_length_runs(lengths, x.device)
        for layer in self.layers:
            x = layer(x, runs)
        return x

    def classify(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The classification head's logits (B, num_labels) on each input's first token."""
        if self.head_out is None:
            raise ValueError("this model has no sequence-classification head.")
        first = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        return self.head_out(torch.tanh(self.head_dense(hidden[first])))


# llama.cpp's encoder architectures: `bert` runs (models/encoder_gguf.py), the others are refused by name
GGUF_ENCODERS = ("bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "modern-bert", "neo-bert")


def is_encoder(path: str) -> bool:
    """Whether `path` is an encoder: a Hugging Face directory of one this module runs, or a GGUF
    file of one of llama.cpp's encoder architectures."""
    if os.path.isfile(path):
        from tokenmill.models.gguf_header import architecture

        return architecture(path) in GGUF_ENCODERS
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return False
    with open(file, encoding="utf-8") as f:
        try:
            return json.load(f).get("model_type") in _FAMILIES
        except (json.JSONDecodeError, AttributeError):
            return False  # the decoder loader says what is wrong with it


def _hf_name(name: str) -> str | None:
    """Our parameter name for a Hugging Face encoder tensor, None for one we do not use."""
    for prefix in ("bert.", "roberta.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    simple = {"embeddings.word_embeddings.weight": "word.weight",
              "embeddings.position_embeddings.weight": "position.weight",
              "embeddings.token_type_embeddings.weight": "token_type.weight",
              "embeddings.LayerNorm.weight": "embed_norm.weight", "embeddings.LayerNorm.bias": "embed_norm.bias",
              "pooler.dense.weight": "head_dense.weight", "pooler.dense.bias": "head_dense.bias",
              "classifier.weight": "head_out.weight", "classifier.bias": "head_out.bias",
              "classifier.dense.weight": "head_dense.weight", "classifier.dense.bias": "head_dense.bias",
              "classifier.out_proj.weight": "head_out.weight", "classifier.out_proj.bias": "head_out.bias"}
    if name in simple:
        return simple[name]
    parts = name.split(".")
    if parts[0] != "encoder" or parts[1] != "layer":
        return None
    rest = ".".join(parts[3:])
    layer = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
             "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "out_norm"}
    for src, dst in layer.items():
        if rest.startswith(src + "."):
            return f"layers.{parts[2]}.{dst}.{rest[len(src) + 1:]}"
    for i, part in enumerate(("query", "key", "value")):
        if rest.startswith(f"attention.self.{part}."):
            return f"layers.{parts[2]}.qkv.{rest.rsplit('.', 1)[1]}#{i}"
    return None


def load_encoder(path: str, dtype: torch.dtype = torch.float32) -> Encoder:
    """An encoder from a Hugging Face directory (config.json, *.safetensors); every weight it
    needs must be there."""
    from safetensors import safe_open

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = EncoderConfig.from_hf(json.load(f))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors weights.")
    model = Encoder(cfg)
    params = dict(model.named_parameters())
    h = cfg.hidden_size
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(os.path.join(path, file), framework="pt") as f:
                for name in f.keys():
                    ours = _hf_name(name)
                    if ours is None or (ours.startswith("head_") and not cfg.num_labels):
                        continue
                    ours, _, part = ours.partition("#")
                    t = f.get_tensor(name).float()
                    target = params[ours].data
                    if part:  # q, k or v rows of the fused projection
                        target = target[int(part) * h:(int(part) + 1) * h]
                    if tuple(target.shape) != tuple(t.shape):
                        raise ValueError(f"{name} in {path} has shape {tuple(t.shape)}; the config says "
                                         f"{tuple(target.shape)}.")
                    target.copy_(t)
                    loaded.add(ours + part)
    need = {n + part for n in params for part in (("0", "1", "2") if ".qkv." in n else ("",))}
    missing = sorted(need - loaded)
    if cfg.type_vocab_size == 0:
        missing = [m for m in missing if not m.startswith("token_type")]
    if missing:
        raise ValueError(f"{path} lacks weights the model needs: {missing[:5]}{' ...' if len(missing) > 5 else ''}.")
    return model.to(dtype).eval()

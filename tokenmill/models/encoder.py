"""Encoder models of the BERT family (BERT, RoBERTa, XLM-RoBERTa: the encoders under bge, e5, gte,
multilingual-e5 and the bge-reranker cross-encoders; Nomic BERT: nomic-embed-text), for
embeddings and reranking.

What sets them apart from the decoders in llama.py: every token attends to every other token of
its own input (no causal mask, so no KV cache and no chunking: an input runs whole), post-norm
residual blocks with LayerNorm, learned absolute positions (RoBERTa's start after the padding id)
and token types. Nomic BERT keeps the block and swaps three parts: rotary positions (NeoX's
halves) instead of the position table, a SiLU-gated MLP, no biases in its projections. The forward
takes a ragged batch, inputs back to back, as the decoders' prefill does. A sequence-classification
head (a cross-encoder's relevance score) is optional.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.layers.linear import Linear

_ACTS = {"gelu": F.gelu, "silu": F.silu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
_FAMILIES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "nomic_bert": "nomic"}
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
    rope_theta: float = 0.0     # rotary positions' base (Nomic BERT); 0: a learned position table
    gated: bool = False         # MLP: down(act(gate(x)) * up(x)) (Nomic BERT) instead of down(act(up(x)))
    bias: bool = True           # the projections have biases (not Nomic BERT's)

    @classmethod
    def from_hf(cls, cfg: dict) -> EncoderConfig:
        family = _FAMILIES.get(cfg.get("model_type", ""))
        if family is None:
            raise ValueError(f"model_type {cfg.get('model_type')!r} is not an encoder tokenmill runs; "
                             f"supported: {sorted(_FAMILIES)}.")
        if family == "nomic":
            return cls._from_nomic(cfg)
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

    @classmethod
    def _from_nomic(cls, cfg: dict) -> EncoderConfig:
        """transformers' NomicBertConfig, or the names of Nomic's own code (n_embd, n_layer, ...)."""
        def get(name: str, old: str, default=None):
            value = cfg.get(name, cfg.get(old, default))
            if value is None:
                raise ValueError(f"the Nomic BERT config lacks {name} ({old}).")
            return value

        act = cfg.get("hidden_act", cfg.get("activation_function", "silu"))
        if act not in ("silu", "swiglu"):
            raise ValueError(f"Nomic BERT with activation {act!r} is not supported (SwiGLU only).")
        if cfg.get("rotary_emb_fraction", 1.0) != 1.0 or cfg.get("rotary_emb_interleaved", False) \
                or cfg.get("prenorm", False):
            raise ValueError("this Nomic BERT variant (partial or interleaved rotary, or pre-norm) is not supported.")
        if any(cfg.get(k) for k in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias")):
            raise ValueError("Nomic BERT with biases in its projections is not supported.")
        if (cfg.get("rope_parameters") or {}).get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {cfg['rope_parameters']['rope_type']!r} is not supported.")
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rotary_emb_base") \
            or cfg.get("rope_theta") or 1000.0
        hidden, heads = get("hidden_size", "n_embd"), get("num_attention_heads", "n_head")
        if cfg.get("head_dim") not in (None, hidden // heads):
            raise ValueError(f"head_dim {cfg['head_dim']} other than hidden_size / heads is not supported.")
        return cls("nomic", cfg["vocab_size"], hidden, get("num_hidden_layers", "n_layer"),
                   heads, get("intermediate_size", "n_inner", None),
                   get("max_position_embeddings", "n_positions", 2048), cfg.get("type_vocab_size", 2),
                   get("layer_norm_eps", "layer_norm_epsilon", 1e-12), "silu", cfg.get("pad_token_id", 0) or 0,
                   0, float(theta), gated=True, bias=False)

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
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.num_heads, self.head_dim = cfg.num_heads, h // cfg.num_heads
        self.qkv = Linear(h, 3 * h, bias=cfg.bias)
        self.attn_out = Linear(h, h, bias=cfg.bias)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.eps)
        self.inter, self.gated = inter, cfg.gated
        self.up = Linear(h, 2 * inter if cfg.gated else inter, bias=cfg.bias)  # gated: gate rows, then up rows
        self.down = Linear(inter, h, bias=cfg.bias)
        self.out_norm = nn.LayerNorm(h, eps=cfg.eps)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, runs: list[tuple[torch.Tensor | None, int]],
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, starts: torch.Tensor | None = None
                ) -> torch.Tensor:
        """`runs`: the inputs of each length (`_same_length_runs`); `rope`: each token's rotary
        (cos, sin), (T, 1, head_dim) each, where the model has rotary positions; `starts`: where
        each input begins (and T), when tokenmill's encoder attention kernel runs this batch."""
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)   # (T, H, D) each
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if starts is not None:
            a = kernels.encoder_attention(q, k, v, starts, self.head_dim ** -0.5)
            x = self.attn_norm(x + self.attn_out(a.view(x.shape)))
            return self._mlp(x)
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
        return self._mlp(self.attn_norm(x + self.attn_out(a)))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        u = self.up(x)
        u = self.act(u[:, :self.inter]) * u[:, self.inter:] if self.gated else self.act(u)
        return self.out_norm(x + self.down(u))


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (T, H, D): NeoX's layout, the first half of D paired with the second."""
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


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
        self.position = nn.Embedding(cfg.max_positions, h) if not cfg.rope_theta else None
        if cfg.rope_theta:
            d = h // cfg.num_heads
            self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d),
                                 persistent=False)
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
        positions = self.positions(lengths).to(input_ids.device)
        x = self.word(input_ids) + self.token_type(types)
        rope = None
        if self.position is not None:
            x = x + self.position(positions)
        else:
            angles = positions[:, None].float() * self.inv_freq
            angles = torch.cat((angles, angles), dim=-1)[:, None, :]               # (T, 1, D)
            rope = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        x = self.embed_norm(x)
        runs, starts = [], None
        if kernels.encoder_attention_for(x, self.cfg.hidden_size // self.cfg.num_heads, max(lengths, default=0)):
            starts = torch.tensor([0, *lengths]).cumsum(0)  # the kernel: every input in one call
        else:
            runs = _same_length_runs(lengths, x.device)
        for layer in self.layers:
            x = layer(x, runs, rope, starts)
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


_NOMIC_LAYER = {"self_attn.o_proj": "attn_out", "attn.out_proj": "attn_out", "mlp.down_proj": "down",
                "mlp.fc2": "down", "post_attention_layernorm": "attn_norm", "norm1": "attn_norm",
                "post_mlp_layernorm": "out_norm", "norm2": "out_norm", "mlp.gate_proj": "up#g", "mlp.fc12": "up#g",
                "mlp.up_proj": "up#u", "mlp.fc11": "up#u", "attn.Wqkv": "qkv", "self_attn.q_proj": "qkv#0",
                "self_attn.k_proj": "qkv#1", "self_attn.v_proj": "qkv#2"}


def _hf_name(name: str) -> str | None:
    """Our parameter name for a Hugging Face encoder tensor, None for one we do not use; after a
    '#', the part of a fused parameter it fills (q/k/v: 0/1/2; a gated MLP's gate/up: g/u).
    Nomic BERT's tensors under transformers' names or under those of Nomic's own code."""
    for prefix in ("bert.", "roberta.", "model.", "nomic_bert."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    simple = {"embeddings.word_embeddings.weight": "word.weight",
              "embeddings.position_embeddings.weight": "position.weight",
              "embeddings.token_type_embeddings.weight": "token_type.weight",
              "embeddings.LayerNorm.weight": "embed_norm.weight", "embeddings.LayerNorm.bias": "embed_norm.bias",
              "emb_ln.weight": "embed_norm.weight", "emb_ln.bias": "embed_norm.bias",
              "pooler.dense.weight": "head_dense.weight", "pooler.dense.bias": "head_dense.bias",
              "classifier.weight": "head_out.weight", "classifier.bias": "head_out.bias",
              "classifier.dense.weight": "head_dense.weight", "classifier.dense.bias": "head_dense.bias",
              "classifier.out_proj.weight": "head_out.weight", "classifier.out_proj.bias": "head_out.bias"}
    if name in simple:
        return simple[name]
    parts = name.split(".")
    if parts[0] == "encoder" and parts[1] == "layers":  # Nomic's own code: encoder.layers.N...
        parts = parts[1:]
    if parts[0] == "layers" and len(parts) > 3:         # Nomic BERT
        module, kind = ".".join(parts[2:-1]), parts[-1]
        ours = _NOMIC_LAYER.get(module)
        if ours is None:
            return None
        dst, _, part = ours.partition("#")
        return f"layers.{parts[1]}.{dst}.{kind}" + (f"#{part}" if part else "")
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


def fused_parts(model: Encoder, name: str) -> tuple[str, ...]:
    """The parts a fused parameter is filled from: q/k/v rows, a gated MLP's gate and up rows."""
    if ".qkv." in name:
        return ("0", "1", "2")
    if ".up." in name and model.cfg.gated:
        return ("g", "u")
    return ("",)


def part_rows(model: Encoder, target: torch.Tensor, part: str) -> torch.Tensor:
    """The rows of a fused parameter one part fills."""
    if not part:
        return target
    n = model.cfg.intermediate_size if part in "gu" else model.cfg.hidden_size
    i = "gu".index(part) if part in "gu" else int(part)
    return target[i * n:(i + 1) * n]


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
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(os.path.join(path, file), framework="pt") as f:
                for name in f.keys():
                    ours = _hf_name(name)
                    if ours is None or (ours.startswith("head_") and not cfg.num_labels):
                        continue
                    ours, _, part = ours.partition("#")
                    if ours not in params:
                        raise ValueError(f"{name} in {path} has no place in this {cfg.family} encoder "
                                         f"(a bias where the config says none?).")
                    t = f.get_tensor(name).float()
                    target = part_rows(model, params[ours].data, part)
                    if tuple(target.shape) != tuple(t.shape):
                        raise ValueError(f"{name} in {path} has shape {tuple(t.shape)}; the config says "
                                         f"{tuple(target.shape)}.")
                    target.copy_(t)
                    loaded.update(ours + p for p in ((part,) if part else fused_parts(model, ours)))
    need = {n + part for n in params for part in fused_parts(model, n)}
    missing = sorted(need - loaded)
    if cfg.type_vocab_size == 0:
        missing = [m for m in missing if not m.startswith("token_type")]
    if missing:
        raise ValueError(f"{path} lacks weights the model needs: {missing[:5]}{' ...' if len(missing) > 5 else ''}.")
    return model.to(dtype).eval()

"""BERT-family encoders from GGUF files (llama.cpp's `bert` architecture, as its converter writes
bge, e5, gte and all-MiniLM models): config and pooling from the metadata, weights dequantized to
float (an encoder is small and runs float), the WordPiece tokenizer from the vocabulary.

llama.cpp's converter drops BERT's pooler, so a BERT cross-encoder cannot be run from its GGUF; a
head is loaded where the file has both of its layers (`cls`, `cls.output`: RoBERTa-style
rerankers). Other encoder architectures (nomic-bert, jina-bert-v2, ModernBERT) are refused by name.
"""
from __future__ import annotations

import re

import torch

from tokenmill.models.encoder import Encoder, EncoderConfig
from tokenmill.models.pooling import PoolingConfig

# llama.cpp's pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank (a classifier head)
_POOLING = {1: ("mean",), 2: ("cls",), 3: ("last",)}
_TOP = {"token_embd.weight": "word.weight", "position_embd.weight": "position.weight",
        "token_types.weight": "token_type.weight", "token_embd_norm.weight": "embed_norm.weight",
        "token_embd_norm.bias": "embed_norm.bias", "cls.weight": "head_dense.weight", "cls.bias": "head_dense.bias",
        "cls.output.weight": "head_out.weight", "cls.output.bias": "head_out.bias"}
_LAYER = {"attn_output": "attn_out", "attn_output_norm": "attn_norm", "ffn_up": "up", "ffn_down": "down",
          "layer_output_norm": "out_norm"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def config(meta: dict, tensors: dict) -> EncoderConfig:
    arch = meta.get("general.architecture")
    if arch != "bert":
        raise ValueError(f"GGUF architecture {arch!r} is not an encoder tokenmill runs (GGUF encoders: 'bert').")

    def need(key: str):
        value = meta.get(f"bert.{key}")
        if value is None:
            raise ValueError(f"the GGUF file lacks bert.{key}.")
        return value

    head = "cls.output.weight" in tensors
    if head and "cls.weight" not in tensors:
        raise ValueError("this GGUF classifier has no dense layer before its output (llama.cpp's converter drops "
                         "BERT's pooler); run the Hugging Face checkpoint instead.")
    if "token_embd.weight" not in tensors:
        raise ValueError("the GGUF file has no token_embd.weight.")
    hidden = int(need("embedding_length"))
    labels = tensors["cls.output.weight"].n_elements // hidden if head else 0
    vocab = int(tensors["token_embd.weight"].shape[1])  # shapes as stored: columns first
    return EncoderConfig("bert", vocab, hidden, int(need("block_count")),
                         int(need("attention.head_count")), int(need("feed_forward_length")),
                         int(need("context_length")), int(meta.get("tokenizer.ggml.token_type_count", 2)),
                         float(meta.get("bert.attention.layer_norm_epsilon", 1e-12)), "gelu",
                         int(meta.get("tokenizer.ggml.padding_token_id", 0)), labels)


def pooling(meta: dict) -> PoolingConfig:
    """The file's pooling, normalized as llama.cpp's server normalizes embeddings by default."""
    kind = int(meta.get("bert.pooling_type", 2))
    return PoolingConfig(_POOLING.get(kind, ("cls",)), normalize=True)


def _our_name(name: str) -> tuple[str, int | None] | None:
    """(our parameter, q/k/v part or None) for a llama.cpp tensor name; None for one we do not use."""
    if name in _TOP:
        return _TOP[name], None
    m = _BLK.match(name)
    if m is None:
        return None
    layer, part, kind = m.groups()
    if part in ("attn_q", "attn_k", "attn_v"):
        return f"layers.{layer}.qkv.{kind}", "qkv".index(part[-1])
    if part in _LAYER:
        return f"layers.{layer}.{_LAYER[part]}.{kind}", None
    return None


def load(path: str) -> tuple[Encoder, dict]:
    """The encoder and the file's metadata (its tokenizer, its pooling)."""
    from tokenmill.models.gguf_loader import GGUFFile

    gf = GGUFFile(path)
    cfg = config(gf.meta, gf.tensors)
    model = Encoder(cfg)
    params = dict(model.named_parameters())
    h = cfg.hidden_size
    loaded: set[str] = set()
    with torch.no_grad():
        for name, info in gf.tensors.items():
            ours = _our_name(name)
            if ours is None:
                continue
            target_name, part = ours
            target = params[target_name].data
            if part is not None:
                target = target[part * h:(part + 1) * h]
            t = torch.tensor(gf._dequantize(info)).reshape(target.shape) \
                if int(info.n_elements) == target.numel() else None
            if t is None:
                raise ValueError(f"{name} in {path} has {int(info.n_elements)} values; the metadata says "
                                 f"{tuple(target.shape)}.")
            target.copy_(t)
            loaded.add(target_name + ("" if part is None else str(part)))
    need = {n + p for n in params for p in (("0", "1", "2") if ".qkv." in n else ("",))}
    missing = sorted(m for m in need - loaded if not (m.startswith("token_type") and cfg.type_vocab_size < 2))
    if missing:
        raise ValueError(f"{path} lacks tensors the encoder needs: {missing[:5]}{' ...' if len(missing) > 5 else ''}.")
    return model.eval(), gf.meta

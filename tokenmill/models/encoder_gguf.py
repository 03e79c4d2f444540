"""BERT-family encoders from GGUF files (llama.cpp's `bert` architecture, as its converter writes
bge, e5, gte and all-MiniLM models, and `nomic-bert`: nomic-embed-text): config and pooling from the
metadata, weights dequantized to float (an encoder is small and runs float; the integer kernels
are a load option), the WordPiece tokenizer from the vocabulary.

llama.cpp's converter drops BERT's pooler, so a BERT cross-encoder cannot be run from its GGUF; a
head is loaded where the file has both of its layers (`cls`, `cls.output`: RoBERTa-style
rerankers). Other encoder architectures (nomic-bert-moe, jina-bert, ModernBERT) are refused by name.
"""
from __future__ import annotations

import re

import torch

from tokenmill.models.encoder import Encoder, EncoderConfig, fused_parts, part_rows
from tokenmill.models.pooling import PoolingConfig

# llama.cpp's pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank (a classifier head)
_POOLING = {1: ("mean",), 2: ("cls",), 3: ("last",)}
_TOP = {"token_embd.weight": "word.weight", "position_embd.weight": "position.weight",
        "token_types.weight": "token_type.weight", "token_embd_norm.weight": "embed_norm.weight",
        "token_embd_norm.bias": "embed_norm.bias", "cls.weight": "head_dense.weight", "cls.bias": "head_dense.bias",
        "cls.output.weight": "head_out.weight", "cls.output.bias": "head_out.bias"}
_LAYER = {"attn_output": "attn_out", "attn_output_norm": "attn_norm", "ffn_up": "up", "ffn_down": "down",
          "layer_output_norm": "out_norm", "attn_qkv": "qkv", "ffn_gate": "up"}
ARCHS = ("bert", "nomic-bert")
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def config(meta: dict, tensors: dict) -> EncoderConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not an encoder tokenmill runs (GGUF encoders: {list(ARCHS)}).")

    def need(key: str):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"the GGUF file lacks {arch}.{key}.")
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
    nomic = arch == "nomic-bert"
    if nomic and any(n.endswith(".bias") and "norm" not in n for n in tensors if n.startswith("blk.")):
        raise ValueError("this nomic-bert GGUF has biases in its projections; tokenmill runs Nomic BERT without.")
    return EncoderConfig("nomic" if nomic else "bert", vocab, hidden, int(need("block_count")),
                         int(need("attention.head_count")), int(need("feed_forward_length")),
                         int(need("context_length")), int(meta.get("tokenizer.ggml.token_type_count", 2)),
                         float(meta.get(f"{arch}.attention.layer_norm_epsilon", 1e-12)), "silu" if nomic else "gelu",
                         int(meta.get("tokenizer.ggml.padding_token_id", 0)), labels,
                         float(meta.get(f"{arch}.rope.freq_base", 1000.0)) if nomic else 0.0,
                         gated=nomic, bias=not nomic)


def pooling(meta: dict) -> PoolingConfig:
    """The file's pooling, normalized as llama.cpp's server normalizes embeddings by default."""
    kind = int(meta.get(f"{meta.get('general.architecture')}.pooling_type", 2))
    return PoolingConfig(_POOLING.get(kind, ("cls",)), normalize=True)


def _our_name(name: str, gated: bool) -> tuple[str, str] | None:
    """(our parameter, the part of a fused one it fills or "") for a llama.cpp tensor name; None for
    one we do not use."""
    if name in _TOP:
        return _TOP[name], ""
    m = _BLK.match(name)
    if m is None:
        return None
    layer, part, kind = m.groups()
    if part in ("attn_q", "attn_k", "attn_v"):
        return f"layers.{layer}.qkv.{kind}", str("qkv".index(part[-1]))
    if part in _LAYER:
        fill = {"ffn_gate": "g", "ffn_up": "u"}.get(part, "") if gated else ""
        return f"layers.{layer}.{_LAYER[part]}.{kind}", fill
    return None


def load(path: str) -> tuple[Encoder, dict]:
    """The encoder and the file's metadata (its tokenizer, its pooling)."""
    from tokenmill.models.gguf_loader import GGUFFile

    gf = GGUFFile(path)
    cfg = config(gf.meta, gf.tensors)
    model = Encoder(cfg)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for name, info in gf.tensors.items():
            ours = _our_name(name, cfg.gated)
            if ours is None:
                continue
            target_name, part = ours
            if target_name not in params:
                raise ValueError(f"{name} in {path} has no place in this {cfg.family} encoder.")
            target = part_rows(model, params[target_name].data, part)
            if int(info.n_elements) != target.numel():
                raise ValueError(f"{name} in {path} has {int(info.n_elements)} values; the metadata says "
                                 f"{tuple(target.shape)}.")
            target.copy_(torch.tensor(gf._dequantize(info)).reshape(target.shape))
            loaded.update(target_name + p for p in ((part,) if part else fused_parts(model, target_name)))
    need = {n + p for n in params for p in fused_parts(model, n)}
    missing = sorted(m for m in need - loaded if not (m.startswith("token_type") and cfg.type_vocab_size < 2))
    if missing:
        raise ValueError(f"{path} lacks tensors the encoder needs: {missing[:5]}{' ...' if len(missing) > 5 else ''}.")
    return model.eval(), gf.meta

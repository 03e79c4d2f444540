"""An encoder and what serving it needs — its pooling, its tokenizer, whether its embeddings may be
cut short — from a Hugging Face directory (sentence-transformers' modules) or a GGUF file."""
from __future__ import annotations

import os
from dataclasses import dataclass

from tokenmill.models import encoder_gguf
from tokenmill.models.encoder import Encoder, load_encoder
from tokenmill.models.pooling import PoolingConfig, declares_matryoshka
from tokenmill.models.tokenizer import Tokenizer


@dataclass
class LoadedEncoder:
    model: Encoder
    pooling: PoolingConfig
    tokenizer: Tokenizer | None
    matryoshka: bool  # the config declares Matryoshka dimensions: `dimensions` may cut embeddings


def load(path: str, load_tokenizer: bool = True) -> LoadedEncoder:
    if os.path.isfile(path):
        model, meta = encoder_gguf.load(path)
        return LoadedEncoder(model, encoder_gguf.pooling(meta), Tokenizer.from_gguf(meta) if load_tokenizer else None,
                             matryoshka=False)
    return LoadedEncoder(load_encoder(path), PoolingConfig.from_dir(path),
                         Tokenizer.from_hf_dir(path) if load_tokenizer else None, declares_matryoshka(path))

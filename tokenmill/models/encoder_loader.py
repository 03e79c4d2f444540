"""An encoder and what serving it needs — its pooling, its tokenizer, whether its embeddings may be
cut short — from a Hugging Face directory (sentence-transformers' modules) or a GGUF file, in the
dtype and with the integer kernels asked for (the decoders' options: `dtype`, `quantization`
int8 / int4 round-to-nearest at load, `activation_bits`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tokenmill.layers.linear import Linear
from tokenmill.models import encoder_gguf
from tokenmill.models.encoder import Encoder, load_encoder
from tokenmill.models.loader import resolve_dtype
from tokenmill.models.pooling import PoolingConfig, declares_matryoshka
from tokenmill.models.tokenizer import Tokenizer


@dataclass
class LoadedEncoder:
    model: Encoder
    pooling: PoolingConfig
    tokenizer: Tokenizer | None
    matryoshka: bool  # the config declares Matryoshka dimensions: `dimensions` may cut embeddings
    activation_bits: int | None  # what the int kernels round inputs to; None: float products


def load(path: str, load_tokenizer: bool = True, dtype: str = "auto", quantization: str = "auto",
         group_size: int = 32, activation_bits: int | str = "auto",
         device: torch.device = torch.device("cpu")) -> LoadedEncoder:
    if quantization in ("awq", "gptq"):
        raise ValueError(f"quantization={quantization!r} needs a {quantization.upper()} checkpoint; encoders load "
                         "from float weights (int8 / int4 round them at load).")
    if os.path.isfile(path):
        model, meta = encoder_gguf.load(path)
        pooling, matryoshka = encoder_gguf.pooling(meta), False
        tokenizer = Tokenizer.from_gguf(meta) if load_tokenizer else None
    else:
        model, pooling, matryoshka = load_encoder(path), PoolingConfig.from_dir(path), declares_matryoshka(path)
        tokenizer = Tokenizer.from_hf_dir(path) if load_tokenizer else None
    model = model.to(device=device, dtype=resolve_dtype(dtype, torch.float32, device))
    bits = None
    if quantization in ("int8", "int4") and device.type == "cpu":
        from tokenmill import kernels

        bits = kernels.auto_activation_bits() if activation_bits == "auto" and kernels.available() else \
            (16 if activation_bits == "auto" else int(activation_bits))
        for m in model.modules():
            if isinstance(m, Linear) and m is not model.head_out:  # the head's few outputs stay float
                m.quantize(quantization, group_size, activation_bits=bits)
    return LoadedEncoder(model, pooling, tokenizer, matryoshka, bits)

"""What each tokenmill configuration of embed.sh costs in accuracy: the cosine similarity of its
embeddings (the GGUF file, offline `LLM.embed`) to sentence-transformers' float32 ones (the same
weights' directory), over the benchmark's texts. One JSON line per configuration.

    python embed_accuracy.py GGUF HF_DIR "float32|" "int8|--quantization int8 --activation-bits 8" ...
"""
from __future__ import annotations

import json
import sys

import torch

import embed_client


def options(flags: str) -> dict:
    """`--quantization int8 --activation-bits 8` -> {"quantization": "int8", "activation_bits": 8}."""
    words = flags.split()
    return {k.lstrip("-").replace("-", "_"): int(v) if v.isdigit() else v for k, v in zip(words[::2], words[1::2])}


def main() -> None:
    from sentence_transformers import SentenceTransformer

    from tokenmill import LLM

    gguf, hf, *configs = sys.argv[1:]
    texts = embed_client.texts(32, 30) + embed_client.texts(8, 510, seed=1)
    want = torch.tensor(SentenceTransformer(hf, device="cpu").encode(texts))
    for cfg in configs:
        name, _, flags = cfg.partition("|")
        llm = LLM(gguf, **options(flags))
        got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        cos = torch.nn.functional.cosine_similarity(got, want)
        print(json.dumps({"peer": f"tokenmill {name}", "cosine_min": cos.min().item(), "cosine_mean": cos.mean().item()}))
        del llm


if __name__ == "__main__":
    main()

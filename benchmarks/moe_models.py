"""The MoE benchmark's two models, random weights at a realistic shape (no MoE small enough to run
here is on PyPI): a Qwen3-MoE whose experts have Qwen3-30B-A3B's expert shape (hidden 2048, expert
width 768, 8 experts per token) with 32 experts and 4 layers, and its dense equivalent (a Qwen3 with
the same attention and an MLP as wide as the 8 active experts together: the same active parameters).
Both are written as Hugging Face directories and as one Q4_0 GGUF each (embedding and output Q8_0,
the default model's tokenizer), which llama.cpp and tokenmill then both load.

    python benchmarks/moe_models.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from hf_to_gguf import hf_to_gguf  # noqa: E402

SHAPE = dict(vocab_size=49152, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True,
             initializer_range=0.02, rms_norm_eps=1e-6)
EXPERTS, ACTIVE, EXPERT_WIDTH = 32, 8, 768


def build(out: str) -> dict:
    import transformers as t

    from tokenmill.utils import default_model_path

    made = {}
    for name, cfg, cls in (
        ("moe", t.Qwen3MoeConfig(**SHAPE, num_experts=EXPERTS, num_experts_per_tok=ACTIVE,
                                 moe_intermediate_size=EXPERT_WIDTH, intermediate_size=EXPERT_WIDTH * ACTIVE,
                                 norm_topk_prob=True), t.Qwen3MoeForCausalLM),
        ("dense", t.Qwen3Config(**SHAPE, intermediate_size=EXPERT_WIDTH * ACTIVE), t.Qwen3ForCausalLM),
    ):
        hf, gg = os.path.join(out, name), os.path.join(out, f"{name}-q4_0.gguf")
        if not os.path.exists(gg):
            torch.manual_seed(0)
            model = cls(cfg).float().eval()
            total = sum(p.numel() for p in model.parameters())
            model.save_pretrained(hf, safe_serialization=True)
            del model
            hf_to_gguf(hf, gg, "Q4_0", "Q8_0", tokenizer_from=default_model_path())
            with open(os.path.join(out, f"{name}.json"), "w") as f:
                json.dump({"parameters": total}, f)
        with open(os.path.join(out, f"{name}.json")) as f:
            made[name] = {"gguf": gg, **json.load(f)}
    h, layers = SHAPE["hidden_size"], SHAPE["num_hidden_layers"]
    mlp_active = 3 * h * EXPERT_WIDTH * ACTIVE * layers  # the same for both models
    for m in made.values():
        m["active_mlp_parameters"] = mlp_active
    made["moe"]["expert_parameters"] = 3 * h * EXPERT_WIDTH * EXPERTS * layers
    return made


if __name__ == "__main__":
    print(json.dumps(build(sys.argv[1])))

"""Write N random LoRA adapters for a Llama-family GGUF model, each twice: a PEFT directory (what
tokenmill serves) and llama.cpp's LoRA GGUF (what llama-server serves), the same values in both.
Speed does not depend on the values, only on the rank and which projections the adapters target.

    python benchmarks/make_lora.py MODEL.gguf OUT_DIR [--n 8] [--rank 16] [--targets q,k,v,o,gate,up,down]

Writes OUT_DIR/a<i>/ (adapter_config.json + adapter_model.safetensors) and OUT_DIR/a<i>.gguf (Q/K rows
of B in llama.cpp's rotary order for Llama-family models, as its converter writes them).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

PROJ = {"q": ("self_attn.q_proj", "attn_q"), "k": ("self_attn.k_proj", "attn_k"), "v": ("self_attn.v_proj", "attn_v"),
        "o": ("self_attn.o_proj", "attn_output"), "gate": ("mlp.gate_proj", "ffn_gate"),
        "up": ("mlp.up_proj", "ffn_up"), "down": ("mlp.down_proj", "ffn_down")}


def shapes(model: str) -> tuple[str, int, dict[str, tuple[int, int]], dict[str, int]]:
    """(architecture, layers, {projection: (in, out)}, {q/k: heads}) from the model's header."""
    import gguf

    r = gguf.GGUFReader(model)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    heads = {"q": int(r.fields[f"{arch}.attention.head_count"].parts[-1][0]),
             "k": int(r.fields[f"{arch}.attention.head_count_kv"].parts[-1][0])}
    dims = {}
    layers = 0
    for t in r.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[-1] == "weight":
            layers = max(layers, int(parts[1]) + 1)
            for key, (_, gname) in PROJ.items():
                if parts[2] == gname:
                    dims[key] = (int(t.shape[0]), int(t.shape[1]))  # ne: (in, out)
    return arch, layers, dims, heads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down")
    args = p.parse_args()
    import gguf
    import torch
    from safetensors.numpy import save_file

    from tokenmill.models.gguf_loader import permute_rows

    arch, layers, dims, heads = shapes(args.model)
    targets = args.targets.split(",")
    os.makedirs(args.out, exist_ok=True)
    for i in range(args.n):
        rng = np.random.default_rng(i)
        peft, w = {}, gguf.GGUFWriter(os.path.join(args.out, f"a{i}.gguf"), arch)
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(args.rank))
        for layer in range(layers):
            for key in targets:
                k_in, n_out = dims[key]
                a = (rng.standard_normal((args.rank, k_in)) / np.sqrt(k_in)).astype(np.float32)
                b = (rng.standard_normal((n_out, args.rank)) * 0.01).astype(np.float32)
                hf, gname = PROJ[key]
                peft[f"base_model.model.model.layers.{layer}.{hf}.lora_A.weight"] = a
                peft[f"base_model.model.model.layers.{layer}.{hf}.lora_B.weight"] = b
                if key in heads and arch in ("llama", "mistral"):  # llama.cpp's rotary order of Q/K rows
                    b = permute_rows(torch.from_numpy(b), heads[key]).numpy()
                w.add_tensor(f"blk.{layer}.{gname}.weight.lora_a", a)
                w.add_tensor(f"blk.{layer}.{gname}.weight.lora_b", np.ascontiguousarray(b))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        d = os.path.join(args.out, f"a{i}")
        os.makedirs(d, exist_ok=True)
        save_file(peft, os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": args.rank, "lora_alpha": args.rank, "bias": "none",
                       "target_modules": [PROJ[k][0].split(".")[1] for k in targets]}, f)


if __name__ == "__main__":
    main()

"""Write a Hugging Face model directory as a GGUF file the way llama.cpp's converter lays it out
(tensor names, Q/K row permutation for Llama, Gemma's +1 folded into the norms, Phi-3's fused
tensors and LongRoPE factor tensors, stacked expert tensors, the metadata keys), with the `gguf`
package: the twin of tokenmill/models/gguf_loader.py that the tests check it against, and the way
the MoE benchmark gives llama.cpp and tokenmill the same file. No tokenizer of its own: with
`--tokenizer-from`, another GGUF's tokenizer.* metadata is copied in (llama.cpp needs one).

    python scripts/hf_to_gguf.py HF_DIR OUT.gguf [--type Q4_0] [--embed-type Q8_0] [--tokenizer-from M.gguf]
"""
from __future__ import annotations

import glob
import json
import os

import numpy as np
import torch

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
        "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3", "Qwen3MoeForCausalLM": "qwen3moe",
        "Qwen2MoeForCausalLM": "qwen2moe", "MixtralForCausalLM": "llama", "OlmoeForCausalLM": "olmoe"}
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
          "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
SANDWICH = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's `permute`: rotate-half rows to interleaved pairs, per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf(hf_dir: str, out: str, qtype: str = "F32", embed_qtype: str = "F32",
               tokenizer_from: str | None = None) -> str:
    """`qtype`: the layers' block type; `embed_qtype`: the embedding's and output's (llama.cpp keeps
    them at a higher precision than the layers)."""
    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = ARCH[cfg["architectures"][0]]
    sandwich = arch in ("gemma2", "gemma3")
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    local = rope.get("sliding_attention")
    rope = rope.get("full_attention", rope)
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        if rope.get("original_max_position_embeddings"):
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if kind == "longrope":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if local:
        w.add_rope_freq_base_swa(local["rope_theta"])
    if cfg.get("sliding_window") and (arch != "qwen2" or cfg.get("use_sliding_window")):
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("layer_types"):
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if cfg.get("query_pre_attn_scalar") and sandwich:
        w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
    for key, add in (("attn_logit_softcapping", w.add_attn_logit_softcapping),
                     ("final_logit_softcapping", w.add_final_logit_softcapping)):
        if cfg.get(key):
            add(cfg[key])
    if cfg.get("clip_qkv"):
        w.add_clamp_kqv(cfg["clip_qkv"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", arch == "llama")))
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    tensors = {}
    for file in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        tensors.update({k.replace("block_sparse_moe", "mlp"): v for k, v in load_file(file).items()})
    stacked: dict[str, dict[int, torch.Tensor]] = {}  # per-expert tensors -> one 3-D tensor per layer
    for name in [n for n in tensors if ".experts." in n]:
        parts = name.split(".")  # model.layers.L.mlp.experts.E.proj.weight
        stacked.setdefault(f"blk.{parts[2]}.{EXPERT[parts[6]]}.weight", {})[int(parts[5])] = tensors.pop(name)
    if cfg.get("tie_word_embeddings", arch.startswith("gemma")):
        tensors.pop("lm_head.weight", None)
    items = list(tensors.items()) + [(g, torch.stack([d[e] for e in sorted(d)])) for g, d in stacked.items()]
    for name, t in items:
        t = t.float()
        if name in TOP or name.startswith("blk."):
            gname = TOP.get(name, name)
        else:
            parts = name.split(".")
            layer, module, kind_ = parts[2], ".".join(parts[3:-1]), parts[-1]
            table = {**LAYER, **(SANDWICH if sandwich else {"post_attention_layernorm": "ffn_norm"})}
            gname = f"blk.{layer}.{table[module]}.{kind_}"
            if module == "mlp.shared_expert_gate":
                t = t.reshape(-1)  # llama.cpp stores the (1, hidden) gate as a vector
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                t = _permute(t, heads if module == "self_attn.q_proj" else kv)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's (1 + w)
        data = t.numpy().astype(np.float32)
        want = embed_qtype if name in TOP else qtype
        if data.ndim >= 2 and want != "F32" and data.shape[-1] % 32 == 0 and "ffn_gate_inp" not in gname:
            qt = getattr(gguf.GGMLQuantizationType, want)
            w.add_tensor(gname, gguf.quants.quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, data)
    if kind == "longrope":
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    if tokenizer_from:
        _copy_tokenizer(w, tokenizer_from)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _copy_tokenizer(w, path: str) -> None:
    """Every tokenizer.* field of another GGUF file, as it is there."""
    import gguf

    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), kind)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    ap.add_argument("--type", default="F32", help="block type of the layers' weights (F32, Q8_0, Q4_0, ...)")
    ap.add_argument("--embed-type", default="F32", help="block type of the embedding and output")
    ap.add_argument("--tokenizer-from", help="a GGUF whose tokenizer.* metadata to copy")
    a = ap.parse_args()
    print(hf_to_gguf(a.hf_dir, a.out, a.type, a.embed_type, a.tokenizer_from))

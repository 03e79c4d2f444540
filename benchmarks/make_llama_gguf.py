"""Write a Llama-3.x-shaped GGUF file with random weights, tensor by tensor (never the whole model
in memory): what the real-size benchmark measures loading, memory and speed on. Speed and memory do
not depend on the weights' values, only on the shapes and block types (llama.cpp's `llama-quantize`
turns this float file into Q4_K_M, Q6_K, ...).

The tokenizer is the default model's byte-level BPE, its vocabulary padded with unused tokens to
Llama 3's 128,256 so that the embedding and the output head have Llama 3's size.

    python benchmarks/make_llama_gguf.py --size 1b OUT.gguf [--type F16]
"""
from __future__ import annotations

import argparse

import numpy as np

# Llama 3.2 1B / 3B (tied embeddings) and Llama 3.1 8B (separate output head)
SHAPES = {
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ff=8192, tied=True),
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ff=8192, tied=True),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ff=14336, tied=False),
}
VOCAB = 128256
UNUSED = 5  # llama.cpp's token type for padding entries


def tokenizer_fields(source: str) -> dict:
    import gguf

    r = gguf.GGUFReader(source)
    get = lambda k: r.fields[k].contents()  # noqa: E731
    tokens, types = list(get("tokenizer.ggml.tokens")), list(get("tokenizer.ggml.token_type"))
    pad = VOCAB - len(tokens)
    return {"tokens": tokens + [f"<|unused_{i}|>" for i in range(pad)], "types": types + [UNUSED] * pad,
            "merges": list(get("tokenizer.ggml.merges")), "pre": get("tokenizer.ggml.pre"),
            "bos": get("tokenizer.ggml.bos_token_id"), "eos": get("tokenizer.ggml.eos_token_id"),
            "template": get("tokenizer.chat_template")}


def tensors(s: dict) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(name, numpy shape (rows, cols)) in llama.cpp's order."""
    h, hd = s["hidden"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * hd
    out = [("token_embd.weight", (VOCAB, h))]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (h, h)), (b + "attn_k.weight", (kv, h)),
                (b + "attn_v.weight", (kv, h)), (b + "attn_output.weight", (h, h)), (b + "ffn_norm.weight", (h,)),
                (b + "ffn_gate.weight", (s["ff"], h)), (b + "ffn_up.weight", (s["ff"], h)),
                (b + "ffn_down.weight", (h, s["ff"]))]
    out.append(("output_norm.weight", (h,)))
    if not s["tied"]:
        out.append(("output.weight", (VOCAB, h)))
    return out


def write(size: str, out: str, tokenizer_from: str, dtype: str = "F16", seed: int = 0) -> None:
    import gguf

    s = SHAPES[size]
    tok = tokenizer_fields(tokenizer_from)
    w = gguf.GGUFWriter(out, "llama")
    w.add_name(f"random Llama-3 {size}")
    w.add_context_length(131072)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_file_type(1 if dtype == "F16" else 0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["bos"])
    w.add_eos_token_id(tok["eos"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok["template"])
    np_dtype = np.float16 if dtype == "F16" else np.float32
    layout = tensors(s)
    for name, shape in layout:
        t = np_dtype if len(shape) == 2 else np.float32  # norms stay float32, as llama.cpp writes them
        w.add_tensor_info(name, shape, np.dtype(t), int(np.prod(shape)) * np.dtype(t).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in layout:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, np.float32))
            continue
        # row chunks: an 8B embedding is 1 GB in float16
        data = np.empty(shape, np_dtype)
        for r in range(0, shape[0], 8192):
            data[r:r + 8192] = rng.standard_normal((min(8192, shape[0] - r), shape[1]), np.float32) * 0.02
        w.write_tensor_data(data)
    w.close()


def main() -> None:
    from tokenmill.utils import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--size", choices=sorted(SHAPES), required=True)
    ap.add_argument("--type", choices=["F16", "F32"], default="F16")
    ap.add_argument("--tokenizer-from", default=None, help="a GGUF whose tokenizer to use (default: the default model)")
    args = ap.parse_args()
    write(args.size, args.out, args.tokenizer_from or default_model_path(), args.type)


if __name__ == "__main__":
    main()

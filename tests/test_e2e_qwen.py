"""The second real model, Qwen2.5-Coder-0.5B-Instruct (Qwen2: QKV bias; GGUF with Q5_0, Q8_0, Q4_K
and Q6_K tensors), assembled from its six PyPI parts by scripts/assemble_qwen.py."""
import os
import subprocess
import sys

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "models", "qwen2.5-coder-0.5b-instruct.gguf")


@pytest.fixture(scope="module")
def qwen() -> LLM:
    if not os.path.exists(PATH):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "assemble_qwen.py"), "--out", PATH],
                       check=True, timeout=1200)
    return LLM(PATH, kv_cache_memory="256MiB", max_model_len=2048)


def test_qwen_loads_and_writes_code(qwen):
    assert qwen.engine.arch.family == "qwen2" and qwen.engine.arch.qkv_bias
    out = qwen.chat([{"role": "user", "content": "Write a Python function that returns the sum of two numbers."}],
                    SamplingParams(temperature=0, max_tokens=60))[0].outputs[0]
    assert "def " in out.text and "return" in out.text


def test_qwen_answers_a_fact(qwen):
    out = qwen.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                    SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"

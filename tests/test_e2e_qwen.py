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


def test_qwen_calls_a_tool_in_its_own_format_through_the_server(qwen):
    """tool_choice auto: Qwen writes `<tool_call>` blocks (its template's hermes format), which the
    server returns as OpenAI tool_calls, streamed or not."""
    import json

    import openai
    from test_server import WEATHER_TOOL, _reassemble, start_server

    proc, base = start_server("--model", PATH, "--max-model-len", "2048")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
        kw = dict(model="smollm2", messages=[{"role": "user", "content": "What's the weather in Paris, in celsius?"}],
                  tools=[WEATHER_TOOL], temperature=0, max_tokens=80)
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls", c.message.content
        call = c.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
        streamed, finish = _reassemble(client.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls" and [(s["name"], json.loads(s["arguments"])) for s in streamed] == \
            [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    finally:
        proc.terminate()
        proc.wait(timeout=60)

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


@pytest.fixture(scope="module")
def qwen_server(qwen):
    """`tokenmill serve` on the same file (assembled by the `qwen` fixture), for client libraries."""
    from test_server import start_server

    proc, base = start_server("--model", PATH, "--max-model-len", "2048")
    yield base
    proc.terminate()
    proc.wait(timeout=60)


def test_qwen_calls_a_tool_in_its_own_format_through_the_server(qwen_server):
    """tool_choice auto: Qwen writes `<tool_call>` blocks (its template's hermes format), which the
    server returns as OpenAI tool_calls, streamed or not."""
    import json

    import openai
    from test_server import WEATHER_TOOL, _reassemble

    client = openai.OpenAI(base_url=qwen_server + "/v1", api_key="none", max_retries=0, timeout=300)
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "What's the weather in Paris, in celsius?"}],
              tools=[WEATHER_TOOL], temperature=0, max_tokens=80)
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    streamed, finish = _reassemble(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and [(s["name"], json.loads(s["arguments"])) for s in streamed] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]


def test_instructor_tools_partial_streaming_and_json_schema_modes(qwen_server):
    """instructor as its docs show it: a pydantic model extracted through a forced tool call
    (Mode.TOOLS), the same streamed as partial objects (create_partial, which reads each chunk's
    tool_calls[0]), and through response_format (Mode.JSON_SCHEMA); a schema without
    additionalProperties (pydantic's) closes."""
    import instructor
    import openai
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=40)
        age: int = Field(ge=0, le=150)

    messages = [{"role": "user", "content": "Extract the person: Ada Lovelace died at the age of 36."}]
    kw = dict(model="smollm2", response_model=Person, messages=messages, temperature=0, max_tokens=80,
              max_retries=0)
    tools = instructor.from_openai(openai.OpenAI(base_url=qwen_server + "/v1", api_key="none", timeout=300))
    person = tools.chat.completions.create(**kw)
    assert isinstance(person, Person) and "Ada" in person.name and person.age == 36
    partials = list(tools.chat.completions.create_partial(**kw))
    assert len(partials) > 2 and partials[-1].model_dump() == person.model_dump()
    schema = instructor.from_openai(openai.OpenAI(base_url=qwen_server + "/v1", api_key="none", timeout=300),
                                    mode=instructor.Mode.JSON_SCHEMA)
    by_schema = schema.chat.completions.create(**kw)
    assert isinstance(by_schema, Person) and "Ada" in by_schema.name

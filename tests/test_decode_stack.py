"""The native decode stack (kernels/stack.cpp) against the Python layers it replaces: same tokens,
same logprobs, bit for bit, for every architecture, weight format and KV cache dtype."""
import pytest
import torch

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.models import decode_stack

PROMPTS = [[5, 17, 99, 3, 42], list(range(40, 77)), [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


class CountingStack:
    """Passes calls through to the native stack and counts them: proves the steps used it."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def forward(self, *args):
        self.calls += 1
        return self.inner.forward(*args)


def generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=7, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


@pytest.mark.parametrize("quantization,kv", [("none", "float32"), ("int8", "auto"), ("int4", "auto"),
                                             ("int4", "float32"), ("int4", "int8"), ("none", "fp8_e5m2")])
def test_stack_equals_the_python_layers(tiny_model, quantization, kv):
    if not kernels.available():
        pytest.fail("tokenmill's CPU kernels did not build (see the warning above)")
    llm = LLM(tiny_model, quantization=quantization, quantization_group_size=32, kv_cache_dtype=kv,
              kv_cache_memory="16MiB", enable_prefix_caching=False, skip_tokenizer_init=True)
    model = llm.engine.runner.model
    assert model.decode_stack is not None
    counting = model.decode_stack = CountingStack(model.decode_stack)
    native = generate(llm)
    assert counting.calls >= 11  # every step after the prompts' is all-decode
    model.decode_stack = None
    assert generate(llm) == native


def test_stack_is_declined_where_it_cannot_run(tiny_llama, monkeypatch):
    monkeypatch.setenv("TOKENMILL_DECODE_STACK", "0")
    llm = LLM(tiny_llama, kv_cache_memory="16MiB", skip_tokenizer_init=True)
    assert llm.engine.runner.model.decode_stack is None
    monkeypatch.delenv("TOKENMILL_DECODE_STACK")
    llm = LLM(tiny_llama, dtype="bfloat16", kv_cache_memory="16MiB", skip_tokenizer_init=True)
    assert llm.engine.runner.model.decode_stack is None
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp)[0].outputs[0].token_ids) == 4


def test_stack_checks_what_it_is_given():
    if not kernels.available():
        pytest.fail("tokenmill's CPU kernels did not build (see the warning above)")
    stack = torch.classes.tokenmill.DecodeStack(4, 2, 16, 96, 1e-6, 0, 0.25)
    cache = torch.zeros(4, 16, 2, 16)
    with pytest.raises(RuntimeError, match="add_layer first"):
        stack.add_projection(0, torch.zeros(128, 64), None, None, None, None, None, 128, 16, 0, 0, None)
    with pytest.raises(RuntimeError, match="caches must be"):
        stack.add_layer(torch.ones(64), torch.ones(64), cache.to(torch.int32), cache, 0, 0, None, None, None, None)
    with pytest.raises(RuntimeError, match="q and k norms come together"):
        stack.add_layer(torch.ones(64), torch.ones(64), cache, cache.clone(), 0, 0, torch.ones(16), None, None, None)
    stack.add_layer(torch.ones(64), torch.ones(64), cache, cache.clone(), 0, 0, None, None, None, None)
    stack.add_projection(0, torch.zeros(128, 64), None, None, None, None, None, 128, 16, 0, 0, None)
    with pytest.raises(RuntimeError, match="expected 64"):
        stack.add_projection(0, torch.zeros(32, 64), None, None, None, None, None, 32, 16, 0, 0, None)
    with pytest.raises(RuntimeError, match="incomplete"):
        stack.forward(torch.zeros(1, 64), torch.zeros(1, 8), torch.zeros(1, 8), torch.zeros(1, dtype=torch.long),
                      torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), None, None, None)
    with pytest.raises(RuntimeError, match="no projection 4"):
        stack.set_lora(0, 4, torch.zeros(1, 64, 16), torch.zeros(1, 16, 64), torch.zeros(1, 1, dtype=torch.long), [0, 64])
    assert decode_stack.enabled()


def test_the_readme_question_is_answered_under_the_defaults():
    """The README's quick start, question unchanged, on this kernel variant (test_kernel_build runs
    this file on every variant the CPU has): the default model, default settings, greedy."""
    llm = LLM(kv_cache_memory="16MiB")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.outputs[0].text, (kernels.isa(), out.outputs[0].text)

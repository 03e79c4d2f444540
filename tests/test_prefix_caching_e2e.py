"""Prefix caching on the real default model: same outputs as without it (greedy, float32), also
under eviction and preemption; multi-turn chats reuse their earlier turns."""
import json
import os

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MT_BENCH = os.path.join(ROOT, "..", "shared", "data", "mt_bench", "question.jsonl")
SYSTEM = ("You are a meticulous assistant. Answer precisely, cite the relevant facts, and keep answers short. "
          "Never invent sources. Prefer plain words over jargon. ") * 6


def run(llm: LLM, prompts, params):
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    results, cached = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
                cached[out.request_id] = out.metrics.num_cached_tokens
        engine.block_manager.check_integrity(list(engine.scheduler.requests.values()))
    return [results[f"q{i}"] for i in range(len(prompts))], [cached[f"q{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def small_cache_llms(default_model):
    # 28 blocks of 16 tokens (368,640 bytes each in float16): 12 requests of ~200 tokens (a shared ~160-token prefix) cannot all
    # fit even when sharing it, so cached blocks get evicted and running requests preempted
    kw = dict(dtype="float32", quantization="none", kv_cache_memory=28 * 368640, max_num_batched_tokens=256)
    return LLM(default_model, **kw), LLM(default_model, enable_prefix_caching=False, **kw)


def test_outputs_equal_with_and_without_caching_under_eviction_and_preemption(small_cache_llms):
    on, off = small_cache_llms
    tok = on.get_tokenizer()
    questions = ["What is 2+2?", "Name a prime.", "Define entropy.", "Who wrote Hamlet?", "What is DNA?",
                 "Why is the sky blue?", "What is a list?", "Capital of Peru?", "Speed of light?", "What is rust?",
                 "Define a monad.", "What is HTTP?"]
    prompts = [tok.encode(SYSTEM + q) for q in questions]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected, _ = run(off, prompts, params)
    got, cached = run(on, prompts, params)
    assert got == expected
    assert on.engine.scheduler.num_preemptions > 0
    assert sum(cached) > 0
    # a second wave after the first finished and some of its blocks were evicted
    got2, cached2 = run(on, prompts[::-1], params)
    assert got2 == expected[::-1] and sum(cached2) > 0


def test_multi_turn_chat_reuses_earlier_turns(llm):
    conv = [{"role": "user", "content": "Give me three tips for writing clear code."}]
    first = llm.chat(conv, SamplingParams(temperature=0, max_tokens=48))[0]
    turn1_prompt_len = len(first.prompt_token_ids)
    conv += [{"role": "assistant", "content": first.outputs[0].text},
             {"role": "user", "content": "Now make the second tip shorter."}]
    second = llm.chat(conv, SamplingParams(temperature=0, max_tokens=16))[0]
    assert second.metrics.num_cached_tokens >= turn1_prompt_len


def test_mt_bench_second_turns_hit_the_cache(llm):
    if not os.path.exists(MT_BENCH):
        pytest.skip("../shared/data/mt_bench/question.jsonl is not beside this checkout")
    with open(MT_BENCH) as f:
        questions = [json.loads(line) for line in f][:8]
    params = SamplingParams(temperature=0, max_tokens=48)
    convs = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
    firsts = llm.chat(convs, params)
    seconds = llm.chat([c + [{"role": "assistant", "content": o.outputs[0].text},
                             {"role": "user", "content": q["turns"][1]}]
                        for c, o, q in zip(convs, firsts, questions)], params)
    for f, s in zip(firsts, seconds):
        assert s.metrics.num_cached_tokens >= len(f.prompt_token_ids)

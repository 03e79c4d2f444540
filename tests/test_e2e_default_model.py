"""End to end on the real default model (SmolLM2-135M-Instruct, float32 path)."""
import torch
import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The three primary colors are",
    "대한민국의 수도는",
    "안녕하세요. 오늘은 날씨가",
    "def quicksort(arr):\n",
    "import numpy as np\n\n# compute the mean of a list\ndef mean(xs):",
]


def test_greedy_matches_transformers_token_for_token(llm, hf_default_model):
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf_default_model.generate(ids, do_sample=False, max_new_tokens=32, min_new_tokens=32,
                                            pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref, prompt
        assert out.outputs[0].finish_reason == "length"


def test_batch_invariance_16_mixed_prompts(llm):
    tok = llm.get_tokenizer()
    base = PROMPTS + [p * k for k, p in zip(range(2, 10), PROMPTS)]
    prompts = [tok.encode(p)[: 8 + 37 * i % 300] for i, p in enumerate(base)]
    assert len(prompts) == 16 and len({len(p) for p in prompts}) > 8
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone


def test_overflowing_kv_cache_preempts_and_still_answers_correctly(default_model):
    # 40 blocks of 16 tokens (368,640 bytes each in float16); 12 requests of ~120 prompt + 48
    # output tokens need ~130 blocks at once
    llm = LLM(default_model, dtype="float32", quantization="none", kv_cache_memory=40 * 368640,
              max_num_batched_tokens=256)
    engine = llm.engine
    assert engine.block_manager.num_blocks == 40
    tok = llm.get_tokenizer()
    text = " ".join(PROMPTS)
    prompts = [tok.encode(f"{i}: {text}")[: 100 + 3 * i] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    roomy = LLM(default_model, dtype="float32", quantization="none")  # the same batch with no preemption
    expected = [o.outputs[0] for o in roomy.generate(prompts, params, use_tqdm=False)]
    del roomy

    for i, p in enumerate(prompts):
        engine.add_request(f"big-{i}", p, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0]
        engine.block_manager.check_integrity(list(engine.scheduler.requests.values()))
    assert engine.scheduler.num_preemptions > 0
    for i in range(12):
        assert_greedy_close(results[f"big-{i}"], expected[i])
    assert engine.block_manager.num_free_blocks == 40


def assert_greedy_close(got, want, gap: float = 5e-3) -> None:
    """Greedy outputs of the same prompt computed two ways (recomputed after preemption, in another
    batch: other float summation orders, ~1e-4 apart in logprob) agree token for token, except that
    they may part at a near tie: where they first differ, each one's token is the other's runner-up
    within `gap`. (vLLM's check_logprobs_close is the same idea.)"""
    for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if a == b:
            continue
        for mine, theirs, lps in ((a, b, want.logprobs[j]), (b, a, got.logprobs[j])):
            assert mine in lps, f"token {j}: {mine} is not in the other run's top 2 {lps}"
            assert lps[theirs].logprob - lps[mine].logprob < gap, f"token {j}: not a near tie {lps}"
        return
    assert len(got.token_ids) == len(want.token_ids)


def test_n_seed_stop_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=12, logprobs=3)
    a = llm.generate(["Once upon a time"], params)[0]
    b = llm.generate(["Once upon a time"], params)[0]
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    for o in a.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for tid, pos in zip(o.token_ids, o.logprobs):
            assert tid in pos and len(pos) >= 3 and pos[tid].logprob <= 0
    greedy = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20))[0]
    text = greedy.outputs[0].text
    cut = text.strip()[:4]
    stopped = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20, stop=[cut]))[0]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == cut
    assert cut not in stopped.outputs[0].text and text.startswith(stopped.outputs[0].text)


def test_chat_answers_sensibly(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"


def test_token_ids_have_one_copy_and_outputs_are_snapshots(llm):
    """The runner reads the scheduler's token list itself (it keeps no copy), and the outputs a
    caller keeps do not change as later steps run."""
    engine = llm.engine
    engine.add_request("one-copy", "Once upon a time", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        req = engine.scheduler.requests.get("one-copy")
        if req is not None:
            assert engine.executor.runner.states["one-copy"].token_ids is req.token_ids
    assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 9))
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == outs[-1].outputs[0].token_ids


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    engine.add_request("to-abort", "Tell me a long story about dragons.",
                       SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < free
    final = engine.abort_request("to-abort")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == free and not engine.has_unfinished_requests()


def test_constrained_outputs_of_the_real_model_validate(llm):
    """Dozens of schemas drawn as in tests/test_structured.py, on the default model at temperature
    1, plus regexes and choices: every output parses and validates / matches."""
    import json
    import re

    import jsonschema
    from hypothesis import HealthCheck, Phase, given, settings

    from hypothesis_jsonschema import from_schema
    from test_structured import META_SCHEMA, _fix_required

    schemas = []

    # the same 32 schemas every run: a failure reproduces
    @settings(max_examples=32, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck),
              deadline=None, derandomize=True)
    @given(from_schema(META_SCHEMA).map(_fix_required))
    def draw(schema):
        schemas.append(schema)
    draw()
    prompts = [llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Answer with a JSON value for this schema: " + json.dumps(s)}])
        for s in schemas]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs={
        "json": s, "whitespace_pattern": r"[ \n]{0,4}"}) for i, s in enumerate(schemas)]
    for schema, out in zip(schemas, llm.generate(prompts, params, use_tqdm=False)):
        assert out.outputs[0].finish_reason == "stop", (schema, out.outputs[0].text)
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    patterns = [r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}", r"\d{4}-\d{2}-\d{2}", r"(yes|no|maybe)", r"#[0-9a-f]{6}"]
    outs = llm.generate(["Write something: "] * 16, [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                                                                    structured_outputs={"regex": patterns[i % 4]})
                                                     for i in range(16)], use_tqdm=False)
    for i, out in enumerate(outs):
        assert re.fullmatch(patterns[i % 4], out.outputs[0].text), out.outputs[0].text


def test_a_schema_as_clients_send_it_closes_at_temperature_1(llm):
    """The schema a client sends for a small pydantic model (no additionalProperties, no
    whitespace settings), the default model at temperature 1 with 120 tokens: objects closed and
    whitespace bounded by default, the answer ends valid in at least 29 of 30 seeds."""
    import json

    import jsonschema

    schema = {"type": "object", "title": "City",
              "properties": {"name": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
                             "population": {"type": "integer"}, "coastal": {"type": "boolean"}},
              "required": ["name", "country", "population", "coastal"]}
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Describe a city as JSON with its name, country, population and whether it is "
                                     "coastal."}])
    outs = llm.generate([prompt] * 30, [SamplingParams(temperature=1.0, seed=i, max_tokens=120,
                                                       structured_outputs={"json": schema}) for i in range(30)],
                        use_tqdm=False)
    valid = 0
    for out in outs:
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
            valid += out.outputs[0].finish_reason == "stop"
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid >= 29, [o.outputs[0].text for o in outs]

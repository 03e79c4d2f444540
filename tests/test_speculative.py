"""Speculative decoding: exact outputs (greedy and seeded equal to no speculation, token for
token), the sampled distribution unchanged, and the bookkeeping around drafts (budget, lookahead
blocks, prefix cache, preemption, stop conditions inside a draft)."""
from __future__ import annotations

import math
import random
import re

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.core.block_manager import BlockManager
from tokenmill.core.request import Request
from tokenmill.core.sched_output import RunnerOutput
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.core.speculation import PROBE_EVERY, REFRESH_EVERY, DraftPolicy, StepCostFit, expected_tokens
from tokenmill.spec.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False, "disable_by_batch_size": None}


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("bad, words", [
    ({"method": "eagle"}, "unknown method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 4, "lookahead": 3}, "unknown key"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "must not exceed"),
    ({"method": "draft_model"}, "needs \"model\""),
    ({"method": "ngram", "model": "x"}, "takes no draft model"),
    ("{not json", "not valid JSON"),
])
def test_bad_configs_are_refused_with_a_reason(bad, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig.parse(bad)


def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # one given: the other takes its value
    assert SpeculativeConfig.parse({"model": "/m"}).method == "draft_model"


# ---------------------------------------------------------------- proposer and policy
def brute_force(tokens, n_min, n_max, k):
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for e in range(len(tokens) - 1, n - 1, -1):
            if tokens[e - n:e] == suffix:
                return tokens[e:e + k]
    return []


def test_ngram_proposer_finds_the_latest_longest_match_incrementally():
    p = NgramProposer(1, 3)
    assert p.propose_one("a", [1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]
    assert p.propose_one("b", [5, 6, 7], 2) == []
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(40)]
    for end in range(2, 200):  # grown one token at a time, the index equals a search from scratch
        if end > len(tokens):
            tokens.append(rng.choice(tokens[-10:] + [rng.randrange(6)]))
        assert p.propose_one("c", tokens[:end], 4) == brute_force(tokens[:end], 1, 3, 4), end


def test_policy_adapts_to_acceptance_and_batch_size():
    assert expected_tokens(0.5, 0) == 1 and expected_tokens(1.0, 4) == 5
    assert math.isclose(expected_tokens(0.5, 2), 1.75)
    policy = DraftPolicy(4, disable_by_batch_size=32, adaptive=True)
    req = Request("r", [1, 2, 3], SamplingParams(), set())
    ks = [policy.num_propose(req, b) for b in (1, 2, 4, 8, 16)]
    assert ks[0] == 4 and ks == sorted(ks, reverse=True) and ks[-1] < 4   # fewer drafts as the batch grows
    assert policy.num_propose(req, 33) == 0         # above disable_by_batch_size: none
    for _ in range(10):
        policy.observe(req, 4, 0)                   # every draft rejected
    proposed = [policy.num_propose(req, 1) for _ in range(2 * PROBE_EVERY)]
    assert proposed.count(0) == 2 * PROBE_EVERY - 2 and proposed.count(1) == 2   # off, with probes
    for _ in range(10):
        policy.observe(req, 1, 1)                   # probes accepted: speculation comes back
    assert policy.num_propose(req, 1) == 4


def test_policy_measures_what_proposing_costs():
    """A draft model whose passes take as long as the target's steps is not worth running, even
    when every draft is accepted; one that takes a tenth of it is."""
    from tokenmill.core.sched_output import StepTiming

    req = Request("r", [1, 2, 3], SamplingParams(), set())
    req.spec_estimate = (99.0, 100.0)
    for pass_s, expect in ((0.010, 0), (0.001, 4)):
        policy = DraftPolicy(4, None, adaptive=True, draft_cost=0.1)  # the weight-byte prior says cheap
        for _ in range(50):
            policy.observe_timing(StepTiming(step_s=0.010, decode_rows=1, propose_s=4 * pass_s, propose_passes=4,
                                             propose_rows=1))
        assert math.isclose(policy.draft_cost, pass_s / 0.010, rel_tol=1e-6)
        assert policy.num_propose(req, 1) == expect


def test_step_cost_fit_learns_the_models_row_cost():
    fit = StepCostFit()
    for i in range(40):
        fit.add(5, 0.010 * (1 + 0.3 * 4))
        assert fit.row_cost() is None                # one row count says nothing about the slope
    for rows in [1, 5, 2, 5, 1, 3] * 10:
        fit.add(rows, 0.010 * (1 + 0.3 * (rows - 1)))
    assert math.isclose(fit.row_cost(), 0.3, rel_tol=1e-6) and math.isclose(fit.t0(0.3), 0.010, rel_tol=1e-6)


def test_policy_charges_what_drafting_measurably_added():
    """Whatever the model says, a draft is charged what drafted steps measurably cost over plain
    ones (the proposer's time included): a draft model that costs more than the token it may save
    is turned off, without probes; a cheap one runs at full length."""
    from tokenmill.core.sched_output import StepTiming

    for propose_s, expect in ((0.060, 0), (0.002, 4)):
        policy = DraftPolicy(4, None, adaptive=True, draft_cost=0.1)   # the weight-byte prior says cheap
        req = Request("r", [1, 2, 3], SamplingParams(), set())
        req.spec_estimate = (99.0, 100.0)
        for _ in range(5):
            policy.observe_timing(StepTiming(step_s=0.010, decode_rows=1))
            # a draft model catching up on a prompt: its time is not a draft's price
            policy.observe_timing(StepTiming(step_s=0.011, decode_rows=1, propose_s=1.0, propose_passes=4,
                                             propose_rows=300))
            policy.observe_timing(StepTiming(step_s=0.014, decode_rows=5, drafts=4))
            policy.observe_timing(StepTiming(step_s=0.011, decode_rows=1, propose_s=propose_s, propose_passes=4,
                                             propose_rows=5))
            policy.observe_timing(StepTiming(step_s=0.014, decode_rows=5, drafts=4))
        assert [policy.num_propose(req, 1) for _ in range(4 * PROBE_EVERY)] == [expect] * (4 * PROBE_EVERY)
    # drafting all along: every REFRESH_EVERY drafted steps one step runs plain, to re-measure the baseline
    policy.observe_timing(StepTiming(step_s=0.010, decode_rows=1))
    ks = []
    for _ in range(2 * REFRESH_EVERY + 2):
        ks.append(policy.num_propose(req, 1))
        policy.observe_timing(StepTiming(step_s=0.011 if ks[-1] else 0.010, decode_rows=1 + ks[-1], drafts=ks[-1]))
    assert [i for i, k in enumerate(ks) if k == 0] == [REFRESH_EVERY, 2 * REFRESH_EVERY + 1]


# ---------------------------------------------------------------- scheduler bookkeeping
def test_drafts_count_in_budget_get_lookahead_blocks_and_give_them_back():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(8, 6, 100), bm, DraftPolicy(4, None, adaptive=False))
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), set())
    s.add_request(r)
    out = s.schedule()
    assert out.new_requests[0].req_id == "r" and out.scheduled[0].num_propose == 4
    s.update(out, RunnerOutput(sampled={"r": [4]}, draft_token_ids={"r": [5, 6, 7, 8]}))
    out = s.schedule()                               # 1 + 4 tokens: budget 6 holds them
    e = out.scheduled[0]
    assert (e.token_ids, e.num_drafts, e.start_pos) == ([4, 5, 6, 7, 8], 4, 3)
    assert len(r.block_table) == 2 and (e.num_kept_blocks, e.new_block_ids) == (1, r.block_table[1:])
    s.update(out, RunnerOutput(sampled={"r": [5, 9]}))   # one draft accepted, then 9
    assert r.token_ids == [1, 2, 3, 4, 5, 9] and r.num_computed_tokens == 5
    assert len(r.block_table) == 2 and len(r.block_hashes) == 1   # nothing unverified is keyed
    bm.check_integrity([r])
    r.draft_token_ids = [1, 1, 1, 1, 1, 1]
    e = s.schedule().scheduled[0]                    # budget 6: one token + 5 drafts at most
    assert e.num_drafts == 5 and len(e.token_ids) == 6
    s.update(s_out := _as_out(e), RunnerOutput(sampled={"r": [2]}))   # all rejected
    assert r.num_computed_tokens == 6 and len(r.block_table) == 2     # 7 tokens: the 3rd block went back
    bm.check_integrity([r])


def _as_out(entry):
    from tokenmill.core.sched_output import SchedulerOutput
    return SchedulerOutput(scheduled=[entry])


def test_drafts_are_dropped_before_anyone_is_preempted_and_never_pass_max_tokens():
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(8, 64, 100), bm, DraftPolicy(4, None, adaptive=False))
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), set())
    s.add_request(r)
    s.update(s.schedule(), RunnerOutput(sampled={"r": [4]}, draft_token_ids={"r": [5, 6, 7, 8, 9]}))
    assert r.draft_token_ids == [5, 6]               # 1 output + 1 + 2 drafts = max_tokens
    r2 = Request("q", [1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True), set())
    s.add_request(r2)
    r.draft_token_ids = [5, 6, 7, 8]
    bm_free = bm.num_free_blocks
    out = s.schedule()
    assert bm_free == 1 and out.scheduled[0].num_drafts == 4 and not out.preempted


# ---------------------------------------------------------------- engine: exact outputs
def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts where prompt lookup finds matches: a motif repeated with noise, and some random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 3 == 2:
            prompts.append([rng.randrange(256) for _ in range(rng.randrange(5, 30))])
        else:
            motif = [rng.randrange(256) for _ in range(rng.randrange(3, 8))]
            prompts.append((motif * 6)[:rng.randrange(10, 40)] + [rng.randrange(256)])
    return prompts


def generate(model, prompts, params, spec=None, **kw):
    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, speculative_config=spec, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.metrics for o in outs], llm


def draft_of(model: str, **kw) -> dict:
    """The target quantized harder (int4) drafting for its float self: close, not identical."""
    return {"method": "draft_model", "model": model, "quantization": "int4", "num_speculative_tokens": 4,
            "adaptive": False, "disable_by_batch_size": None, **kw}


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
@pytest.mark.parametrize("engine_kw", [
    {},                                                          # decode + drafts through the native stack
    {"max_num_batched_tokens": 24},                              # drafts beside prefill chunks, budget cut
    {"kv_cache_memory": "40KiB", "block_size": 4},               # preemption forced by a small cache
    {"enable_prefix_caching": False, "max_num_seqs": 3},
    {"kv_cache_dtype": "int8", "kv_cache_memory": "24KiB", "block_size": 4},  # an 8-bit cache, preempted
], ids=["plain", "chunked", "preempt", "nocache", "int8-preempt"])
def test_greedy_with_drafts_equals_greedy_without(tiny_llama, engine_kw, proposer):
    prompts = repetitive_prompts(12)
    params = [SamplingParams(temperature=0, max_tokens=30 + 3 * i, ignore_eos=True) for i in range(12)]
    if proposer == "draft" and "kv_cache_memory" in engine_kw:  # the draft's cache (as large) shares the budget
        engine_kw = {**engine_kw, "kv_cache_memory": "48KiB" if "kv_cache_dtype" in engine_kw else "80KiB"}
    base, _, _ = generate(tiny_llama, prompts, params, **engine_kw)
    spec, metrics, llm = generate(tiny_llama, prompts, params, NGRAM if proposer == "ngram" else draft_of(tiny_llama),
                                  **engine_kw)
    assert spec == base
    drafted, accepted = sum(m.num_draft_tokens for m in metrics), sum(m.num_accepted_tokens for m in metrics)
    assert drafted > 300 and 10 < accepted < drafted   # drafts were verified, some accepted and some not
    if "kv_cache_memory" in engine_kw:
        assert sum(m.num_preemptions for m in metrics) > 0
    llm.engine.block_manager.check_integrity([])
    if proposer == "draft":
        assert not llm.engine.runner.proposer.reqs   # the draft's blocks were given back too
        llm.engine.runner.proposer.bm.check_integrity([])


def test_a_draft_model_catches_up_on_long_prompts_over_several_steps(tiny_llama, monkeypatch):
    """A prompt longer than what the draft feeds in one step: it takes several steps (drafting
    nothing meanwhile), and then drafts; the output is the target's either way."""
    from tokenmill.spec import draft_model

    monkeypatch.setattr(draft_model, "MAX_CATCH_UP", 8)
    prompts = repetitive_prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base, _, _ = generate(tiny_llama, prompts, params)
    spec, metrics, _ = generate(tiny_llama, prompts, params, draft_of(tiny_llama))
    assert spec == base and sum(m.num_accepted_tokens for m in metrics) > 0


def test_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens but the target's has 256"):
        LLM(tiny_llama, skip_tokenizer_init=True, speculative_config=draft_of(str(tmp_path)))


def test_seeded_sampling_with_drafts_equals_without(tiny_llama):
    """Each output position draws its own seeded noise, and point-mass drafts are accepted when
    the target's sample equals them: a seeded request's tokens do not depend on speculation."""
    prompts = repetitive_prompts(9, seed=1)
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1, presence_penalty=0.2,
                             min_tokens=5, seed=100 + i, max_tokens=40, logprobs=2) for i in range(9)]
    base, _, b_llm = generate(tiny_llama, prompts, params)
    spec, metrics, s_llm = generate(tiny_llama, prompts, params, NGRAM)
    assert spec == base
    assert sum(m.num_accepted_tokens for m in metrics) > 0


def test_logprobs_and_n_with_drafts(tiny_llama):
    prompts = repetitive_prompts(3, seed=2)
    params = SamplingParams(temperature=0, max_tokens=25, logprobs=3, n=2, ignore_eos=True)
    plain = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True).generate(prompts, params, use_tqdm=False)
    spec = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True,
               speculative_config=NGRAM).generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        for oa, ob in zip(a.outputs, b.outputs):
            assert oa.token_ids == ob.token_ids and len(ob.logprobs) == len(ob.token_ids)
            for pa, pb in zip(oa.logprobs, ob.logprobs):
                assert pa.keys() == pb.keys()
                assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 and pa[t].rank == pb[t].rank for t in pa)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_stop_strings_and_max_tokens_inside_a_draft(default_model, proposer):
    """The default model copying a passage: drafts run long, and the stop string, the stop token
    and max_tokens each land inside one. Draft model: the target in float32, its Q4_1 self drafting."""
    text = ("The river rises in the hills, runs past the mill and the old stone bridge, and reaches the sea "
            "at the harbour town.")
    prompt = f"Copy this sentence exactly.\n{text}\nCopy:\n{text}\nCopy:\n"
    cases = [SamplingParams(temperature=0, max_tokens=60, stop=["stone bridge"]),
             SamplingParams(temperature=0, max_tokens=60, stop=["mill and"], include_stop_str_in_output=True),
             SamplingParams(temperature=0, max_tokens=11),
             SamplingParams(temperature=0, max_tokens=23, stop_token_ids=[11])]   # 11: ","
    kw = dict(dtype="float32", kv_cache_memory="64MiB")
    spec = {**NGRAM, "num_speculative_tokens": 8}
    if proposer == "draft":
        kw["quantization"] = "none"
        spec = {**draft_of(default_model), "quantization": "auto", "num_speculative_tokens": 8}
    plain = LLM(default_model, **kw).generate([prompt] * len(cases), cases, use_tqdm=False)
    llm = LLM(default_model, speculative_config=spec, **kw)
    spec = llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    for p, s in zip(plain, spec):
        a, b = p.outputs[0], s.outputs[0]
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason,
                                                                       a.stop_reason)
    assert spec[0].outputs[0].finish_reason == "stop" and spec[2].outputs[0].finish_reason == "length"
    assert sum(s.metrics.num_accepted_tokens for s in spec) > 20


# ---------------------------------------------------------------- engine: the sampled distribution
def chi2_threshold(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z = 3.09 is the 0.001 level."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def tiny_vocab8(path, seed: int) -> str:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.5, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_sequences_have_the_distribution_of_no_speculation(tmp_path, proposer):
    """Temperature 1, top-p 0.9: the joint distribution of the 2nd and 3rd sampled tokens (the
    ones that verify drafts) with speculation matches the one without — a two-sample chi-square
    test at the 0.001 level over 3000 sequences each. The prompt makes prompt lookup propose
    after every first token, and the draft model is another random model (its q far from the
    target's p), so accepting drafts without the acceptance rule, or resampling a rejection
    from p instead of the residual (p - q)+, fails it."""
    model = tiny_vocab8(tmp_path / "target", 7)
    spec = {**NGRAM, "num_speculative_tokens": 2} if proposer == "ngram" else \
        {**draft_of(tiny_vocab8(tmp_path / "draft", 8)), "quantization": "auto", "num_speculative_tokens": 2}
    prompt = [0, 1, 2, 3, 4, 5, 6, 7] * 3
    n = 3000

    def pairs(spec, seed0):
        params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=4, seed=seed0 + i) for i in range(n)]
        toks, metrics, _ = generate(model, [prompt] * n, params, spec, max_num_seqs=256,
                                    max_num_batched_tokens=2048)
        return [tuple(t[1:3]) for t in toks], sum(m.num_draft_tokens for m in metrics)

    base, _ = pairs(None, 0)
    spec, drafted = pairs(spec, 10**6)
    assert drafted > 1.5 * n                        # two drafts verified for most sequences
    cells = sorted(set(base) | set(spec))
    a = [base.count(c) for c in cells]
    b = [spec.count(c) for c in cells]
    stat = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b) if x + y >= 10)
    df = sum(1 for x, y in zip(a, b) if x + y >= 10) - 1
    assert df > 5 and stat < chi2_threshold(df), (stat, df)


# ---------------------------------------------------------------- the real server
@pytest.mark.slow
def test_server_with_prompt_lookup_reports_drafts_in_timings_and_metrics():
    """`tokenmill serve --speculative-config`: the official client's answers are the same text as
    without drafts would give (greedy), each response's timings count its drafts, and /metrics has
    vLLM's spec_decode counters. A bad config stops the server at start with the reason."""
    import json
    import signal
    import subprocess
    import sys

    import httpx
    import openai

    from test_server import MODEL, start_server

    bad = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--speculative-config",
                          '{"method": "eagle"}'], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown method 'eagle'" in bad.stderr
    text = "The river rises in the hills, runs past the mill and the old stone bridge, and reaches the sea."
    messages = [{"role": "user", "content": f"Repeat exactly: {text}"}]
    answers = []
    for spec in (None, json.dumps(NGRAM)):
        proc, base = start_server(*(["--speculative-config", spec] if spec else []))
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
            full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                                         temperature=0, stream=True))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            answers.append((full.choices[0].message.content, streamed))
            timings = full.model_extra["timings"]
            metrics = httpx.get(base + "/metrics").text
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        if spec:
            assert 0 < timings["accepted_draft_tokens"] <= timings["draft_tokens"]
            accepted = float(re.search(r'tokenmill:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)', metrics)[1])
            assert accepted >= 2 * timings["accepted_draft_tokens"] - 1e-9  # both requests counted
            assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2",position="0"}' in metrics
        else:
            assert timings["draft_tokens"] == 0
    assert answers[0] == answers[1] and answers[0][0] == answers[0][1]


def test_logprobs_of_tokens_accepted_from_a_sampled_draft(tiny_llama):
    """Draft-model sampling takes the general rule, whose emitted tokens need not be the sampler's
    own draws: their logprobs are looked up for the tokens actually emitted."""
    llm = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True, speculative_config=draft_of(tiny_llama))
    outs = llm.generate(repetitive_prompts(4, seed=4), SamplingParams(temperature=0.8, max_tokens=20, logprobs=2,
                                                                      seed=1), use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    for o in outs:
        c = o.outputs[0]
        assert o.error is None and len(c.logprobs) == len(c.token_ids) == 20
        for tok, pos in zip(c.token_ids, c.logprobs):
            top = sorted((lp for t, lp in pos.items() if lp.rank <= 2), key=lambda lp: lp.rank)
            assert pos[tok].rank >= 1 and [lp.rank for lp in top][:2] == [1, 2]
            assert pos[tok].logprob <= top[0].logprob + 1e-6

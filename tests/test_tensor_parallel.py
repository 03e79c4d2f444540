"""Tensor parallelism (distributed/): the shard plan, the weight slicing, and TP=2 engines (two
processes on gloo + shared memory) against TP=1 on the same weights: tiny Llama / Qwen2 / Gemma in
float32 (identical greedy tokens, logprobs within 1e-4), an int4 checkpoint and the default GGUF
with 8- and 16-bit activations (identical tokens and logprobs, bit for bit), with prefix caching,
chunked prefill and preemption forced by a small cache."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.tensor_parallel import ShardPlan, row_parallel_bounds, split
from tokenmill.layers.linear import reduction_segment
from tokenmill.models.arch import ArchConfig
from tokenmill.quant import int4

SMOLLM2 = ArchConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                     max_position_embeddings=8192)


def test_split_covers_in_whole_units():
    assert [split(3, 2, r) for r in range(2)] == [(0, 2), (2, 1)]
    assert [split(96, 2, r, 32) for r in range(2)] == [(0, 64), (64, 32)]
    for n, parts, unit in ((49152, 3, 16), (4864, 4, 128), (7, 7, 1)):
        shares = [split(n, parts, r, unit) for r in range(parts)]
        assert shares[0][0] == 0 and all(a + n_ == b for (a, n_), (b, _) in zip(shares, shares[1:]))
        assert sum(c for _, c in shares) == n and all(c % unit == 0 for _, c in shares)


def test_plan_for_the_default_model():
    """3 KV heads over 2 ranks: 2 and 1, each with its 3 query heads; nothing duplicated."""
    p0, p1 = (ShardPlan.for_rank(SMOLLM2, r, 2) for r in range(2))
    assert (p0.kv_heads, p1.kv_heads) == ((0, 2), (2, 1))
    assert p0.local_arch(SMOLLM2).num_heads == 6 and p1.local_arch(SMOLLM2).num_heads == 3
    assert (p0.inter, p1.inter) == ((0, 768), (768, 768))
    assert (p0.vocab, p1.vocab, p0.vocab_widths) == ((0, 24576), (24576, 24576), (24576, 24576))
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        ShardPlan.for_rank(SMOLLM2, 0, 4)
    with pytest.raises(ValueError, match="mixtures of experts"):
        ShardPlan.for_rank(dataclasses.replace(SMOLLM2, num_experts=8, experts_per_tok=2,
                                               moe_intermediate_size=256), 0, 2)


def test_slices_keep_the_exact_int4_form():
    """Column shares cut rows of (q, scale, min); row shares cut whole groups, and a share that
    would cut a group, or an act-order permutation, drops the int4 form (the float slice stays)."""
    plan = ShardPlan.for_rank(SMOLLM2, 1, 2)
    w = torch.randn(576, 1536)
    parts = int4.quantize_rtn(w, 32)
    full = int4.dequantize(*parts)
    piece, extra = plan.slice_weight("model.layers.0.mlp.down_proj", "weight", None, full, {"int4_parts": parts})
    assert piece.shape == (576, 768) and torch.equal(int4.dequantize(*extra["int4_parts"]), full[:, 768:])
    wq = torch.randn(9 * 64, 576)
    qparts = int4.quantize_rtn(wq, 32)
    piece, extra = plan.slice_weight("model.layers.0.self_attn.qkv_proj", "weight", "q", wq, {"int4_parts": qparts})
    assert torch.equal(piece, wq[384:]) and torch.equal(extra["int4_parts"][0], qparts[0][384:])
    coarse = int4.quantize_rtn(w, 512)  # rank 1's channels 768..1536 start inside a group of 512
    piece, extra = plan.slice_weight("model.layers.0.mlp.down_proj", "weight", None, full, {"int4_parts": coarse})
    assert piece.shape == (576, 768) and extra["int4_parts"] is None
    perm = torch.randperm(1536)
    _, extra = plan.slice_weight("model.layers.0.mlp.down_proj", "weight", None, full,
                                 {"int4_parts": parts, "input_perm": perm})
    assert extra["int4_parts"] is None and extra["input_perm"] is None
    norm = torch.randn(576)
    assert plan.slice_weight("model.layers.0.input_layernorm", "weight", None, norm, {})[0] is norm


# ------------------------------------------------------------------ engines
PROMPTS = [[1, 5, 9, 200, 17, 33, 2, 8, 90, 41, 7, 7, 100, 3, 61, 250, 12, 5, 19, 23, 88],
           [3, 4], [200, 201, 202, 203] * 9]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)


def run(path: str, tp: int, prompts=PROMPTS, params=GREEDY, tokenizer: bool = False, **kw):
    llm = LLM(path, tensor_parallel_size=tp, skip_tokenizer_init=not tokenizer, **kw)
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.engine
    finally:
        llm.engine.shutdown()


def assert_same(a, b, tol: float | None) -> None:
    """Same tokens; logprobs within `tol` (0: the same bits)."""
    for x, y in zip((o.outputs[0] for o in a), (o.outputs[0] for o in b)):
        assert x.token_ids == y.token_ids
        if tol is not None:
            assert [sorted(p) for p in x.logprobs] == [sorted(q) for q in y.logprobs]
            diff = max(abs(p[t].logprob - q[t].logprob) for p, q in zip(x.logprobs, y.logprobs) for t in p)
            assert diff <= tol, diff


@pytest.mark.parametrize("chunk", [256, 8], ids=["whole-prompts", "chunked-prefill"])
def test_tp2_equals_tp1_float32(tiny_model, chunk, integer_kernels):
    # one thread per rank and for the reference: float32 GEMMs round by how they split over threads,
    # and the thread governor (engine/threads.py) changes a TP=1 engine's count when a core is busy
    kw = dict(dtype="float32", kv_cache_dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=chunk,
              threads=1)
    ref, _ = run(tiny_model, 1, **kw)
    got, engine = run(tiny_model, 2, **kw)
    assert engine.runner.model.cfg.num_kv_heads == 1   # rank 0 held half the model
    assert_same(ref, got, 1e-4)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_tp2_int4_checkpoint(tiny_llama, tmp_path, integer_kernels, kv):
    from tokenmill.compress import export
    from tokenmill.compress import quantize as quant
    from tokenmill.models import loader

    loaded = loader.load(tiny_llama, "float32", torch.device("cpu"), load_tokenizer=False, quantization="none")
    qcfg = quant.QuantizeConfig(method="rtn-int4", group_size=32)
    results = quant.quantize_model(loaded.model, qcfg, None, progress=False)
    tensors = export.float_tensors(loaded.model, skip=set(results))
    tensors.update(quant.checkpoint_tensors(loaded.model, results, qcfg))
    out = str(tmp_path / "int4")
    with export.atomic_output_dir(out) as tmp:
        export.write_checkpoint(tmp, loaded.arch, None, tensors, "float32", qcfg.hf_quantization_config())
    kw = dict(kv_cache_memory="64MiB", activation_bits=8, kv_cache_dtype=kv)  # int8: each rank's heads' own scales
    ref, _ = run(out, 1, **kw)
    got, engine = run(out, 2, **kw)
    kinds = {type(m.qweight).__name__ for m in engine.runner.model.modules() if getattr(m, "qweight", None) is not None}
    assert "Int4Weight" in kinds                        # the shards kept the checkpoint's integers
    assert_same(ref, got, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 16])
def test_tp2_default_gguf_with_prefix_cache_and_preemption(default_model, bits, integer_kernels):
    """The default model's Q4_1 blocks with either activation width (8: the AVX2 default, where the
    next layer's rounding would magnify any difference in how a row-parallel sum is added up), a
    shared prefix served from the cache, and a cache so small that requests are preempted and
    recomputed: the same logprobs, bit for bit."""
    shared = list(range(1000, 1040))
    prompts = [shared + [2000 + i] * (i + 1) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    kw = dict(activation_bits=bits, max_num_seqs=6)
    # 12 blocks where ~18-36 are needed. The budget is per rank, and rank 0 holds 2 of the 3 KV
    # heads: two thirds of it give TP=2 the same 12 blocks, so both preempt at the same steps (a
    # preempted request's tokens are recomputed by the prompt kernels, whose sums differ from the
    # decode steps' in the last bits: one process alone, preempted or not, parts by ~0.3 logprob)
    ref, ref_engine = run(default_model, 1, prompts, params, kv_cache_memory="4500KiB", **kw)
    got, engine = run(default_model, 2, prompts, params, kv_cache_memory="3000KiB", **kw)
    assert ref_engine.block_manager.num_blocks == engine.block_manager.num_blocks == 12
    # the fast paths ran: the native decode stack (its all-reduces in C++) and shared memory
    assert engine.runner.model.decode_stack is not None and engine.executor.group.shm is not None
    for e in (ref_engine, engine):
        assert e.scheduler.num_preemptions > 0 and e.block_manager.num_hits >= 5 * 32
    assert ref_engine.scheduler.num_preemptions == engine.scheduler.num_preemptions
    assert_same(ref, got, 0.0)


@pytest.mark.slow
def test_tp2_default_model_answers_as_tp1(default_model, integer_kernels):
    """Real prompts through the tokenizer with the CPU's default activation width: 64 greedy tokens
    each, token for token and logprob for logprob as one process (before the row-parallel sums
    were added in float64, 11 of these 16 parted, one at its first token)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colours:", "Write a haiku about the sea.",
               "Explain why the sky is blue.", "What is 17 times 23?", "Translate 'good morning' to Spanish.",
               "Give me a recipe for pancakes.", "Who wrote Hamlet?", "Describe a cat in one sentence.",
               "import numpy as np\n", "The three laws of motion are", "Once upon a time", "SELECT * FROM",
               "My favourite book is", "The best way to learn Python is"]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=2)
    kw = dict(kv_cache_memory="256MiB", tokenizer=True)
    ref, _ = run(default_model, 1, prompts, params, **kw)
    got, _ = run(default_model, 2, prompts, params, **kw)
    assert_same(ref, got, 0.0)


def test_row_parallel_sums_run_in_segments_every_slice_divides():
    """SmolLM2's o_proj slices start at 192 or 384 (TP=3, TP=2), its down_proj's at 512, 768, 1024:
    every process sums 192 and 256 inputs in float32 and adds those runs in float64, a rank's share
    as whole runs of them."""
    bounds = row_parallel_bounds(SMOLLM2)
    assert bounds == {"self_attn.o_proj": (192, 384, 576), "mlp.down_proj": (512, 768, 1024, 1536)}
    assert reduction_segment(576, 32, bounds["self_attn.o_proj"]) == 192
    assert reduction_segment(384, 32, bounds["self_attn.o_proj"]) == 192   # rank 0 of 2: two runs
    assert reduction_segment(192, 32, bounds["self_attn.o_proj"]) == 0     # a share of one run: one sum
    assert reduction_segment(1536, 32, bounds["mlp.down_proj"]) == 256
    assert reduction_segment(1536, 128, bounds["mlp.down_proj"]) == 256    # int4 groups of 128 fit too
    assert reduction_segment(576, 128, bounds["self_attn.o_proj"]) == 0    # 192 cuts groups of 128: no runs
    moe = dataclasses.replace(SMOLLM2, num_experts=8, experts_per_tok=2, moe_intermediate_size=256)
    assert row_parallel_bounds(moe) == {"self_attn.o_proj": (), "mlp.down_proj": ()}
    assert reduction_segment(576, 32, ()) == 0


def test_bad_sizes_are_refused_and_leave_no_process(tiny_llama):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        LLM(tiny_llama, tensor_parallel_size=3, skip_tokenizer_init=True, kv_cache_memory="64MiB")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(tiny_llama, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="slurm")
    import torch.distributed as dist
    assert not dist.is_initialized()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and "spawn_main" in " ".join(p.cmdline())]
    assert not left


# ------------------------------------------------------------------ the server, and a rank that dies
def _worker_of(proc) -> "psutil.Process":
    import psutil

    ranks = [c for c in psutil.Process(proc.pid).children(recursive=True) if "spawn_main" in " ".join(c.cmdline())
             and "resource_tracker" not in " ".join(c.cmdline())]
    assert len(ranks) == 1, [c.cmdline() for c in ranks]
    return ranks[0]


def _health_turns_bad(base: str, seconds: float) -> float:
    """Seconds until /health stops answering 200 (503, or the server gone)."""
    import time

    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            if httpx.get(base + "/health", timeout=2).status_code != 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"/health still 200 after {seconds} s")


@pytest.mark.slow
def test_server_with_tp2_and_a_rank_killed_mid_request():
    import openai

    from test_server import MODEL, start_server

    proc, base = start_server("--tensor-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=8, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 8
        chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True,
                                                temperature=0))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4000, stream=True,
                                           extra_body={"ignore_eos": True})
        events = iter(stream)
        next(events)
        _worker_of(proc).kill()
        with pytest.raises(openai.APIError, match="tensor-parallel rank 1 .* died"):
            for _ in events:
                pass
        assert _health_turns_bad(base, 10) < 10
        assert proc.wait(timeout=60) != 0                 # the server exits for its supervisor to restart it
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_rank_that_dies_while_idle_turns_health_bad():
    from test_server import start_server

    proc, base = start_server("--tensor-parallel-size", "2")
    try:
        _worker_of(proc).kill()
        assert _health_turns_bad(base, 10) < 5
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------ Ray
@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_ray_backend_equals_tp1(tiny_llama, ray_cluster, integer_kernels):
    import ray

    kw = dict(dtype="float32", kv_cache_dtype="float32", kv_cache_memory="64MiB", threads=1)  # as above
    ref, _ = run(tiny_llama, 1, **kw)
    got, engine = run(tiny_llama, 2, distributed_executor_backend="ray", **kw)
    assert_same(ref, got, 1e-4)
    assert ray.is_initialized()  # the test's cluster: the engine used it and left it running
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


@pytest.mark.slow
def test_server_on_ray_answers_openai_checks(ray_cluster, monkeypatch):
    import openai

    from test_server import MODEL, start_server

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    proc, base = start_server("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                           max_tokens=12, temperature=0)
        assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=8, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    finally:
        proc.terminate()  # drains, stops its rank, leaves (uvicorn re-raises SIGTERM once done)
        proc.wait(timeout=60)
    import time

    import ray
    deadline = time.monotonic() + 20  # removal is asynchronous: the GCS marks the group once its bundles are freed
    while not all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()):
        assert time.monotonic() < deadline, ray.util.placement_group_table()
        time.sleep(0.2)


def test_idle_workers_are_pinged_and_serve_on(tiny_llama, monkeypatch):
    """Rank 0 pings idle workers (so their wait never reaches the group timeout); pings between
    steps leave the ranks in step."""
    import time

    from tokenmill.distributed import executor

    monkeypatch.setattr(executor, "PING_EVERY_S", 0.2)
    llm = LLM(tiny_llama, tensor_parallel_size=2, skip_tokenizer_init=True, dtype="float32", kv_cache_memory="64MiB")
    try:
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        last = llm.engine.executor._last
        time.sleep(2.5)
        assert llm.engine.executor._last > last + 1     # pinged while idle
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_under_tp(tiny_llama, method, integer_kernels):
    """Drafts are verified by the sharded target as 1 + k rows per request; a draft model runs
    whole on rank 0 beside it. Greedy outputs equal plain TP=1 decoding."""
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = tiny_llama
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], PROMPTS[0]]
    kw = dict(dtype="float32", kv_cache_dtype="float32", kv_cache_memory="64MiB", threads=1)  # as above
    ref, _ = run(tiny_llama, 1, prompts, **kw)
    got, engine = run(tiny_llama, 2, prompts, speculative_config=spec, **kw)
    assert sum(o.metrics.num_draft_tokens for o in got) > 0   # drafts were verified by the sharded target
    if method == "draft_model":                                 # the draft is the target: all accepted
        assert sum(o.metrics.num_accepted_tokens for o in got) > 20
    assert_same(ref, got, 1e-4)


def test_a_worker_that_dies_before_joining_fails_the_start_at_once(tiny_llama, tmp_path):
    """A script that creates a TP engine at import time, without `if __name__ == "__main__":`: each
    spawned worker imports it, starts an engine of its own and fails. Rank 0 reports that worker's
    death within seconds and says why (it used to wait out the group's 30-minute timeout)."""
    import os
    import pathlib
    import subprocess
    import sys
    import time

    script = tmp_path / "no_main_guard.py"
    script.write_text("from tokenmill import LLM\n"
                      f"LLM({tiny_llama!r}, tensor_parallel_size=2, skip_tokenizer_init=True, kv_cache_memory='64MiB')\n")
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode != 0
    assert "tensor-parallel rank 1" in r.stderr and "before it joined the tensor-parallel group" in r.stderr
    assert 'if __name__ == "__main__":' in r.stderr
    assert time.monotonic() - t0 < 120

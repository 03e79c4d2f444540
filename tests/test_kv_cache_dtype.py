"""The 8-bit KV caches (--kv-cache-dtype int8 | fp8_e5m2) across the engine: about twice the tokens
in the same memory (start-up line, /metrics), and the features that move K/V through the cache —
chunked prefill, prefix caching, preemption, sliding windows, the native decode stack and the PyTorch
path — agree with each other on the same cache dtype. (Speculative decoding and tensor parallelism:
tests/test_speculative.py and tests/test_tensor_parallel.py run with an int8 cache too; the kernels
against their reference: tests/test_kernels.py.)"""
import httpx
import openai
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention import EIGHT_BIT
from tokenmill.runner.kv_cache import bytes_per_block

EIGHT = ["int8", "fp8_e5m2"]
PROMPTS = [list(range(3, 60)), [7, 8, 9] * 15, list(range(100, 140)) + list(range(3, 30))]


def generate(llm: LLM, prompts=PROMPTS, max_tokens: int = 20):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def assert_close(a, b, tol: float) -> None:
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) <= tol


def engine(path: str, kv: str, **kw) -> LLM:
    kw = {"kv_cache_memory": "8MiB", "quantization": "none", "dtype": "float32", **kw}
    return LLM(path, kv_cache_dtype=kv, skip_tokenizer_init=True, **kw)


def test_capacity_doubles_at_the_same_memory(tiny_llama):
    cap = {kv: engine(tiny_llama, kv).engine for kv in ["float16", *EIGHT]}
    d = cap["int8"].arch.head_dim
    assert cap["fp8_e5m2"].kv_capacity_tokens == 2 * cap["float16"].kv_capacity_tokens
    # an int8 row is head_dim bytes and its 4-byte scale
    ratio = cap["int8"].kv_capacity_tokens / cap["float16"].kv_capacity_tokens
    assert ratio == pytest.approx(2 * d / (d + 4), rel=0.01)
    assert [cap[kv].kv_cache_dtype for kv in cap] == ["float16", "int8", "fp8_e5m2"]
    for kv in EIGHT:
        assert cap[kv].runner.cache.dtype in EIGHT_BIT


@pytest.mark.parametrize("kv", EIGHT)
def test_chunked_prefill_prefix_cache_and_preemption_agree(tiny_llama, kv):
    """Whole prompts, prompts in 8-token chunks, prompts served from the prefix cache, and a cache so
    small that requests are preempted and recomputed: the same tokens and logprobs. Each path reads
    the prompt's K/V back from the 8-bit cache, so the rounding is the same wherever they came from."""
    first = engine(tiny_llama, kv, enable_prefix_caching=False)
    whole = generate(first)
    chunked = generate(engine(tiny_llama, kv, enable_prefix_caching=False, max_num_batched_tokens=8))
    assert_close(whole, chunked, 1e-4)
    cached_llm = engine(tiny_llama, kv)
    generate(cached_llm)
    again = generate(cached_llm)  # the prompts' blocks now come from the prefix cache
    assert cached_llm.engine.block_manager.num_hits > 0
    assert_close(whole, again, 1e-4)
    # 30 blocks of 4 tokens: the longest request fits (87 tokens), the first two grow past it together
    block = bytes_per_block(first.engine.arch, 4, first.engine.runner.cache.dtype)
    small = engine(tiny_llama, kv, kv_cache_memory=30 * block, block_size=4, enable_prefix_caching=False)
    small.engine.scheduler.num_preemptions = 0
    preempted = generate(small)
    assert small.engine.scheduler.num_preemptions > 0
    assert_close(whole, preempted, 1e-4)
    small.engine.block_manager.check_integrity([])


@pytest.mark.parametrize("kv", EIGHT)
def test_pytorch_path_reads_the_cache_as_the_kernels_do(tiny_llama, kv):
    """The path without the CPU kernels (what a GPU runs): K/V quantized by PyTorch ops (the same bits,
    tests/test_kernels.py) and read back by gathering and dequantizing blocks: same tokens, logprobs
    within float32 summation order."""
    kernel = engine(tiny_llama, kv, max_num_batched_tokens=16)
    ref = engine(tiny_llama, kv, max_num_batched_tokens=16)
    model = ref.engine.runner.model
    model.decode_stack = None
    for attn in model.attention_layers():
        attn.use_kernel = False
    assert_close(generate(kernel), generate(ref), 1e-4)


@pytest.mark.parametrize("kv", EIGHT)
def test_sliding_window_layers_read_the_8bit_cache(tmp_path, kv):
    """A model whose every layer slides (Mistral, window 7) over a generation several windows long, its
    blocks before the window handed back as it goes: the kernels' windowed reads of the 8-bit cache
    equal the PyTorch path's."""
    from test_model_families import make_family

    path = make_family("mistral-window", str(tmp_path / "m"))
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    kw = dict(block_size=4, kv_cache_memory="4MiB")
    llm = engine(path, kv, **kw)
    got = generate(llm, [prompt], max_tokens=80)
    ref = engine(path, kv, **kw)
    ref.engine.runner.model.decode_stack = None
    for attn in ref.engine.runner.model.attention_layers():
        attn.use_kernel = False
    assert_close(got, generate(ref, [prompt], max_tokens=80), 1e-4)


def test_server_with_an_int8_cache(default_model):
    """`serve --kv-cache-dtype int8`: the start-up line and /metrics give the capacity (1.9x what
    float16 holds in the same --kv-cache-memory, at head size 64) and the dtype, and a chat completion
    through the official client answers what the offline engine with the same settings answers."""
    import signal

    from test_server import MODEL, server_log, start_server

    question = [{"role": "user", "content": "What is the capital of France?"}]
    offline = LLM(default_model, dtype="float32", kv_cache_dtype="int8", kv_cache_memory="512MiB")
    want = offline.chat([question], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    fp16_tokens = 512 * 2**20 // bytes_per_block(offline.engine.arch, 16, torch.float16) * 16
    proc, base = start_server("--kv-cache-dtype", "int8")  # --dtype float32 --kv-cache-memory 512MiB
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none")
        r = client.chat.completions.create(model=MODEL, messages=question, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == want and want
        text = httpx.get(base + "/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    cap = [ln for ln in text.splitlines() if ln.startswith("tokenmill:kv_cache_capacity_tokens{")]
    info = [ln for ln in text.splitlines() if ln.startswith("tokenmill:cache_config_info{")]
    assert len(cap) == 1 and len(info) == 1 and 'cache_dtype="int8"' in info[0] and 'block_size="16"' in info[0]
    tokens = int(float(cap[0].split()[-1]))
    assert tokens == offline.engine.kv_capacity_tokens
    assert tokens / fp16_tokens == pytest.approx(2 * 64 / 68, rel=0.01)
    assert f"KV cache {tokens} tokens (int8)" in server_log(proc)


def test_key_smoothing_keeps_large_key_channels_from_costing_accuracy(tmp_path):
    """Qwen2.5's keys carry a few large channels (its key biases) that set an int8 row's scale and
    round the others coarsely. With the channels pulled in per KV head (models/kv_smoothing.py, the
    default with an int8 cache) the logits stay close to a float32 cache's; without, they do not.
    λ is shared by the two channels RoPE rotates together, never below the head's median (within the
    rounding to a power of two)."""
    from conftest import make_tiny_hf
    from tokenmill.compress.evaluate import paged_cache
    from tokenmill.models import kv_smoothing, loader

    path = make_tiny_hf("qwen2", str(tmp_path / "q"))
    lm = loader.load(path, "float32", torch.device("cpu"), load_tokenizer=False, quantization="none")
    model = lm.model
    half, d = model.cfg.rope_dim // 2, model.cfg.head_dim
    with torch.no_grad():  # a large bias on channel 3 of every KV head's keys (rotating with channel 3 + half)
        for layer in model.model.layers:
            qkv = layer.self_attn.qkv_proj
            k0 = model.cfg.num_heads * d
            for h in range(model.cfg.num_kv_heads):
                qkv.bias[k0 + h * d + 3] += 60.0
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(2))
    with paged_cache(model, "float32", 64, chunk=16) as score:
        ref = torch.log_softmax(score(ids), -1)
    with paged_cache(model, "int8", 64, chunk=16) as score:
        lam = model.attention_layers()[0].k_smooth
        assert torch.equal(lam[:, :half], lam[:, half:2 * half])
        assert torch.equal(lam, torch.exp2(torch.log2(lam).round()))  # powers of two
        assert (lam * 1.5 >= lam.median(dim=-1, keepdim=True).values).all() and (lam[:, 3] > 10 * lam.median(dim=-1).values).all()
        smoothed = (torch.log_softmax(score(ids), -1) - ref).abs().max()
        kv_smoothing.attach(model, None)
        plain = (torch.log_softmax(score(ids), -1) - ref).abs().max()
    assert smoothed < plain / 3, (smoothed, plain)
    assert all(a.k_smooth is None for a in model.attention_layers())

"""The offline benchmarks measure what they say: TTFT spans every step of a chunked prompt."""
from tokenmill.bench import offline
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine


def test_latency_ttft_covers_every_prefill_step(tiny_llama):
    engine = LLMEngine(EngineConfig.from_kwargs(model=tiny_llama, max_num_batched_tokens=16,
                                                kv_cache_memory="16MiB", skip_tokenizer_init=True,
                                                enable_prefix_caching=False))
    result = offline.latency(engine, list(range(1, 41)), output_len=4, repeats=1)
    assert result["ttft_steps"] == 3  # 40 prompt tokens at 16 per step; the third step samples the first token
    assert result["ttft_s"] > 0 and result["decode_tokens_per_s"] > 0
    assert [len(run) for run in result["runs"]] == [4] and result["output_tokens"] == 4  # ttft, tok/s, steps, tokens

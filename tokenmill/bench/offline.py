"""Offline benchmarks through the Python API: single-request latency (TTFT, decode tokens/s and
the weight bandwidth that implies, as gpt-fast reports it) and batched throughput."""
from __future__ import annotations

import statistics
import time

from tokenmill.bench.workload import Item
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.models.weight_cache import wait_for_writes
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils import wait_for_huge_pages


def weight_bytes_per_token(engine: LLMEngine) -> int:
    """Bytes of weights one decode step reads (gpt-fast's bandwidth figure divides by this)."""
    return engine.runner.model.decode_weight_bytes()


def latency(engine: LLMEngine, prompt: list[int], output_len: int, repeats: int, ignore_eos: bool = True) -> dict:
    """Greedy, one request at a time. With `ignore_eos` False a run ends at EOS (a real prompt's
    natural answer) and decode speed counts the tokens it produced. With speculative decoding on,
    also the acceptance rate (accepted / verified drafts) and the mean acceptance length (tokens
    per verifying step: 1 + accepted per verification, as vLLM reports it)."""
    wait_for_huge_pages()  # the steady state: the weights in huge pages, as a server is seconds after start
    wait_for_writes()  # and the weight cache written, where a first start writes it
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=ignore_eos)
    runs, drafts = [], [0, 0, 0]  # verifications, draft tokens, accepted
    for r in range(repeats + 1):  # the first run warms up
        engine.add_request(f"lat-{r}", prompt, params)
        t0 = time.perf_counter()
        first, steps, final = None, 0, None
        while engine.has_unfinished_requests():
            outs = engine.step()
            steps += first is None
            # the first token, not the first step: a prompt longer than the step's token budget
            # takes several steps before its first token
            if first is None and any(o.delta_token_ids for out in outs for o in out.outputs):
                first = time.perf_counter()
            final = next((o for o in outs if o.finished), final)
        end = time.perf_counter()
        if r:
            n = len(final.outputs[0].token_ids)
            runs.append((first - t0, (n - 1) / (end - first) if n > 1 else 0.0, steps, n))
            m = final.metrics
            for i, v in enumerate((m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens)):
                drafts[i] += v
    ttft = statistics.median(r[0] for r in runs)
    tps = statistics.median(r[1] for r in runs)
    wbytes = weight_bytes_per_token(engine)
    out = {"input_len": len(prompt), "output_len": output_len, "output_tokens": runs[-1][3], "repeats": repeats,
           "ttft_s": ttft, "ttft_steps": runs[-1][2],
           "decode_tokens_per_s": tps, "weight_bytes_per_token": wbytes,
           "achieved_bandwidth_gb_s": wbytes * tps / 1e9, "runs": runs}
    if engine.config.scheduling.speculative_config is not None:
        out["spec_acceptance_rate"] = drafts[2] / drafts[1] if drafts[1] else 0.0
        out["spec_mean_acceptance_length"] = 1 + drafts[2] / drafts[0] if drafts[0] else 1.0
        out["spec_draft_tokens"], out["spec_accepted_tokens"] = drafts[1], drafts[2]
    return out


def throughput(engine: LLMEngine, items: list[Item]) -> dict:
    wait_for_huge_pages()
    wait_for_writes()
    params = [SamplingParams(temperature=0, max_tokens=it.max_tokens, ignore_eos=True) for it in items]
    prompt_tokens = 0
    t0 = time.perf_counter()
    for i, (it, p) in enumerate(zip(items, params)):
        engine.add_request(f"tp-{i}", it.prompt, p)
    output_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            output_tokens += sum(len(o.delta_token_ids) for o in out.outputs)
            prompt_tokens += len(out.prompt_token_ids) if out.finished else 0
    elapsed = time.perf_counter() - t0
    return {"num_requests": len(items), "elapsed_s": elapsed, "requests_per_s": len(items) / elapsed,
            "output_tokens": output_tokens, "prompt_tokens": prompt_tokens,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (output_tokens + prompt_tokens) / elapsed}

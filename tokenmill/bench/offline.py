"""Offline benchmarks through the Python API: single-request latency (TTFT, decode tokens/s and
the weight bandwidth that implies, as gpt-fast reports it) and batched throughput."""
from __future__ import annotations

import statistics
import time

import torch

from tokenmill.bench.workload import Item
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def _kernel_bytes(qweight) -> int:
    """Bytes of the tensors a quantized weight's kernel reads: its panels when it has them."""
    src = qweight.panels if getattr(qweight, "panels", None) is not None else qweight
    return sum(t.numel() * t.element_size() for t in vars(src).values() if isinstance(t, torch.Tensor))


def weight_bytes_per_token(engine: LLMEngine) -> int:
    """Bytes of weights one decode step reads: every linear layer and the output head (the
    embedding table contributes one row)."""
    model = engine.runner.model
    total = 0
    for module in model.modules():
        q = getattr(module, "qweight", None)
        if q is not None:
            total += _kernel_bytes(q)
        elif getattr(module, "weight", None) is not None and module is not model.model.embed_tokens:
            total += module.weight.numel() * module.weight.element_size()
    if model.lm_head is None:
        head = model.tied_head_q
        total += _kernel_bytes(head) if head is not None else \
            model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    return total


def latency(engine: LLMEngine, prompt: list[int], output_len: int, repeats: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    runs = []
    for r in range(repeats + 1):  # the first run warms up
        engine.add_request(f"lat-{r}", prompt, params)
        t0 = time.perf_counter()
        first, steps = None, 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            steps += first is None
            # the first token, not the first step: a prompt longer than the step's token budget
            # takes several steps before its first token
            if first is None and any(o.delta_token_ids for out in outs for o in out.outputs):
                first = time.perf_counter()
        end = time.perf_counter()
        if r:
            runs.append((first - t0, (output_len - 1) / (end - first), steps))
    ttft = statistics.median(r[0] for r in runs)
    tps = statistics.median(r[1] for r in runs)
    wbytes = weight_bytes_per_token(engine)
    return {"input_len": len(prompt), "output_len": output_len, "repeats": repeats, "ttft_s": ttft,
            "ttft_steps": runs[-1][2],
            "decode_tokens_per_s": tps, "weight_bytes_per_token": wbytes,
            "achieved_bandwidth_gb_s": wbytes * tps / 1e9, "runs": runs}


def throughput(engine: LLMEngine, items: list[Item]) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=it.max_tokens, ignore_eos=True) for it in items]
    prompt_tokens = 0
    t0 = time.perf_counter()
    for i, (it, p) in enumerate(zip(items, params)):
        engine.add_request(f"tp-{i}", it.prompt, p)
        prompt_tokens += len(engine.parents[f"tp-{i}"].prompt_token_ids)
    output_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            output_tokens += sum(len(o.delta_token_ids) for o in out.outputs)
    elapsed = time.perf_counter() - t0
    return {"num_requests": len(items), "elapsed_s": elapsed, "requests_per_s": len(items) / elapsed,
            "output_tokens": output_tokens, "prompt_tokens": prompt_tokens,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (output_tokens + prompt_tokens) / elapsed}

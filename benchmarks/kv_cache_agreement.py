#!/usr/bin/env python3
"""Greedy agreement of an 8-bit KV cache with float16: the MT-Bench first turns, rendered with the
model's chat template, answered greedily (MAX_TOKENS new tokens) with each --kv-cache-dtype; per
dtype, the share of answers identical to float16's and the mean share of each answer that matches
float16's before the first differing token. One JSON line per dtype.

    python benchmarks/kv_cache_agreement.py --model MODEL --questions ../shared/data/mt_bench/question.jsonl
"""
import argparse
import json

from tokenmill import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--model", default=None)
ap.add_argument("--questions", required=True, help="MT-Bench question.jsonl")
ap.add_argument("--max-tokens", type=int, default=128)
ap.add_argument("--dtypes", default="float16,int8,fp8_e5m2", help="the first is the reference")
a = ap.parse_args()

questions = [json.loads(line)["turns"][0] for line in open(a.questions) if line.strip()]
sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
answers = {}
for kv in a.dtypes.split(","):
    llm = LLM(a.model, kv_cache_dtype=kv, kv_cache_memory="2GiB")
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], sp, use_tqdm=False)
    answers[kv] = [list(o.outputs[0].token_ids) for o in outs]
    del llm
ref_kv = a.dtypes.split(",")[0]
for kv, got in answers.items():
    same, prefix = 0, 0.0
    for x, y in zip(answers[ref_kv], got):
        same += x == y
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix += n / max(len(x), 1)
    print(json.dumps({"kv_cache_dtype": kv, "reference": ref_kv, "prompts": len(got), "identical": same,
                      "identical_share": round(same / len(got), 3), "mean_matching_prefix": round(prefix / len(got), 3),
                      "max_tokens": a.max_tokens}))

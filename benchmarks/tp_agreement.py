#!/usr/bin/env python3
"""Does TP=N give TP=1's output? 16 everyday prompts through the tokenizer, 64 greedy tokens each,
one engine alive at a time: how many prompts part (and at which token), and the largest logprob
difference over the tokens both runs scored. Appends a JSON line to --out.

    python benchmarks/tp_agreement.py --bits 8 --tp 2 --out benchmarks/results/tp_agreement.jsonl
"""
import argparse
import json

from tokenmill import LLM, SamplingParams
from tokenmill.utils import default_model_path

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:", "Write a haiku about the sea.",
           "Explain why the sky is blue.", "What is 17 times 23?", "Translate 'good morning' to Spanish.",
           "Give me a recipe for pancakes.", "Who wrote Hamlet?", "Describe a cat in one sentence.",
           "import numpy as np\n", "The three laws of motion are", "Once upon a time", "SELECT * FROM",
           "My favourite book is", "The best way to learn Python is"]


def generate(model: str, tp: int, bits: int):
    llm = LLM(model, tensor_parallel_size=tp, activation_bits=bits, kv_cache_memory="256MiB")
    try:
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=3)
        return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = a.model or default_model_path()
    ref, got = generate(model, 1, a.bits), generate(model, a.tp, a.bits)
    first = [next((i for i, (x, y) in enumerate(zip(r.token_ids, g.token_ids)) if x != y), None) for r, g in zip(ref, got)]
    diff = max(abs(p[t].logprob - q[t].logprob) for r, g in zip(ref, got)
               for p, q in zip(r.logprobs, g.logprobs) for t in p if t in q)
    row = {"label": a.label, "tp": a.tp, "activation_bits": a.bits, "prompts": len(PROMPTS),
           "parted": sum(f is not None for f in first), "first_different_token": first, "max_logprob_diff": diff}
    print(row)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

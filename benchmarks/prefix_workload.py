#!/usr/bin/env python3
"""Workload for the shared-prefix benchmark: N requests = one ~1,000-token system prompt + a
distinct question (MT-Bench first turns), as raw completion prompts. Writes JSONL rows
{prompt, max_tokens} for `tokenmill bench serve --workload`. Answers are --max-tokens long (32), or
with --max-tokens-from as long as the same rows of another workload (the shared seeded one: 32-254
tokens): with equal lengths and ignore_eos the 8 clients finish together and their next requests
arrive as one wave, whose prompts then queue behind each other."""
import argparse
import json

from tokenmill.models.gguf_loader import GGUFFile
from tokenmill.models.tokenizer import Tokenizer
from tokenmill.utils import default_model_path

ap = argparse.ArgumentParser()
ap.add_argument("--wikitext", required=True, help="text to cut the system prompt from (wikitext-2 valid.txt)")
ap.add_argument("--mt-bench", required=True)
ap.add_argument("--prefix-tokens", type=int, default=1000)
ap.add_argument("-n", type=int, default=64)
ap.add_argument("--max-tokens", type=int, default=32)
ap.add_argument("--max-tokens-from", default=None, help="a JSONL workload: row i's max_tokens for request i")
ap.add_argument("--out", required=True)
a = ap.parse_args()

tok = Tokenizer.from_gguf(GGUFFile(default_model_path()).meta)
text = open(a.wikitext, encoding="utf-8").read()
ids = tok.encode(text[:20000], add_special_tokens=False)[: a.prefix_tokens]
system = "You are a helpful assistant. Use the following notes when they are relevant.\n" + tok.decode(ids)
questions = [json.loads(line)["turns"][0] for line in open(a.mt_bench, encoding="utf-8")]
lens = [a.max_tokens] * a.n
if a.max_tokens_from:
    lens = [json.loads(line)["max_tokens"] for line in open(a.max_tokens_from, encoding="utf-8")][: a.n]
    if len(lens) < a.n:
        raise SystemExit(f"{a.max_tokens_from} has fewer than {a.n} rows")
with open(a.out, "w", encoding="utf-8") as f:
    for i in range(a.n):
        q = questions[i % len(questions)]
        f.write(json.dumps({"prompt": f"{system}\n\nQuestion {i}: {q}\nAnswer:", "max_tokens": lens[i]}) + "\n")
print(f"wrote {a.n} prompts of ~{len(tok.encode(system))} shared tokens to {a.out}")

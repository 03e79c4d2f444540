#!/usr/bin/env python3
"""Hugging Face transformers `generate` in static batches (left padding, greedy, every request of
a batch runs to the batch's longest max_tokens): the plain-PyTorch serving baseline. Tokens
generated past a request's own max_tokens are not counted. Prints one JSON line."""
import argparse
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--gguf", required=True)
ap.add_argument("--workload", required=True)
ap.add_argument("-n", type=int, default=64)
ap.add_argument("--batch-size", type=int, default=1)
a = ap.parse_args()

torch.set_num_threads(2)
d, f = os.path.split(a.gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
tok.padding_side = "left"
tok.pad_token = tok.pad_token or tok.eos_token
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
rows = [json.loads(line) for line in open(a.workload)][: a.n]
useful = 0
t0 = time.perf_counter()
for i in range(0, len(rows), a.batch_size):
    batch = rows[i:i + a.batch_size]
    enc = tok([r["prompt"] for r in batch], return_tensors="pt", padding=True)
    new = max(r["max_tokens"] for r in batch)
    with torch.no_grad():
        model.generate(**enc, do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.pad_token_id)
    useful += sum(r["max_tokens"] for r in batch)
elapsed = time.perf_counter() - t0
print(json.dumps({"peer": f"transformers bs={a.batch_size}", "num_requests": len(rows), "elapsed_s": elapsed,
                  "output_tokens": useful, "output_tokens_per_s": useful / elapsed}))

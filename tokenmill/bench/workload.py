"""Benchmark workloads: a JSONL file of {"prompt" | "prompt_token_ids", "max_tokens"} rows (the
format of ../shared/bench/workload_*.jsonl), MT-Bench questions, or seeded random token prompts.
A row may also name its `model` (a LoRA adapter, say) and `extra` fields merged into the request
body as sent (a server's own way of selecting adapters, llama-server's "lora" list)."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass
class Item:
    prompt: str | list[int]
    max_tokens: int
    model: str | None = None  # overrides the run's model name
    extra: dict | None = None


def load(path: str | None, n: int, seed: int, input_len: int, output_len: int, vocab_size: int,
         mt_bench: str | None = None) -> list[Item]:
    if path:
        items = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                prompt = row.get("prompt_token_ids") or row["prompt"]
                items.append(Item(prompt, int(row.get("max_tokens") or output_len), row.get("model"), row.get("extra")))
        if not items:
            raise ValueError(f"workload {path} is empty.")
        return [items[i % len(items)] for i in range(n)]
    if mt_bench:
        with open(mt_bench, encoding="utf-8") as f:
            qs = [json.loads(line)["turns"][0] for line in f]
        return [Item(qs[i % len(qs)], output_len) for i in range(n)]
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        length = rng.randint(max(1, input_len // 2), input_len) if n > 1 else input_len
        items.append(Item([rng.randrange(100, vocab_size - 100) for _ in range(length)], output_len))
    return items

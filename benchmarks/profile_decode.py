#!/usr/bin/env python3
"""Where a decode step's time goes: torch.profiler over steps with B running requests whose
context is PROMPT tokens long. Prints the top operators by self CPU time. With --chunk N every
measured step also prefills a new N-token prompt: the mixed steps of a loaded server.

    python benchmarks/profile_decode.py --batch 1 --prompt 32
    python benchmarks/profile_decode.py --batch 16 --prompt 300
    python benchmarks/profile_decode.py --batch 13 --prompt 300 --chunk 195
    python benchmarks/profile_decode.py --batch 1 --prompt 32 --steps 100 --activation-bits 8 --split
"""
import argparse
import json
import time

from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--model", default=None, help="a model file or folder (default: the default model)")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--prompt", type=int, default=32)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--chunk", type=int, default=0, help="a new prompt of this many tokens in every measured step")
ap.add_argument("--quantization", default="auto")
ap.add_argument("--kv-cache-dtype", default="auto")
ap.add_argument("--activation-bits", type=int, default=16)
ap.add_argument("--no-profile", action="store_true", help="time the steps only")
ap.add_argument("--json", action="store_true", help="also one JSON line with the step time (decode_batch.sh)")
ap.add_argument("--split", action="store_true",
                help="instead of the profiler: a step's time in the decode stack, the output head, sampling")
a = ap.parse_args()

llm = LLM(a.model, kv_cache_memory="1GiB", quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
          activation_bits=a.activation_bits)
engine = llm.engine
for i in range(a.batch):
    engine.add_request(f"r{i}", [100 + (i + j) % 40000 for j in range(a.prompt)],
                       SamplingParams(temperature=0, max_tokens=10 * a.steps + 50, ignore_eos=True))
while any(r.num_computed_tokens < r.prompt_len for r in engine.scheduler.requests.values()):
    engine.step()
new_prompts = 0


def step() -> None:
    """One engine step; with --chunk, a fresh prompt (no prefix-cache hit) joins it and ends there."""
    global new_prompts
    if a.chunk:
        new_prompts += 1
        engine.add_request(f"c{new_prompts}", [7 + (new_prompts * 131 + j) % 40000 for j in range(a.chunk)],
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    engine.step()


for _ in range(5):
    step()
t0 = time.perf_counter()
for _ in range(a.steps):
    step()
dt = (time.perf_counter() - t0) / a.steps
print(f"batch {a.batch}, context ~{a.prompt}, new prompt tokens per step {a.chunk}: {dt * 1000:.1f} ms/step "
      f"= {a.batch / dt:.1f} decode tokens/s")
if a.json:
    print(json.dumps({"batch": a.batch, "prompt": a.prompt, "chunk": a.chunk, "ms_per_step": round(dt * 1000, 2),
                      "decode_tok_s": round(a.batch / dt, 1)}))
if a.split:  # wall time per step in each part, by wrapping the engine's calls
    parts: dict[str, float] = {}

    def timed(obj, name: str, key: str) -> None:
        f = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                parts[key] = parts.get(key, 0.0) + time.perf_counter() - t
        setattr(obj, name, wrapper)
    model = engine.runner.model
    if model.decode_stack is not None:
        class Stack:  # a TorchScript class: its methods cannot be replaced, so wrap the object
            def forward(self, *args, inner=model.decode_stack):
                t = time.perf_counter()
                out = inner.forward(*args)
                parts["decode stack"] = parts.get("decode stack", 0.0) + time.perf_counter() - t
                return out
        model.decode_stack = Stack()
    timed(model, "compute_logits", "output head")
    timed(engine.runner, "_sample", "sampling")
    timed(engine, "step", "whole step")
    for _ in range(a.steps):
        step()
    for key, total in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {key:12s} {total / a.steps * 1000:6.2f} ms/step")
    raise SystemExit
if a.no_profile:
    raise SystemExit
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(a.steps):
        step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

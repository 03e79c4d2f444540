#!/usr/bin/env python3
"""Where a decode step's time goes: torch.profiler over steps with B running requests whose
context is PROMPT tokens long. Prints the top operators by self CPU time. With --chunk N every
measured step also prefills a new N-token prompt: the mixed steps of a loaded server.

    python benchmarks/profile_decode.py --batch 1 --prompt 32
    python benchmarks/profile_decode.py --batch 16 --prompt 300
    python benchmarks/profile_decode.py --batch 13 --prompt 300 --chunk 195
"""
import argparse
import time

from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--prompt", type=int, default=32)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--chunk", type=int, default=0, help="a new prompt of this many tokens in every measured step")
ap.add_argument("--quantization", default="auto")
ap.add_argument("--kv-cache-dtype", default="auto")
ap.add_argument("--activation-bits", type=int, default=16)
ap.add_argument("--no-profile", action="store_true", help="time the steps only")
a = ap.parse_args()

llm = LLM(kv_cache_memory="1GiB", quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
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
if a.no_profile:
    raise SystemExit
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(a.steps):
        step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

#!/usr/bin/env bash
# On a CUDA machine, in a few minutes: the GPU-marked tests, then latency and offline throughput of
# the default model on the GPU (bfloat16), written to benchmarks/results/gpu_*.json for RESULTS.md.
# Usage: bash scripts/gpu_check.sh   (after `make install`, or with PY pointing at a Python with tokenmill)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
OUT=$ROOT/benchmarks/results
mkdir -p "$OUT"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device visible to torch")'
"$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'
cd "$ROOT"
"$PY" -m pytest -q -m gpu tests/test_gpu.py
TM=("$PY" -m tokenmill.cli --log-level WARNING)
"${TM[@]}" bench latency --device cuda --dtype bfloat16 --input-len 32 --output-len 256 \
  --output-json "$OUT/gpu_latency.json" >/dev/null
"${TM[@]}" bench throughput --device cuda --dtype bfloat16 --num-prompts 256 --input-len 128 --output-len 128 \
  --max-num-seqs 256 --max-num-batched-tokens 4096 --output-json "$OUT/gpu_throughput.json" >/dev/null
"$PY" - "$OUT" <<'PY'
import json, sys
lat = json.load(open(f"{sys.argv[1]}/gpu_latency.json"))
thr = json.load(open(f"{sys.argv[1]}/gpu_throughput.json"))
print(f"GPU decode {lat['decode_tokens_per_s']:.1f} tok/s (batch 1), TTFT {lat['ttft_s']*1000:.1f} ms; "
      f"offline {thr['output_tokens_per_s']:.0f} output tok/s (256 requests)")
PY

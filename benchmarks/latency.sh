#!/usr/bin/env bash
# Single stream, in-process: `tokenmill bench latency` (32-token prompt, 256 new tokens; and a fresh
# 512-token prompt, prefix caching off, for prompt processing) vs `llama-bench` (tg256, pp512), same
# GGUF, 2 threads, alternated REPS times. ISA=avx2 etc. (common.sh) pins both to one instruction set.
# Writes results/latency[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
REPS=${REPS:-3}
build_llamacpp
out=$RESULTS/latency$SUFFIX.jsonl; : > "$out"
for r in $(seq 1 "$REPS"); do
  OMP_NUM_THREADS=2 "$TM" --log-level WARNING bench latency --model "$MODEL" --input-len 32 --output-len 256 \
     --repeats 1 | "$PY" -c 'import json,sys; d=json.load(sys.stdin); d.pop("runs"); print(json.dumps({"peer": "tokenmill", **d}))' >> "$out"
  OMP_NUM_THREADS=2 "$TM" --log-level WARNING bench latency --model "$MODEL" --input-len 512 --output-len 2 \
     --repeats 1 --no-enable-prefix-caching | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"peer": "tokenmill", "cpu_kernels": d["cpu_kernels"], "prefill_tokens_per_s": d["input_len"] / d["ttft_s"], "ttft_s": d["ttft_s"]}))' >> "$out"
  "$LLAMA_BUILD/bin/llama-bench" -m "$MODEL" -t 2 -p 512 -n 256 -r 1 -o json \
    | "$PY" -c 'import json,sys; rows=json.load(sys.stdin); print(json.dumps({"peer": "llama.cpp", **{r["n_gen"] and "decode_tokens_per_s" or "prefill_tokens_per_s": r["avg_ts"] for r in rows}}))' >> "$out"
done
cat "$out"

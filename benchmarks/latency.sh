#!/usr/bin/env bash
# Single-stream decode, in-process: `tokenmill bench latency` vs `llama-bench`, same GGUF, 2 threads,
# alternated REPS times. Writes results/latency.jsonl.
source "$(dirname "$0")/common.sh"
REPS=${REPS:-3}
build_llamacpp
out=$RESULTS/latency.jsonl; : > "$out"
for r in $(seq 1 "$REPS"); do
  OMP_NUM_THREADS=2 "$TM" --log-level WARNING bench latency --model "$MODEL" --input-len 32 --output-len 256 \
     --repeats 1 | "$PY" -c 'import json,sys; d=json.load(sys.stdin); d.pop("runs"); print(json.dumps({"peer": "tokenmill", **d}))' >> "$out"
  "$LLAMA_BUILD/bin/llama-bench" -m "$MODEL" -t 2 -p 32 -n 256 -r 1 -o json \
    | "$PY" -c 'import json,sys; rows=json.load(sys.stdin); print(json.dumps({"peer": "llama.cpp", **{r["n_gen"] and "decode_tokens_per_s" or "prefill_tokens_per_s": r["avg_ts"] for r in rows}}))' >> "$out"
done
cat "$out"

#!/usr/bin/env bash
# The token budget per step (--max-num-batched-tokens: how long a prompt's chunks are) at real widths
# (#38): one prompt of INPUT_LEN tokens (default 2048) through `bench latency` (prefix cache off) at
# each budget of BUDGETS, against llama-bench's prompt processing of the same length (its own batch of
# 2048 and micro-batch of 512), alternated REPS times, one engine at a time, 2 threads. Files:
# MODELS_LIST (default: real_sizes.sh's 1B and 3B Q4_K_M files under MODELS).
#   MODELS=/path/for/files bash benchmarks/chunk_size.sh      -> results/chunk_size[-ISA].jsonl
source "$(dirname "$0")/common.sh"
REPS=${REPS:-1}; INPUT_LEN=${INPUT_LEN:-2048}; BUDGETS=${BUDGETS:-"256 512 1024 2048"}
MODELS=${MODELS:-$ROOT/models}
build_llamacpp
list=${MODELS_LIST:-"$(ls "$MODELS"/llama-1b-q4_k_m.gguf "$MODELS"/llama-3b-q4_k_m.gguf 2>/dev/null | tr '\n' ' ')"}
out=$RESULTS/chunk_size$SUFFIX.jsonl; : > "$out"
for model in $list; do
  for r in $(seq 1 "$REPS"); do
    for budget in $BUDGETS; do
      OMP_NUM_THREADS=2 "$TM" --log-level WARNING bench latency --model "$model" --input-len "$INPUT_LEN" \
        --output-len 2 --repeats 1 --no-enable-prefix-caching --max-num-batched-tokens "$budget" \
        --weight-cache "$MODELS/.weight-cache" \
        | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"peer": "tokenmill", "model": sys.argv[1], "budget": int(sys.argv[2]), "isa": d["cpu_kernels"], "prompt_tokens_per_s": round(d["input_len"] / d["ttft_s"], 1)}))' \
          "$(basename "$model")" "$budget" | tee -a "$out"
    done
    "$LLAMA_BUILD/bin/llama-bench" -m "$model" -t 2 -p "$INPUT_LEN" -n 0 -r 1 -o json \
      | "$PY" -c 'import json,sys; print(json.dumps({"peer": "llama.cpp", "model": sys.argv[1], "prompt_tokens_per_s": round(json.load(sys.stdin)[0]["avg_ts"], 1)}))' \
        "$(basename "$model")" | tee -a "$out"
  done
done

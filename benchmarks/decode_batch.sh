#!/usr/bin/env bash
# Decode steps of B sequences at once (the steps of a server with B streams, no prompt in them):
# tokenmill with its default kernels (on the amx variant: AMX tiles from kernels.amx_rows rows) and
# with TOKENMILL_AMX=0 (the integer kernels for every row count), vs llama.cpp's llama-batched-bench
# (B parallel sequences' generation, S_TG), same GGUF, 2 threads, a 128-token prompt per sequence.
# BATCHES (default "8 12 16 24"), REPS (default 1), TAG: a suffix for the results file.
# Writes results/decode_batch[_TAG][-ISA].jsonl.
source "$(dirname "$0")/common.sh"
BATCHES=${BATCHES:-8 12 16 24}; REPS=${REPS:-1}; STEPS=${STEPS:-24}
build_llamacpp
out=$RESULTS/decode_batch${TAG:+_$TAG}$SUFFIX.jsonl; : > "$out"
for r in $(seq 1 "$REPS"); do
  for b in $BATCHES; do
    for amx in 1 0; do
      TOKENMILL_AMX=$amx OMP_NUM_THREADS=2 "$PY" "$HERE/profile_decode.py" --model "$MODEL" --batch "$b" --prompt 128 \
        --steps "$STEPS" --no-profile --json 2>/dev/null | tail -1 \
        | "$PY" -c 'import json,sys; print(json.dumps({"peer": "tokenmill", "model": sys.argv[1], "tiles": sys.argv[2] == "1", **json.load(sys.stdin)}))' \
          "$(basename "$MODEL")" "$amx" >> "$out"
    done
    "$LLAMA_BUILD/bin/llama-batched-bench" -m "$MODEL" -t 2 -tb 2 -c $((b * 160)) -npp 128 -ntg "$STEPS" -npl "$b" \
      --output-format jsonl 2>/dev/null | grep '^{' \
      | "$PY" -c 'import json,sys; d=json.loads(sys.stdin.readline()); print(json.dumps({"peer": "llama.cpp", "model": sys.argv[1], "batch": d["pl"], "ms_per_step": round(d["t_tg"] / d["tg"] * 1000, 2), "decode_tok_s": round(d["speed_tg"], 1)}))' \
        "$(basename "$MODEL")" >> "$out"
  done
done
cat "$out"

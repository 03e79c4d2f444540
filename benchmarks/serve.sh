#!/usr/bin/env bash
# Online serving at C concurrent streams: tokenmill serve vs llama.cpp's llama-server -np C, one
# server alive at a time, alternated REPS times, same workload and client (`tokenmill bench serve`).
# TM_ARGS: extra flags for tokenmill serve (e.g. "--activation-bits 8"), TAG: a suffix for the results file.
# Writes results/serve_c$C[_TAG][-ISA].jsonl.
source "$(dirname "$0")/common.sh"
C=${C:-16}; N=${N:-64}; TM_ARGS=${TM_ARGS:-}; REPS=${REPS:-2}
build_llamacpp
# INPUT_LEN (and OUTPUT_LEN, default 64): N seeded random-token prompts of exactly INPUT_LEN tokens instead
# of WORKLOAD's text (e.g. #38's 16 streams of 256 in / 64 out on a real-size file: MODEL=.../llama-1b-q4_k_m.gguf)
if [ -n "${INPUT_LEN:-}" ]; then
  WORKLOAD=$RESULTS/.workload_${INPUT_LEN}in_${OUTPUT_LEN:-64}out_n$N.jsonl
  "$PY" -c 'import json, random, sys
path, n_in, n_out, n = sys.argv[1], *map(int, sys.argv[2:])
rng = random.Random(0)
with open(path, "w") as f:
    for _ in range(n):
        f.write(json.dumps({"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(n_in)], "max_tokens": n_out}) + "\n")
' "$WORKLOAD" "$INPUT_LEN" "${OUTPUT_LEN:-64}" "$N"
fi
out=$RESULTS/serve_c$C${TAG:+_$TAG}$SUFFIX.jsonl; : > "$out"
bench() { bench_serve "$1" "$2" "$WORKLOAD" "$C" "$N" "$out"; }  # name url
for r in $(seq 1 "$REPS"); do
  "$TM" --log-level WARNING serve --model "$MODEL" --port 8020 --served-model-name smollm2 --max-num-seqs "$C" $TM_ARGS &
  pid=$!; wait_health http://127.0.0.1:8020; bench "tokenmill${TM_ARGS:+ $TM_ARGS}" http://127.0.0.1:8020; stop $pid
  "$LLAMA_BUILD/bin/llama-server" -m "$MODEL" --alias smollm2 -t 2 -tb 2 -c $((C * 1024)) -np "$C" \
     --no-cache-prompt -cram 0 --no-webui --host 127.0.0.1 --port 8081 > /dev/null 2>&1 &
  pid=$!; wait_health http://127.0.0.1:8081; bench llama-server http://127.0.0.1:8081; stop $pid
done
summarize_serve "$out"

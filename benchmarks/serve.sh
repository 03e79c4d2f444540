#!/usr/bin/env bash
# Online serving at C concurrent streams: tokenmill serve vs llama.cpp's llama-server -np C, one
# server alive at a time, alternated REPS times, same workload and client (`tokenmill bench serve`).
# TM_ARGS: extra flags for tokenmill serve (e.g. "--activation-bits 8"), TAG: a suffix for the results file.
# Writes results/serve_c$C[_TAG][-ISA].jsonl.
source "$(dirname "$0")/common.sh"
C=${C:-16}; N=${N:-64}; TM_ARGS=${TM_ARGS:-}; REPS=${REPS:-2}
build_llamacpp
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

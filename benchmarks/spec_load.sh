#!/usr/bin/env bash
# Speculation under load: tokenmill serve with and without prompt-lookup drafts at C concurrent
# streams on the canonical workload (benchmarks' `bench serve`, EOS ignored), one server alive at a
# time, alternated REPS times. The adaptive draft policy should make the two equal (goal: with
# drafts >= 0.97x without). SPEC: the speculative config. Writes results/spec_load_c$C[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
C=${C:-16}; N=${N:-64}; REPS=${REPS:-2}
SPEC=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'}
out=$RESULTS/spec_load_c$C$SUFFIX.jsonl; : > "$out"
for r in $(seq 1 "$REPS"); do
  for mode in off ngram; do
    args=(); [ $mode = off ] || args=(--speculative-config "$SPEC")
    "$TM" --log-level WARNING serve --model "$MODEL" --port 8020 --served-model-name smollm2 --max-num-seqs "$C" \
      "${args[@]}" &
    pid=$!; wait_health http://127.0.0.1:8020
    bench_serve "tokenmill $mode" http://127.0.0.1:8020 "$WORKLOAD" "$C" "$N" "$out"; stop $pid
  done
done
summarize_serve "$out"

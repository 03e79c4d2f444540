#!/usr/bin/env bash
# Shared 1,000-token system prompt, 64 distinct questions, 8 concurrent clients: TTFT with prefix
# caching on vs off (tokenmill) vs llama.cpp's llama-server --parallel 8 (its per-slot prompt cache
# on). One server alive at a time. Answer lengths as in the shared seeded workload (32-254 tokens):
# results/prefix_cache.jsonl. LENGTHS=N: every answer N tokens (results/prefix_cache_lenN.jsonl) --
# with equal lengths the 8 clients finish together and each wave of prompts queues behind itself.
source "$(dirname "$0")/common.sh"
C=${C:-8}; N=${N:-64}; LENGTHS=${LENGTHS:-shared}
build_llamacpp
if [ "$LENGTHS" = shared ]; then
  W=$RESULTS/prefix_workload.jsonl; out=$RESULTS/prefix_cache.jsonl; lens=(--max-tokens-from "$WORKLOAD")
else
  W=$RESULTS/prefix_workload_len$LENGTHS.jsonl; out=$RESULTS/prefix_cache_len$LENGTHS.jsonl; lens=(--max-tokens "$LENGTHS")
fi
"$PY" "$HERE/prefix_workload.py" --wikitext "$SHARED/data/wikitext-2/valid.txt" --mt-bench "$SHARED/data/mt_bench/question.jsonl" \
  -n "$N" "${lens[@]}" --out "$W"
: > "$out"
bench() { bench_serve "$1" "$2" "$W" "$C" "$N" "$out"; }  # name url
for flag in --enable-prefix-caching --no-enable-prefix-caching; do
  "$TM" --log-level WARNING serve --model "$MODEL" --port 8020 --served-model-name smollm2 $flag &
  pid=$!; wait_health http://127.0.0.1:8020; bench "tokenmill $flag" http://127.0.0.1:8020; stop $pid
done
"$LLAMA_BUILD/bin/llama-server" -m "$MODEL" --alias smollm2 -t 2 -tb 2 -c $((C * 2048)) -np "$C" \
   --no-webui --host 127.0.0.1 --port 8081 > /dev/null 2>&1 &
pid=$!; wait_health http://127.0.0.1:8081; bench "llama-server -np $C" http://127.0.0.1:8081; stop $pid
"$PY" - "$out" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['peer']:32s} TTFT p50 {r['ttft_p50_s']:.3f}s p99 {r['ttft_p99_s']:.3f}s  out tok/s {r['output_tokens_per_s']:.1f}")
PY

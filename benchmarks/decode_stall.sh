#!/usr/bin/env bash
# While 8 streams decode, a ~2,000-token prompt arrives: p99 inter-token latency of the running
# streams with chunked prefill (the default token budget) vs without (a budget that takes the whole
# prompt in one step) vs llama.cpp's llama-server. Writes results/decode_stall.jsonl.
source "$(dirname "$0")/common.sh"
build_llamacpp
out=$RESULTS/decode_stall.jsonl; : > "$out"
LONG=$SHARED/data/wikitext-2/test.txt
run() { "$PY" "$HERE/decode_stall.py" --base-url "$1" --long-prompt-file "$LONG" --label "$2" >> "$out"; }
for budget in default 4096; do
  extra=(); [ "$budget" = default ] || extra=(--max-num-batched-tokens "$budget")
  "$TM" --log-level WARNING serve --model "$MODEL" --port 8020 --served-model-name smollm2 "${extra[@]}" &
  pid=$!; wait_health http://127.0.0.1:8020; run http://127.0.0.1:8020 "tokenmill budget=$budget"; stop $pid
done
"$LLAMA_BUILD/bin/llama-server" -m "$MODEL" --alias smollm2 -t 2 -tb 2 -c 18432 -np 9 \
   --no-webui --host 127.0.0.1 --port 8081 > /dev/null 2>&1 &
pid=$!; wait_health http://127.0.0.1:8081; run http://127.0.0.1:8081 "llama-server -np 9"; stop $pid
cat "$out"

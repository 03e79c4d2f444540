#!/usr/bin/env bash
# A ~4,096-token prompt arriving while 8 streams decode (#38), on a real-size file (default: the 3B
# Q4_K_M of real_sizes.sh): the long prompt's latency (its TTFT) and the running streams' inter-token
# latency before it arrived and while it is prefilled, tokenmill (default settings; SETTINGS adds others
# as flag=value, e.g. "default long-prefill-slowdown=0 max-num-batched-tokens=64") then llama-server
# (-np 9), one server alive at a time. decode_stall.py measures; writes results/long_prompt.jsonl.
#   MODELS=/path/for/files bash benchmarks/long_prompt.sh
source "$(dirname "$0")/common.sh"
build_llamacpp
MODELS=${MODELS:-$ROOT/models}
FILE=${FILE:-$MODELS/llama-3b-q4_k_m.gguf}
WORDS=${WORDS:-3000}   # WikiText-2 words: ~4,100 tokens with the files' tokenizer
SETTINGS=${SETTINGS:-default}
out=$RESULTS/long_prompt.jsonl; : > "$out"
LONG=$SHARED/data/wikitext-2/test.txt
run() { "$PY" "$HERE/decode_stall.py" --base-url "$1" --model-name m --long-prompt-file "$LONG" --long-words "$WORDS" \
          --max-tokens 400 --delay "${DELAY:-20}" --label "$2" | tee -a "$out"; }
for setting in $SETTINGS; do
  extra=(); [ "$setting" = default ] || extra=("--${setting%%=*}" "${setting#*=}")
  "$TM" --log-level WARNING serve --model "$FILE" --port 8020 --served-model-name m --kv-cache-memory 3GiB \
     --weight-cache "$MODELS/.weight-cache" "${extra[@]}" &
  pid=$!; wait_health http://127.0.0.1:8020 600; run http://127.0.0.1:8020 "tokenmill $setting"; stop $pid
done
"$LLAMA_BUILD/bin/llama-server" -m "$FILE" --alias m -t 2 -tb 2 -c 45000 -np 9 \
   --no-webui --host 127.0.0.1 --port 8081 > /dev/null 2>&1 &
pid=$!; wait_health http://127.0.0.1:8081 600; run http://127.0.0.1:8081 "llama-server -np 9"; stop $pid

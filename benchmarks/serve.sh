#!/usr/bin/env bash
# Online serving at C concurrent streams: tokenmill serve vs llama.cpp's llama-server -np C, one
# server alive at a time, alternated REPS times, same workload and client (`tokenmill bench serve`).
# Writes results/serve_c$C.jsonl.
source "$(dirname "$0")/common.sh"
C=${C:-16}; N=${N:-64}; REPS=${REPS:-2}
build_llamacpp
out=$RESULTS/serve_c$C.jsonl; : > "$out"
bench() {  # name url
  "$TM" bench serve --base-url "$2" --model-name smollm2 --workload "$WORKLOAD" --num-prompts "$N" \
     --concurrency "$C" --output-json "$RESULTS/.last.json" > /dev/null
  "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1]))["runs"][0]; print(json.dumps({"peer": sys.argv[2], **d}))' \
     "$RESULTS/.last.json" "$1" >> "$out"
}
for r in $(seq 1 "$REPS"); do
  "$TM" --log-level WARNING serve --model "$MODEL" --port 8020 --served-model-name smollm2 --max-num-seqs "$C" &
  pid=$!; wait_health http://127.0.0.1:8020; bench tokenmill http://127.0.0.1:8020; stop $pid
  "$PEERS/llama.cpp-build/bin/llama-server" -m "$MODEL" --alias smollm2 -t 2 -tb 2 -c $((C * 1024)) -np "$C" \
     --no-cache-prompt -cram 0 --no-webui --host 127.0.0.1 --port 8081 > /dev/null 2>&1 &
  pid=$!; wait_health http://127.0.0.1:8081; bench llama-server http://127.0.0.1:8081; stop $pid
done
"$PY" - "$out" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
for peer in dict.fromkeys(r["peer"] for r in rows):
    rs = [r for r in rows if r["peer"] == peer]
    med = lambda k: statistics.median(r[k] for r in rs)
    print(f"{peer:14s} out tok/s {med('output_tokens_per_s'):7.1f}  TTFT p50 {med('ttft_p50_s'):6.2f}s p99 "
          f"{med('ttft_p99_s'):6.2f}s  ITL p99 {med('itl_p99_s'):.3f}s  short {max(r['short_outputs'] for r in rs)}")
PY

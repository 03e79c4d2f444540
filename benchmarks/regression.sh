#!/usr/bin/env bash
# An older tokenmill (BASE, a commit) against this checkout on this host, alternated REPS times:
# `bench latency` (32+256), `bench throughput` (64 requests of the shared workload) and `serve` at 16
# streams, one server alive at a time. The old version runs from a git worktree in .peers/ through
# PYTHONPATH, in the same venv (older commits build their kernels with -march=native). ISA= as in
# common.sh pins this checkout's kernels (and PyTorch's). Writes results/regression[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
BASE=${BASE:?set BASE to the commit to compare against}; REPS=${REPS:-2}
old=$PEERS/base-$BASE
[ -d "$old" ] || git -C "$ROOT" worktree add -q --detach "$old" "$BASE"
out=$RESULTS/regression$SUFFIX.jsonl; : > "$out"
tag() { "$PY" -c 'import json,sys; d=json.load(sys.stdin); d.pop("runs",None); d.pop("ttft_values",None); print(json.dumps({"version": sys.argv[1], "bench": sys.argv[2], **d}))' "$@"; }
run() {  # version-name pythonpath
  OMP_NUM_THREADS=2 PYTHONPATH=$2 "$TM" --log-level WARNING bench latency --model "$MODEL" --input-len 32 --output-len 256 \
    --repeats 1 | tag "$1" latency >> "$out"
  OMP_NUM_THREADS=2 PYTHONPATH=$2 "$TM" --log-level WARNING bench throughput --model "$MODEL" --workload "$WORKLOAD" \
    --num-prompts 64 | tag "$1" throughput >> "$out"
  PYTHONPATH=$2 "$TM" --log-level WARNING serve --model "$MODEL" --port 8020 --served-model-name smollm2 --max-num-seqs 16 &
  pid=$!; wait_health http://127.0.0.1:8020
  "$TM" bench serve --base-url http://127.0.0.1:8020 --model-name smollm2 --workload "$WORKLOAD" --num-prompts 64 \
    --concurrency 16 --output-json "$RESULTS/.last.json" > /dev/null
  "$PY" -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["runs"][0]))' "$RESULTS/.last.json" | tag "$1" "serve c16" >> "$out"
  stop $pid
}
for r in $(seq 1 "$REPS"); do run "$BASE" "$old"; run "this checkout" ""; done
"$PY" - "$out" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    v = d["decode_tokens_per_s"] if d["bench"] == "latency" else d["output_tokens_per_s"]
    print(f'{d["version"]:16s} {d["bench"]:10s} {v:7.1f} tok/s')
PY

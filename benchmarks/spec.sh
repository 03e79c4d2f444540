#!/usr/bin/env bash
# Speculative decoding, single stream: tokenmill with and without prompt lookup (and a draft model
# when DRAFT is set) against llama.cpp's llama-server with and without its n-gram drafts, on
# input-grounded prompts (rename a variable in a stdlib function) and MT-Bench second turns. One
# server alive at a time, alternated REPS times, same prompts and client (spec_client.py).
# MODEL: the target GGUF (default: the default model); NAME: a label for the results file;
# DRAFT: a draft model for tokenmill (JSON fields added to its config, e.g. '"model": "/d.gguf"');
# K: drafts per step; TM_ARGS: flags for tokenmill's target (e.g. "--quantization none"); LLAMA=0 skips
# llama-server (when the targets would not compare). Writes results/spec_$NAME[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
NAME=${NAME:-smollm2}; REPS=${REPS:-2}; K=${K:-4}; N_CODE=${N_CODE:-8}; N_MT=${N_MT:-10}; DRAFT=${DRAFT:-}
TM_ARGS=${TM_ARGS:-}; LLAMA=${LLAMA:-1}
[ "$LLAMA" = 0 ] || build_llamacpp
out=$RESULTS/spec_$NAME$SUFFIX.jsonl; : > "$out"
code=$RESULTS/spec_prompts_code.jsonl; mt=$RESULTS/spec_prompts_mtbench_$NAME.jsonl
[ -f "$code" ] || "$PY" "$HERE/spec_prompts.py" --set code --n "$N_CODE" --out "$code"
[ -f "$mt" ] || "$PY" "$HERE/spec_prompts.py" --set mtbench --model "$MODEL" --n "$N_MT" \
  --questions "$SHARED/data/mt_bench/question.jsonl" --out "$mt"
measure() {  # label url
  for set in code mtbench; do
    p=$code; [ $set = mtbench ] && p=$mt
    "$PY" "$HERE/spec_client.py" --base-url "$2" --prompts "$p" --label "$1" --set $set --out "$out"
  done
}
tm() {  # label [speculative config]
  "$TM" --log-level WARNING serve --model "$MODEL" --port 8020 --served-model-name default --max-num-seqs 16 \
    $TM_ARGS ${2:+--speculative-config "$2"} &
  pid=$!; wait_health http://127.0.0.1:8020; measure "$1" http://127.0.0.1:8020; stop $pid
}
llama() {  # label [llama-server flags...]
  local label=$1; shift
  "$LLAMA_BUILD/bin/llama-server" -m "$MODEL" --alias default -t 2 -tb 2 -c 8192 -np 1 --no-cache-prompt -cram 0 \
    --no-webui --host 127.0.0.1 --port 8081 "$@" > /dev/null 2>&1 &
  pid=$!; wait_health http://127.0.0.1:8081; measure "$label" http://127.0.0.1:8081; stop $pid
}
NGRAM="{\"method\": \"ngram\", \"num_speculative_tokens\": $K, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}"
for r in $(seq 1 "$REPS"); do
  tm tokenmill
  tm "tokenmill ngram k=$K" "$NGRAM"
  [ -z "$DRAFT" ] || tm "tokenmill draft k=$K" "{\"method\": \"draft_model\", \"num_speculative_tokens\": $K, $DRAFT}"
  [ "$LLAMA" = 1 ] || continue
  llama llama-server
  llama "llama-server ngram-simple" --spec-type ngram-simple
  llama "llama-server ngram-mod (--spec-default)" --spec-default
done
"$PY" - "$out" <<'EOF'
import collections, json, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs[(r["label"], r["set"])].append(r)
base = {s: statistics.median(x["decode_tokens_per_s"] for x in runs[("tokenmill", s)]) for s in ("code", "mtbench")}
llama = {s: statistics.median(x["decode_tokens_per_s"] for x in runs[("llama-server", s)]) if ("llama-server", s) in runs
         else float("nan") for s in ("code", "mtbench")}
print("| server | set | decode tok/s (median) | vs tokenmill plain | vs llama-server plain | acceptance |")
print("| --- | --- | --- | --- | --- | --- |")
for (label, s), rs in runs.items():
    tps = statistics.median(x["decode_tokens_per_s"] for x in rs)
    acc = [x["acceptance_rate"] for x in rs if "acceptance_rate" in x]
    print(f"| {label} | {s} | {tps:.1f} | {tps / base[s]:.2f}x | {tps / llama[s]:.2f}x | "
          f"{statistics.median(acc):.2f} |" if acc else f"| {label} | {s} | {tps:.1f} | {tps / base[s]:.2f}x | "
          f"{tps / llama[s]:.2f}x | - |")
EOF

#!/usr/bin/env bash
# Embeddings per second on one BERT file (bge-small's shape, random weights: benchmarks/make_bert.py
# writes it as a GGUF and as a sentence-transformers directory from the same weights): tokenmill serve
# and llama.cpp's llama-server --embeddings on the GGUF, C concurrent clients posting one text each
# (embed_client.py), one server alive at a time, alternated REPS times; and sentence-transformers'
# encode (batch 32, in-process, float32) on the directory. Short texts (32 tokens), one per request
# (queries) and 32 per request (an indexer's batches, BATCH), and long ones (512 tokens, one per request).
# tokenmill runs once per configuration: float32 (the default), int8 weights with 8-bit activations
# (llama.cpp's Q8 arithmetic) and, where the CPU has AVX512-BF16 or AMX, bfloat16; embed_accuracy.py
# (results/embed-$SHAPE-accuracy.jsonl) gives each one's cosine to sentence-transformers' float32. SHAPE=small|base, TYPE=F16|F32 (the GGUF's matrices).
# Writes results/embed-$SHAPE[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
C=${C:-16}; REPS=${REPS:-2}; SHAPE=${SHAPE:-small}; TYPE=${TYPE:-F16}
SHORT_N=${SHORT_N:-512}; LONG_N=${LONG_N:-64}; BATCH=${BATCH:-32}
CONFIGS=("float32|" "int8|--quantization int8 --activation-bits 8")
grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && CONFIGS+=("bfloat16|--dtype bfloat16")
build_llamacpp
dir=$HERE/.models/bert-$SHAPE
gguf=$dir/model-$(echo "$TYPE" | tr 'A-Z' 'a-z').gguf
[ -f "$gguf" ] || "$PY" "$HERE/make_bert.py" --shape "$SHAPE" --type "$TYPE" "$dir" > /dev/null
out=$RESULTS/embed-$SHAPE$SUFFIX.jsonl; : > "$out"
pid=""; trap '[ -n "$pid" ] && stop $pid' EXIT  # a failed run leaves no server behind
client() { "$PY" "$HERE/embed_client.py" "$@" >> "$out"; tail -1 "$out"; }
both() {  # url peer: short texts, one and BATCH per request, then long ones
  client server "$1" --words 30 --num "$SHORT_N" --concurrency "$C" --peer "$2"
  client server "$1" --words 30 --num $((SHORT_N * 4)) --concurrency "$C" --batch "$BATCH" --peer "$2"
  client server "$1" --words 510 --num "$LONG_N" --concurrency "$C" --peer "$2"
}
for r in $(seq 1 "$REPS"); do
  for cfg in "${CONFIGS[@]}"; do
    "$TM" --log-level WARNING serve --model "$gguf" --served-model-name bench --port 8020 --max-num-seqs "$C" \
      --max-num-batched-tokens 2048 ${cfg#*|} &
    pid=$!; wait_health http://127.0.0.1:8020; both http://127.0.0.1:8020 "tokenmill ${cfg%%|*}"; stop $pid
  done
  # -np C slots of 512 tokens; a batch of 2048 tokens per step, as tokenmill's
  "$LLAMA_BUILD/bin/llama-server" -m "$gguf" --alias bench --embeddings -t 2 -tb 2 -c $((C * 512)) -np "$C" \
     -b 2048 -ub 2048 --no-webui --host 127.0.0.1 --port 8081 > /dev/null 2>&1 &
  pid=$!; wait_health http://127.0.0.1:8081; both http://127.0.0.1:8081 llama-server; stop $pid; pid=""
  client st "$dir/hf" --words 30 --num "$SHORT_N" --peer sentence-transformers
  client st "$dir/hf" --words 510 --num "$LONG_N" --peer sentence-transformers
done
"$PY" "$HERE/embed_accuracy.py" "$gguf" "$dir/hf" "${CONFIGS[@]}" > "$RESULTS/embed-$SHAPE-accuracy$SUFFIX.jsonl"
cat "$RESULTS/embed-$SHAPE-accuracy$SUFFIX.jsonl"
"$PY" - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
peers = list(dict.fromkeys(r["peer"] for r in rows))
def ok(r, n, b, p):  # sentence-transformers batches 32 in-process: its one row per length serves both
    return r["peer"] == p and r["tokens_per_text"] == n and (r["batch"] == b or p == "sentence-transformers")
for n, b in sorted({(r["tokens_per_text"], r["batch"]) for r in rows if r["peer"] != "sentence-transformers"}):
    med = {p: statistics.median(r["embeddings_per_s"] for r in rows if ok(r, n, b, p)) for p in peers}
    print(f"{n} tokens/text, {b} per request: " + ", ".join(f"{p} {v:.1f}/s" for p, v in med.items()))
    for p in peers:
        if p.startswith("tokenmill"):
            print(f"  {p}: {med[p] / med['llama-server']:.2f}x llama-server, "
                  f"{med[p] / med['sentence-transformers']:.2f}x sentence-transformers")
PY

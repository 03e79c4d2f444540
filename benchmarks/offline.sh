#!/usr/bin/env bash
# Offline throughput on the canonical workload: `tokenmill bench throughput` (64 requests) vs
# Hugging Face transformers `generate` in static batches (hf_offline.py). BITS: tokenmill's activation
# widths to run (default "16 8"), BATCHES: HF's static batch sizes beside bs=1 (default "8 32").
# Writes results/offline[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
N=${N:-64}; BITS=${BITS:-16 8}; BATCHES=${BATCHES-8 32}
out=$RESULTS/offline$SUFFIX.jsonl; : > "$out"
for bits in $BITS; do  # default 16-bit activations in the int kernels; 8 = llama.cpp's arithmetic
  "$TM" --log-level WARNING bench throughput --model "$MODEL" --workload "$WORKLOAD" --num-prompts "$N" \
    --activation-bits "$bits" \
    | "$PY" -c 'import json,sys; print(json.dumps({"peer": "tokenmill --activation-bits " + sys.argv[1], **json.load(sys.stdin)}))' "$bits" >> "$out"
done
# transformers imports any importable module named `kernels`: none may sit in benchmarks/
# batch size 1 on 16 requests (its rate is flat in N; 64 would take ~10 minutes)
"$PY" "$HERE/hf_offline.py" --gguf "$MODEL" --workload "$WORKLOAD" -n 16 --batch-size 1 >> "$out"
for bs in $BATCHES; do
  "$PY" "$HERE/hf_offline.py" --gguf "$MODEL" --workload "$WORKLOAD" -n "$N" --batch-size "$bs" >> "$out"
done
cat "$out"

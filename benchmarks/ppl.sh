#!/usr/bin/env bash
# Perplexity of the default model on WikiText-2 test: the dequantized float path (--quantization none)
# vs the int4/int8 kernels (auto) with 16-bit (default) and 8-bit activations. Writes results/ppl[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
TOKENS=${TOKENS:-8192}
out=$RESULTS/ppl$SUFFIX.jsonl; : > "$out"
for run in "none 16" "auto 16" "auto 8"; do
  set -- $run
  "$TM" --log-level WARNING eval ppl --model "$MODEL" --data "$SHARED/data/wikitext-2/test.txt" --quantization "$1" \
    --activation-bits "$2" --max-tokens "$TOKENS" --context-len 512 --stride 256 >> "$out"
done
cat "$out"

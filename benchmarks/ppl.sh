#!/usr/bin/env bash
# Perplexity of the default model on WikiText-2 test: the dequantized float path (--quantization none)
# vs the int4/int8 kernels (auto). Writes results/ppl.jsonl.
source "$(dirname "$0")/common.sh"
TOKENS=${TOKENS:-8192}
out=$RESULTS/ppl.jsonl; : > "$out"
for q in none auto; do
  "$TM" --log-level WARNING eval ppl --model "$MODEL" --data "$SHARED/data/wikitext-2/test.txt" --quantization "$q" \
    --max-tokens "$TOKENS" --context-len 512 --stride 256 >> "$out"
done
cat "$out"

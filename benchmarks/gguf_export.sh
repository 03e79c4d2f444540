#!/usr/bin/env bash
# A model quantized by tokenmill runs in llama.cpp: `quantize --output-format gguf` for each model and
# method, then llama.cpp's llama-perplexity and `tokenmill eval ppl --scoring chunks` (the same recipe:
# chunks of 512, second half scored) on the first CHUNKS chunks of WikiText-2 test, both on that file.
# Calibration: the mixed set of quantize_ood.sh. Writes results/gguf_export.jsonl.
source "$(dirname "$0")/common.sh"
CHUNKS=${CHUNKS:-16}
METHODS=${METHODS:-"gptq awq rtn-int4"}
GROUP=${GROUP:-128}
MODELS=${MODELS:-"$MODEL $ROOT/models/qwen2.5-coder-0.5b-instruct.gguf"}
OUT=${OUT:-$HERE/.quantized}
build_llamacpp
[ -x "$LLAMA_BUILD/bin/llama-perplexity" ] || cmake --build "$LLAMA_BUILD" -j 2 --target llama-perplexity
mkdir -p "$OUT"
calib_texts "$OUT/texts"
read -r -a calib <<< "$(mixed_calib "$OUT/texts")"
TEXT=$SHARED/data/wikitext-2/test.txt
res=$RESULTS/gguf_export.jsonl; : > "$res"
for model in $MODELS; do
  for m in $METHODS; do
    file=$OUT/$(basename "$model" .gguf)-$m-g$GROUP.gguf
    args=(--method "$m" --group-size "$GROUP" --allow-partial-groups)
    [ "$m" = rtn-int4 ] || args+=("${calib[@]}")
    [ -f "$file" ] || "$TM" --log-level WARNING quantize --model "$model" --output "$file" --output-format gguf \
      --quiet "${args[@]}" > /dev/null
    lp=$("$LLAMA_BUILD/bin/llama-perplexity" -m "$file" -f "$TEXT" -c 512 -t 2 --chunks "$CHUNKS" 2>&1 |
         grep -o 'Final estimate: PPL = [0-9.]*' | grep -o '[0-9.]*$')
    tp=$("$TM" --log-level WARNING eval ppl --model "$file" --data "$TEXT" --scoring chunks --context-len 512 \
         --max-tokens $((CHUNKS * 512)) --quantization none 2>/dev/null |
         "$PY" -c 'import json,sys; print(json.load(sys.stdin)["perplexity"])')
    echo "{\"model\": \"$(basename "$model")\", \"method\": \"$m\", \"group\": $GROUP, \"llama_perplexity\": ${lp:-null}, \"tokenmill\": $tp}" >> "$res"
    tail -1 "$res"
  done
done

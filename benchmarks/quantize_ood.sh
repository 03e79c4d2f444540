#!/usr/bin/env bash
# Does int4 quantization hold on text it was not calibrated on? For each model (default: the default
# model and Qwen2.5-Coder-0.5B from `make qwen`, its K-quant weights dequantized as the float source),
# group size and method (RTN, AWQ, GPTQ), quantize with `tokenmill quantize`, then score the
# dequantized weights (`eval ppl --quantization none`, windows of 512, stride 256) on two texts:
#   wiki: the first TOKENS tokens of WikiText-2 test (the calibration text's own domain)
#   docs: the first TOKENS tokens of Python's language reference (pydoc_data.topics, shipped with
#         CPython): English prose of software documentation, another domain
# Calibration (CALIB=mix, the default): WikiText-2 valid + CPython's standard-library source (code) +
# MT-Bench's user turns rendered with the model's chat template, windows drawn equally from each;
# CALIB=wiki: WikiText-2 valid alone. QUANT_ARGS: more quantize flags for the calibrated methods (an
# ablation, e.g. "--no-act-order --hessian-shrink 0"), TAG names that run. Writes
# results/quantize_ood-CALIB[-TAG].jsonl (a rerun replaces its models' rows); a quantized model already
# in OUT is scored, not made again.
source "$(dirname "$0")/common.sh"
TOKENS=${TOKENS:-6000}
GROUP_SIZES=${GROUP_SIZES:-"32 64 128"}
METHODS=${METHODS:-"rtn-int4 awq gptq"}
CALIB=${CALIB:-mix}
SAMPLES=${SAMPLES:-128}
MODELS=${MODELS:-"$MODEL $ROOT/models/qwen2.5-coder-0.5b-instruct.gguf"}
OUT=${OUT:-$HERE/.quantized}
mkdir -p "$OUT"
texts=$OUT/texts
calib_texts "$texts"
calib=(--calib "$SHARED/data/wikitext-2/valid.txt")
[ "$CALIB" = mix ] && read -r -a calib <<< "$(mixed_calib "$texts")"
QUANT_ARGS=${QUANT_ARGS:-}
TAG=${TAG:+-$TAG}
res=$RESULTS/quantize_ood-$CALIB$TAG.jsonl
touch "$res"
for model in $MODELS; do  # a rerun replaces the rows of the models it runs, keeps the others'
  "$PY" - "$res" "$(basename "$model" .gguf)" <<'PY'
import json, sys
path, name = sys.argv[1], sys.argv[2]
rows = [line for line in open(path) if line.strip() and json.loads(line)["model"] != name]
open(path, "w").writelines(rows)
PY
done
ppl() {  # model text -> perplexity
  "$TM" --log-level WARNING eval ppl --model "$1" --data "$2" --max-tokens "$TOKENS" --quantization none 2>/dev/null |
    "$PY" -c 'import json,sys; print(json.load(sys.stdin)["perplexity"])'
}
for model in $MODELS; do
  name=$(basename "$model" .gguf)
  echo "{\"model\": \"$name\", \"method\": \"float\", \"wiki\": $(ppl "$model" "$SHARED/data/wikitext-2/test.txt"), \"docs\": $(ppl "$model" "$texts/docs.txt")}" >> "$res"
  for g in $GROUP_SIZES; do
    for m in $METHODS; do
      dir=$OUT/$name-$m-g$g-$CALIB$TAG
      args=(--method "$m" --group-size "$g" --allow-partial-groups)
      [ "$m" = rtn-int4 ] || args+=("${calib[@]}" --calib-samples "$SAMPLES" $QUANT_ARGS)
      [ -d "$dir" ] || "$TM" --log-level WARNING quantize --model "$model" --output "$dir" --quiet "${args[@]}" \
        --output-json "$dir.json" > /dev/null
      echo "{\"model\": \"$name\", \"method\": \"$m\", \"group\": $g, \"calib\": \"$CALIB$TAG\", \"elapsed_s\": $("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["elapsed_s"])' "$dir.json"), \"wiki\": $(ppl "$dir" "$SHARED/data/wikitext-2/test.txt"), \"docs\": $(ppl "$dir" "$texts/docs.txt")}" >> "$res"
      tail -1 "$res"
    done
  done
done

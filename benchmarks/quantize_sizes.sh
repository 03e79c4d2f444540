#!/usr/bin/env bash
# How long `tokenmill quantize` takes at real sizes, and in how much memory: the float16 Llama-shaped
# files of the real-models benchmark (make_llama_gguf.py; random weights: time and memory do not depend
# on the values), each method with its default settings and the mixed calibration of quantize_ood.sh
# (WikiText-2 valid + CPython's standard-library source + MT-Bench's turns; 128 windows x 512 tokens).
# Reports the command's own figures: seconds per layer, total, peak RSS (VmHWM before the output is
# loaded back), the calibration dtype. Writes results/quantize_sizes.jsonl.
#   SIZES="1b 3b" METHODS="rtn-int4 gptq awq" MODELS=/path/for/files bash benchmarks/quantize_sizes.sh
source "$(dirname "$0")/common.sh"
SIZES=${SIZES:-"1b 3b"}
METHODS=${METHODS:-"rtn-int4 gptq awq"}
MODELS=${MODELS:-$ROOT/models}
SAMPLES=${SAMPLES:-128}
OUT=${OUT:-$HERE/.quantized}
mkdir -p "$MODELS" "$OUT"
calib_texts "$OUT/texts"
read -r -a calib <<< "$(mixed_calib "$OUT/texts")"
res=$RESULTS/quantize_sizes.jsonl
for size in $SIZES; do
  f16=$MODELS/llama-$size-f16.gguf
  [ -f "$f16" ] || "$PY" "$HERE/make_llama_gguf.py" --size "$size" "$f16"
  for m in $METHODS; do
    dir=$OUT/llama-$size-$m
    rm -rf "$dir"
    args=(--method "$m" --group-size 128)
    [ "$m" = rtn-int4 ] || args+=("${calib[@]}" --calib-samples "$SAMPLES")
    "$TM" --log-level WARNING quantize --model "$f16" --output "$dir" --quiet "${args[@]}" --output-json "$dir.json" \
      > /dev/null
    "$PY" - "$size" "$dir.json" >> "$res" <<'PY'
import json, sys
r = json.load(open(sys.argv[2]))
print(json.dumps({"size": sys.argv[1], "method": r["method"], "elapsed_s": r["elapsed_s"],
                  "seconds_per_layer": r["seconds_per_layer"], "peak_rss_gb": r["peak_rss_gb"],
                  "compute_dtype": r["compute_dtype"], "calibration": r["calibration"] and
                  {"samples": r["calibration"]["samples"], "seq_len": r["calibration"]["seq_len"]}}))
PY
    tail -1 "$res"
    rm -rf "$dir"
  done
done

#!/usr/bin/env bash
# The compression table for the default model: quantize (RTN int8/int4, AWQ, GPTQ at group 128),
# prune (Wanda, 2:4, and a structured layer removal of >= 25 % of the parameters), distill the
# pruned model from the original, quantization-aware training from the AWQ start, then measure
# every artifact the same way: perplexity on
# WikiText-2 test, decode tokens/s (bench latency), offline throughput (bench throughput), size.
# Writes results/compression.jsonl and benchmarks/COMPRESSION.md (+ compression.png).
# Steps whose output exists are skipped, so an interrupted run continues where it stopped.
source "$(dirname "$0")/common.sh"
OUT=${OUT:-$HERE/.compressed}                  # the artifacts (git-ignored)
TOKENS=${TOKENS:-8192}                         # WikiText-2 test tokens scored
DISTILL_STEPS=${DISTILL_STEPS:-120}
QAT_STEPS=${QAT_STEPS:-150}
CURVE_TOKENS=4096                              # the distillation and QAT curves score this many test tokens
GROUP=${GROUP:-128}                            # 576 is not a multiple of 128: last group of such rows is 64 wide
CALIB=$SHARED/data/wikitext-2/valid.txt
TEST=$SHARED/data/wikitext-2/test.txt
mkdir -p "$OUT"
q() { [ -d "$OUT/$1" ] || "$TM" --log-level WARNING quantize --model "$MODEL" --output "$OUT/$1" --calib "$CALIB" --quiet "${@:2}" >/dev/null; }
p() { [ -d "$OUT/$1" ] || "$TM" --log-level WARNING prune --model "$MODEL" --output "$OUT/$1" --calib "$CALIB" --quiet "${@:2}" >/dev/null; }

q rtn-int8 --method rtn-int8
q rtn-int4-g$GROUP --method rtn-int4 --group-size "$GROUP" --allow-partial-groups
q awq-g$GROUP --method awq --group-size "$GROUP" --allow-partial-groups
q gptq-g$GROUP --method gptq --group-size "$GROUP" --allow-partial-groups
p wanda-50 --method wanda --sparsity 0.5
p 2of4 --method 2:4
p layers-33 --method layers --sparsity 0.34
[ -d "$OUT/layers-33-distilled" ] || "$TM" --log-level WARNING distill --teacher "$MODEL" --student "$OUT/layers-33" \
  --data "$CALIB" --eval-data "$TEST" --eval-tokens "$CURVE_TOKENS" --eval-every 20 --steps "$DISTILL_STEPS" \
  --output "$OUT/layers-33-distilled" >/dev/null
[ -d "$OUT/qat-awq-g$GROUP" ] || "$TM" --log-level WARNING qat --model "$MODEL" --init awq --group-size "$GROUP" \
  --allow-partial-groups --data "$CALIB" --eval-data "$TEST" --eval-tokens "$CURVE_TOKENS" --eval-every 25 \
  --steps "$QAT_STEPS" --output "$OUT/qat-awq-g$GROUP" --quiet >/dev/null

measure() {  # name model quantization
  local name=$1 model=$2 quant=$3
  ppl=$("$TM" --log-level WARNING eval ppl --model "$model" --data "$TEST" --max-tokens "$TOKENS" --quantization "$quant" 2>/dev/null)
  lat=$("$TM" --log-level WARNING bench latency --model "$model" --quantization "$quant" --input-len 32 --output-len 128 --repeats 2 2>/dev/null)
  thr=$("$TM" --log-level WARNING bench throughput --model "$model" --quantization "$quant" --num-prompts 32 --input-len 32 --output-len 64 2>/dev/null)
  "$PY" - "$name" "$model" "$quant" "$ppl" "$lat" "$thr" <<'PY'
import json, os, sys
name, model, quant, ppl, lat, thr = sys.argv[1:]
ppl, lat, thr = json.loads(ppl), json.loads(lat), json.loads(thr)
report = os.path.join(model, "compression.json")
meta = json.load(open(report)) if os.path.isdir(model) and os.path.exists(report) else {}
files = [os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors")] if os.path.isdir(model) else [model]
print(json.dumps({"name": name, "model": model, "quantization": quant, "perplexity": ppl["perplexity"],
                  "tokens_scored": ppl["tokens_scored"], "size_bytes": sum(os.path.getsize(f) for f in files),
                  "parameters": meta.get("parameters"), "decode_tok_s": lat["decode_tokens_per_s"],
                  "throughput_tok_s": thr["output_tokens_per_s"], "meta": {k: meta.get(k) for k in
                  ("method", "group_size", "sparsity", "parameter_reduction", "elapsed_s", "removed_layers")}}))
PY
}
res=$RESULTS/compression.jsonl; : > "$res"
measure "float (dequantized GGUF)" "$MODEL" none >> "$res"
measure "GGUF Q4_1 as shipped (int4 g32)" "$MODEL" auto >> "$res"
for d in rtn-int8 rtn-int4-g$GROUP awq-g$GROUP gptq-g$GROUP qat-awq-g$GROUP; do measure "$d" "$OUT/$d" auto >> "$res"; done
for d in wanda-50 2of4 layers-33 layers-33-distilled; do measure "$d" "$OUT/$d" none >> "$res"; done
cp "$OUT/layers-33-distilled/compression.json" "$RESULTS/distill_report.json"
cp "$OUT/qat-awq-g$GROUP/compression.json" "$RESULTS/qat_report.json"
"$TM" --log-level WARNING eval ppl --model "$MODEL" --data "$TEST" --max-tokens "$CURVE_TOKENS" --quantization none \
  2>/dev/null > "$RESULTS/compression_float_curve.json"
"$PY" "$HERE/compression_report.py" "$res" "$RESULTS/distill_report.json" "$RESULTS/qat_report.json" \
  "$RESULTS/compression_float_curve.json" "$HERE/COMPRESSION.md" "$HERE/compression.png"

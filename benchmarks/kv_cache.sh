#!/usr/bin/env bash
# The 8-bit KV caches (--kv-cache-dtype int8 | fp8_e5m2) against float16, and llama.cpp's q8_0 cache
# (-ctk q8_0 -ctv q8_0, flash attention on, as its quantized V cache needs) against its f16 one.
# PART (default: all of them, in this order):
#   ppl    perplexity through the paged cache (`eval ppl --kv-cache-dtype`, windows of 512 / stride 256
#          fed 32 tokens at a time) on WikiText-2 test and a code text (CPython's argparse.py), first
#          TOKENS tokens, for each model in MODELS; llama-perplexity on the same file and text, f16 / q8_0
#   agree  greedy agreement with float16 on the MT-Bench first turns (kv_cache_agreement.py), float32 as the
#          noise floor (a cache more precise than float16)
#   attn   decode attention alone, per step (every layer's cache, scattered blocks): attention_bench.py on
#          the shapes of the default model, Qwen2.5-0.5B, Llama-3.2-1B and -3B, 16 x 2000 and 1 x 16000
#   decode whole decode steps: 16 streams at 2,000 tokens of context (default model, Qwen) and one at
#          16,000 (Qwen), tokenmill (profile_decode.py) against llama-batched-bench / llama-bench, one
#          process at a time, float16 then the 8-bit caches. DECODE_LOADS ("model batch context", `;`
#          between loads) replaces the three, e.g. a real-size file: "/path/llama-1b-q4_k_m.gguf 16 2000"
# Writes results/kv_cache-PART[_TAG][-ISA].jsonl.
source "$(dirname "$0")/common.sh"
PARTS=${PART:-"ppl agree attn decode"}
TOKENS=${TOKENS:-8192}
QWEN=$ROOT/models/qwen2.5-coder-0.5b-instruct.gguf
MODELS=${MODELS:-"$MODEL $QWEN"}
DTYPES=${DTYPES:-"float16 int8 fp8_e5m2"}
jq_py() { "$PY" -c "$1" "${@:2}"; }

for part in $PARTS; do
  out=$RESULTS/kv_cache-$part${TAG:+_$TAG}$SUFFIX.jsonl; : > "$out"
  case $part in
  ppl)
    build_llamacpp
    [ -x "$LLAMA_BUILD/bin/llama-perplexity" ] || cmake --build "$LLAMA_BUILD" -j 2 --target llama-perplexity
    code=$RESULTS/.argparse.txt
    "$PY" -c 'import argparse, sys; sys.stdout.write(open(argparse.__file__).read())' > "$code"
    for model in $MODELS; do
      for text in "$SHARED/data/wikitext-2/test.txt" "$code"; do
        for kv in $DTYPES; do
          "$TM" --log-level WARNING eval ppl --model "$model" --data "$text" --max-tokens "$TOKENS" \
            --context-len 512 --stride 256 --kv-cache-dtype "$kv" 2>/dev/null |
            jq_py 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"engine": "tokenmill", "model": sys.argv[1], "text": sys.argv[2], "kv": d["kv_cache_dtype"], "ppl": round(d["perplexity"], 4)}))' \
              "$(basename "$model")" "$(basename "$text")" >> "$out"
        done
        for kv in f16 q8_0; do
          lp=$("$LLAMA_BUILD/bin/llama-perplexity" -m "$model" -f "$text" -c 512 -t 2 -fa on -ctk $kv -ctv $kv \
               --chunks $((TOKENS / 512)) 2>&1 | grep -o 'Final estimate: PPL = [0-9.]*' | grep -o '[0-9.]*$')
          echo "{\"engine\": \"llama.cpp\", \"model\": \"$(basename "$model")\", \"text\": \"$(basename "$text")\", \"kv\": \"$kv\", \"ppl\": ${lp:-null}}" >> "$out"
        done
      done
    done ;;
  agree)
    for model in $MODELS; do
      # float32 too: how far a cache of more precision than float16 drifts (the noise floor)
      "$PY" "$HERE/kv_cache_agreement.py" --model "$model" --questions "$SHARED/data/mt_bench/question.jsonl" \
        --dtypes "float16,float32,$(echo $DTYPES | tr ' ' '\n' | grep -v '^float16$' | paste -sd,)" 2>/dev/null |
        jq_py 'import json,sys; [print(json.dumps({"model": sys.argv[1], **json.loads(l)})) for l in sys.stdin]' "$(basename "$model")" >> "$out"
    done ;;
  attn)
    # name heads kv-heads head-dim layers
    for shape in "smollm2-135m 9 3 64 30" "qwen2.5-0.5b 14 2 64 24" "llama-3.2-1b 32 8 64 16" "llama-3.2-3b 24 8 128 28"; do
      set -- $shape
      for load in "16 2000" "1 16000"; do
        read -r batch ctx <<< "$load"
        for kv in $DTYPES; do
          "$PY" "$HERE/attention_bench.py" --heads "$2" --kv-heads "$3" --head-dim "$4" --layers "$5" --batch "$batch" \
            --start "$ctx" --new 16 --kv-dtype "$kv" |
            jq_py 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"shape": sys.argv[1], "batch": d["batch"], "context": d["start"], "kv": d["kv_dtype"], "attention_ms_per_step": round(d["decode_kernel_us"] / 1000, 2), "kv_GBps": d["decode_kernel_kv_GBps"]}))' "$1" >> "$out"
        done
      done
    done ;;
  decode)
    build_llamacpp
    IFS=';' read -ra loads <<< "${DECODE_LOADS:-$MODEL 16 2000;$QWEN 16 2000;$QWEN 1 16000}"
    for load in "${loads[@]}"; do
      read -r model batch ctx <<< "$load"
      name=$(basename "$model")
      for kv in $DTYPES; do
        "$PY" "$HERE/profile_decode.py" --model "$model" --batch "$batch" --prompt "$ctx" --steps 20 \
          --kv-cache-dtype "$kv" --no-profile --json 2>/dev/null | tail -1 |
          jq_py 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"engine": "tokenmill", "model": sys.argv[1], "batch": d["batch"], "context": d["prompt"], "kv": sys.argv[2], "decode_tok_s": d["decode_tok_s"]}))' "$name" "$kv" >> "$out"
      done
      for kv in f16 q8_0; do
        if [ "$batch" = 1 ]; then
          tg=$("$LLAMA_BUILD/bin/llama-bench" -m "$model" -t 2 -fa 1 -ctk $kv -ctv $kv -p 0 -n 32 -d "$ctx" -r 2 -o json 2>/dev/null |
               jq_py 'import json,sys; print(json.load(sys.stdin)[0]["avg_ts"])')
        else
          tg=$("$LLAMA_BUILD/bin/llama-batched-bench" -m "$model" -t 2 -fa on -ctk $kv -ctv $kv -c $((batch * (ctx + 40))) \
               -b 2048 -ub 512 -npp "$ctx" -ntg 32 -npl "$batch" 2>&1 | awk -F'|' '/^\|[ ]+[0-9]/ {print $9}' | tr -d ' ')
        fi
        echo "{\"engine\": \"llama.cpp\", \"model\": \"$name\", \"batch\": $batch, \"context\": $ctx, \"kv\": \"$kv\", \"decode_tok_s\": ${tg:-null}}" >> "$out"
      done
    done ;;
  *) echo "unknown PART $part (ppl, agree, attn, decode)" >&2; exit 2 ;;
  esac
  cat "$out"
done

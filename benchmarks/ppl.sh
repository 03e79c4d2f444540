#!/usr/bin/env bash
# Perplexity on held-out text: the dequantized float path (--quantization none) vs the kernels (auto)
# with 16- and 8-bit activations, and llama.cpp's llama-perplexity on the same GGUF file, for each
# model in MODELS (default: the default model and Qwen2.5-Coder-0.5B from `make qwen`) and each text:
# WikiText-2 test and a code text (CPython's argparse.py, the Python that runs this script).
# tokenmill scores windows of 512 tokens, stride 256 (each token after the first window with 256+
# tokens of context); llama-perplexity scores the second half of each 512-token chunk: close, not equal.
# Writes results/ppl[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
TOKENS=${TOKENS:-8192}
MODELS=${MODELS:-"$MODEL $ROOT/models/qwen2.5-coder-0.5b-instruct.gguf"}
build_llamacpp
[ -x "$LLAMA_BUILD/bin/llama-perplexity" ] || cmake --build "$LLAMA_BUILD" -j 2 --target llama-perplexity
code=$RESULTS/.argparse.txt
"$PY" -c 'import argparse, sys; sys.stdout.write(open(argparse.__file__).read())' > "$code"
out=$RESULTS/ppl$SUFFIX.jsonl; : > "$out"
for model in $MODELS; do
  for text in "$SHARED/data/wikitext-2/test.txt" "$code"; do
    name=$(basename "$text")
    # the fourth field: TOKENMILL_AMX (0: prompt windows on the integer kernels, where the amx or
    # avx512bf16 variant would multiply them in bfloat16; the same run elsewhere)
    for run in "none 16 1" "auto 16 1" "auto 16 0" "auto 8 1"; do
      set -- $run
      TOKENMILL_AMX=$3 "$TM" --log-level WARNING eval ppl --model "$model" --data "$text" --quantization "$1" --activation-bits "$2" \
        --max-tokens "$TOKENS" --context-len 512 --stride 256 |
        "$PY" -c 'import json,sys; d=json.loads(sys.stdin.read()); print(json.dumps({**d, "engine": "tokenmill", "model": sys.argv[1], "text": sys.argv[2], "TOKENMILL_AMX": sys.argv[3]}))' \
          "$(basename "$model")" "$name" "$3" >> "$out"
    done
    # llama-perplexity: chunks of 512 over the same first TOKENS tokens (it stops at --chunks)
    lp=$("$LLAMA_BUILD/bin/llama-perplexity" -m "$model" -f "$text" -c 512 -t 2 --chunks $((TOKENS / 512)) 2>&1 |
         grep -o 'Final estimate: PPL = [0-9.]*' | grep -o '[0-9.]*$')
    echo "{\"engine\": \"llama.cpp\", \"model\": \"$(basename "$model")\", \"text\": \"$name\", \"ppl\": ${lp:-null}}" >> "$out"
  done
done
cat "$out"

#!/usr/bin/env bash
# Prompt processing side by side (#38): pp512 of tokenmill (`bench latency --input-len 512`, prefix
# cache off, the variant auto picks: amx on AMX Xeons) and of the same build with ISAS' other
# variants (default avx512vnni: the integer kernels), against llama-bench pp512 on the same file,
# alternated REPS times, one engine at a time, 2 threads. Files: MODELS_LIST (default: the default
# model, then real_sizes.sh's 1B and 3B Q4_K_M files where they exist under MODELS). BITS: the
# activation widths to run tokenmill at (default 16; "16 8" adds `--activation-bits 8`, llama.cpp's
# own width, as tokenmill_<isa>_a8).
#   REPS=2 MODELS=/path/for/files bash benchmarks/prefill.sh      -> results/prefill.jsonl
#   ISA=avx2 ISAS=avx2 BITS="16 8" bash benchmarks/prefill.sh     -> both pinned to AVX2: results/prefill-avx2.jsonl
source "$(dirname "$0")/common.sh"
REPS=${REPS:-2}
MODELS=${MODELS:-$ROOT/models}
ISAS=${ISAS:-"auto avx512vnni"}
BITS=${BITS:-16}
build_llamacpp
list=${MODELS_LIST:-"$MODEL $(ls "$MODELS"/llama-1b-q4_k_m.gguf "$MODELS"/llama-3b-q4_k_m.gguf 2>/dev/null | tr '\n' ' ')"}
out=$RESULTS/prefill$SUFFIX.jsonl; : > "$out"
for model in $list; do
  for r in $(seq 1 "$REPS"); do
    row="{\"model\": \"$(basename "$model")\", \"rep\": $r"
    for isa in $ISAS; do
      for bits in $BITS; do
        pre=$(TOKENMILL_CPU_ISA=$isa OMP_NUM_THREADS=2 "$TM" --log-level WARNING bench latency --model "$model" \
                --input-len 512 --output-len 2 --repeats 2 --no-enable-prefix-caching --kv-cache-memory 1GiB \
                --activation-bits "$bits" --weight-cache "$MODELS/.weight-cache")
        key=tokenmill_$isa$([ "$bits" = 16 ] || echo "_a$bits")
        row="$row, \"$key\": $(echo "$pre" | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"pp512": round(d["input_len"] / d["ttft_s"], 1), "isa": d["cpu_kernels"]}))')"
      done
    done
    lb=$("$LLAMA_BUILD/bin/llama-bench" -m "$model" -t 2 -p 512 -n 0 -r 2 -o json)
    row="$row, \"llama_bench_pp512\": $(echo "$lb" | "$PY" -c 'import json,sys; print(round(json.load(sys.stdin)[0]["avg_ts"], 1))')}"
    echo "$row" | tee -a "$out"
  done
done
"$PY" - "$out" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    ratios = {k: round(v["pp512"] / d["llama_bench_pp512"], 2) for k, v in d.items() if k.startswith("tokenmill_")}
    print(d["model"], "rep", d["rep"], "llama-bench", d["llama_bench_pp512"], "ratios", ratios)
PY

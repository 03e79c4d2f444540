#!/usr/bin/env bash
# Multi-LoRA serving: C streams spread over ADAPTERS adapters (request i under adapter i mod ADAPTERS) against
# the same load on the base model, on tokenmill serve (--lora-modules, --max-loras ADAPTERS: every adapter
# in its slot, requests for different adapters in one step) and llama.cpp's llama-server (--lora per adapter,
# --lora-init-without-apply, each request's "lora" list; it batches only requests with the same adapters).
# One server alive at a time, alternated REPS times, same client (`tokenmill bench serve`), N seeded prompts
# of INPUT_LEN random tokens, OUTPUT_LEN out. The adapters (random, rank RANK on TARGETS) are written for
# MODEL by make_lora.py in both formats with the same values. Writes results/lora_<model>_r$RANK[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
C=${C:-16}; N=${N:-64}; ADAPTERS=${ADAPTERS:-8}; RANK=${RANK:-16}; REPS=${REPS:-2}
TARGETS=${TARGETS:-q,k,v,o,gate,up,down}; INPUT_LEN=${INPUT_LEN:-128}; OUTPUT_LEN=${OUTPUT_LEN:-64}
TM_ARGS=${TM_ARGS:-}
build_llamacpp
name=$(basename "$MODEL" .gguf)
dir=$RESULTS/.lora_${name}_r${RANK}_${TARGETS//,/}
[ -f "$dir/a$((ADAPTERS - 1)).gguf" ] || "$PY" "$HERE/make_lora.py" "$MODEL" "$dir" --n "$ADAPTERS" --rank "$RANK" --targets "$TARGETS"
"$PY" - "$dir" "$N" "$INPUT_LEN" "$OUTPUT_LEN" "$ADAPTERS" <<'PY'
import json, random, sys
d, n, n_in, n_out, k = sys.argv[1], *map(int, sys.argv[2:])
rng = random.Random(0)
prompts = [[rng.randrange(100, 49000) for _ in range(n_in)] for _ in range(n)]
rows = {"base": [{}] * n, "tokenmill": [{"model": f"a{i % k}"} for i in range(n)],
        "llama": [{"extra": {"lora": [{"id": i % k, "scale": 1.0}]}} for i in range(n)]}
for kind, extra in rows.items():
    with open(f"{d}/workload_{kind}.jsonl", "w") as f:
        for p, e in zip(prompts, extra):
            f.write(json.dumps({"prompt_token_ids": p, "max_tokens": n_out, **e}) + "\n")
PY
modules=(); loras=()
for i in $(seq 0 $((ADAPTERS - 1))); do modules+=("a$i=$dir/a$i"); loras+=(--lora "$dir/a$i.gguf"); done
out=$RESULTS/lora_${name}_r${RANK}$SUFFIX.jsonl; : > "$out"
bench() { bench_serve "$1" "$2" "$dir/workload_$3.jsonl" "$C" "$N" "$out"; }  # name url workload
for r in $(seq 1 "$REPS"); do
  "$TM" --log-level WARNING serve --model "$MODEL" --port 8020 --served-model-name smollm2 --max-num-seqs "$C" \
     --max-loras "$ADAPTERS" --max-lora-rank "$RANK" --lora-modules "${modules[@]}" $TM_ARGS &
  pid=$!; wait_health http://127.0.0.1:8020
  bench "tokenmill base" http://127.0.0.1:8020 base
  bench "tokenmill ${ADAPTERS} adapters" http://127.0.0.1:8020 tokenmill
  stop $pid
  "$LLAMA_BUILD/bin/llama-server" -m "$MODEL" --alias smollm2 -t 2 -tb 2 -c $((C * 1024)) -np "$C" "${loras[@]}" \
     --lora-init-without-apply --no-cache-prompt -cram 0 --no-webui --host 127.0.0.1 --port 8081 > /dev/null 2>&1 &
  pid=$!; wait_health http://127.0.0.1:8081
  bench "llama-server base" http://127.0.0.1:8081 base
  bench "llama-server ${ADAPTERS} adapters" http://127.0.0.1:8081 llama
  stop $pid
done
summarize_serve "$out"

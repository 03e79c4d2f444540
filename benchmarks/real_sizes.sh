#!/usr/bin/env bash
# Real sizes: Llama-3-shaped GGUF files of 1B, 3B and 8B parameters with random weights (made here:
# make_llama_gguf.py writes the float16 file tensor by tensor, llama.cpp's llama-quantize makes each
# TYPE from it; speed and memory depend on shapes and types, not on values), then per file, alternated
# REPS times, one engine alive at a time, 2 threads:
#   time to ready  `tokenmill serve` / `llama-server` from process start to a 200 on /health; tokenmill's
#                  first start (an empty weight cache: reads and packs the file, then writes the cache
#                  entry) as ready_first_s, a later one (maps the entry) as ready_s
#   peak RSS       VmHWM of that server process once ready, after one 64-token answer
#   decode, pp512  `tokenmill bench latency` (64 new tokens; a 512-token prompt) / `llama-bench` tg64, pp512
#   bytes/token    the weights one tokenmill decode step reads, against the file's tensor bytes
# SIZES="1b 3b" TYPES="Q4_K_M Q4_0" REPS=2 MODELS=/path/for/files bash benchmarks/real_sizes.sh
# ISA=avx2 (common.sh) pins both engines to AVX2. READY_ONLY=1: only the servers' start and peak, alternated
# (results/real_sizes_ready.jsonl). Writes results/real_sizes[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
SIZES=${SIZES:-"1b 3b 8b"}
TYPES=${TYPES:-"Q4_K_M"}
REPS=${REPS:-2}
MODELS=${MODELS:-$ROOT/models}
PORT=${PORT:-8731}
WCACHE=$MODELS/.weight-cache
build_llamacpp
mkdir -p "$MODELS"
out=$RESULTS/real_sizes${READY_ONLY:+_ready}$SUFFIX.jsonl  # appended to: every run, with its commit, its CPU variant
commit=$(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD || echo "+changes")

ready_and_peak() {  # name cmd...: starts a server, prints {"ready_s", "peak_rss_gb"} after one answer
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  "$@" > "$RESULTS/.server.log" 2>&1 &
  local pid=$!
  if ! wait_health "http://127.0.0.1:$PORT" 900; then stop "$pid"; tail -5 "$RESULTS/.server.log" >&2; return 1; fi
  local t1; t1=$(date +%s.%N)
  curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "The capital of France is", "max_tokens": 64, "temperature": 0}' > /dev/null
  local hwm; hwm=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
  stop "$pid"
  echo "{\"ready_s\": $(echo "$t1 - $t0" | bc | sed "s/^\./0./"), \"peak_rss_gb\": $(echo "scale=3; $hwm / 1048576" | bc | sed "s/^\./0./")}"
}

for size in $SIZES; do
  f16=$MODELS/llama-$size-f16.gguf
  [ -f "$f16" ] || "$PY" "$HERE/make_llama_gguf.py" --size "$size" "$f16"
  for type in $TYPES; do
    model=$MODELS/llama-$size-$(echo "$type" | tr 'A-Z' 'a-z').gguf
    [ -f "$model" ] || "$LLAMA_BUILD/bin/llama-quantize" "$f16" "$model" "$type" 2 > /dev/null
    file_bytes=$("$PY" -c 'import gguf,sys; print(sum(int(t.n_bytes) for t in gguf.GGUFReader(sys.argv[1]).tensors))' "$model")
    for r in $(seq 1 "$REPS"); do
      tm_serve=("$TM" --log-level WARNING serve --model "$model" --port "$PORT" --kv-cache-memory 1GiB --weight-cache "$WCACHE")
      rm -rf "$WCACHE"
      first=$(ready_and_peak tokenmill "${tm_serve[@]}")
      lc=$(ready_and_peak llama.cpp "$LLAMA_BUILD/bin/llama-server" -m "$model" -t 2 --port "$PORT" -c 4096 -np 1)
      tm=$(ready_and_peak tokenmill "${tm_serve[@]}")
      tm=$("$PY" -c 'import json,sys; a, b = map(json.loads, sys.argv[1:]); print(json.dumps({**b, "ready_first_s": a["ready_s"], "peak_rss_first_gb": a["peak_rss_gb"]}))' "$first" "$tm")
      if [ -n "${READY_ONLY:-}" ]; then  # only the two servers' start, alternated
        echo "{\"size\": \"$size\", \"type\": \"$type\", \"commit\": \"$commit\", \"tokenmill\": $tm, \"llama.cpp\": $lc}" >> "$out"
        continue
      fi
      dec=$(OMP_NUM_THREADS=2 "$TM" --log-level WARNING bench latency --model "$model" --input-len 32 --output-len 64 \
              --repeats 1 --kv-cache-memory 1GiB --weight-cache "$WCACHE")
      pre=$(OMP_NUM_THREADS=2 "$TM" --log-level WARNING bench latency --model "$model" --input-len 512 --output-len 2 \
              --repeats 1 --no-enable-prefix-caching --kv-cache-memory 1GiB --weight-cache "$WCACHE")
      lb=$("$LLAMA_BUILD/bin/llama-bench" -m "$model" -t 2 -p 512 -n 64 -r 1 -o json)
      "$PY" - "$size" "$type" "$file_bytes" "$tm" "$lc" "$dec" "$pre" "$lb" "$commit" >> "$out" <<'PY'
import json, sys
size, qtype, file_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
tm, lc, dec, pre, lb = (json.loads(a) for a in sys.argv[4:9])
commit = sys.argv[9]
llama = {r["n_gen"] and "decode" or "pp512": r["avg_ts"] for r in lb}
print(json.dumps({"size": size, "type": qtype, "file_gb": round(file_bytes / 1e9, 3), "commit": commit,
                  "cpu_kernels": dec["cpu_kernels"], "tokenmill": {**tm, "decode_tok_s": round(dec["decode_tokens_per_s"], 2),
                                "pp512_tok_s": round(pre["input_len"] / pre["ttft_s"], 1),
                                "bytes_per_token_vs_file": round(dec["weight_bytes_per_token"] / file_bytes, 3)},
                  "llama.cpp": {**lc, "decode_tok_s": round(llama["decode"], 2), "pp512_tok_s": round(llama["pp512"], 1)}}))
PY
      tail -1 "$out"
    done
  done
done

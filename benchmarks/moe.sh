#!/usr/bin/env bash
# Mixture-of-experts decode, single stream: a Qwen3-MoE at Qwen3-30B-A3B's expert shape (32 experts,
# 8 active; benchmarks/moe_models.py) against its dense equivalent (the same active parameters), both
# as the same Q4_0 GGUF in tokenmill (`tokenmill bench latency`) and llama.cpp (`llama-bench` tg),
# 2 threads, alternated REPS times. MoE/dense near 1 means the expert path reads only what it uses.
# ISA=avx2 etc. (common.sh) pins both engines. Writes results/moe[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
REPS=${REPS:-3}
OUT_LEN=${OUT_LEN:-128}
WORK=${MOE_WORK:-$PEERS/moe}
build_llamacpp
"$PY" "$HERE/moe_models.py" "$WORK" > "$RESULTS/.moe_models.json"
out=$RESULTS/moe$SUFFIX.jsonl; : > "$out"
for r in $(seq 1 "$REPS"); do
  for m in moe dense; do
    OMP_NUM_THREADS=2 "$TM" --log-level WARNING bench latency --model "$WORK/$m-q4_0.gguf" --input-len 16 \
       --output-len "$OUT_LEN" --repeats 1 \
      | "$PY" -c 'import json,sys; d=json.load(sys.stdin); d.pop("runs"); print(json.dumps({**d, "peer": "tokenmill", "model": sys.argv[1]}))' "$m" >> "$out"
    # the same model with every layer in Python (the MoE model runs that way: the decode stack chains dense MLPs)
    TOKENMILL_DECODE_STACK=0 OMP_NUM_THREADS=2 "$TM" --log-level WARNING bench latency --model "$WORK/$m-q4_0.gguf" \
       --input-len 16 --output-len "$OUT_LEN" --repeats 1 \
      | "$PY" -c 'import json,sys; d=json.load(sys.stdin); d.pop("runs"); print(json.dumps({**d, "peer": "tokenmill-python-layers", "model": sys.argv[1]}))' "$m" >> "$out"
    "$LLAMA_BUILD/bin/llama-bench" -m "$WORK/$m-q4_0.gguf" -t 2 -p 0 -n "$OUT_LEN" -r 1 -o json \
      | "$PY" -c 'import json,sys; r=json.load(sys.stdin)[0]; print(json.dumps({"peer": "llama.cpp", "model": sys.argv[1], "decode_tokens_per_s": r["avg_ts"]}))' "$m" >> "$out"
  done
done
"$PY" - "$out" "$RESULTS/.moe_models.json" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
models = json.load(open(sys.argv[2]))
med = {(p, m): statistics.median(r["decode_tokens_per_s"] for r in rows if r["peer"] == p and r["model"] == m)
       for p in ("tokenmill", "tokenmill-python-layers", "llama.cpp") for m in ("moe", "dense")}
for p in ("tokenmill", "tokenmill-python-layers", "llama.cpp"):
    print(f"{p:24s} MoE {med[p, 'moe']:6.1f} tok/s  dense-equivalent {med[p, 'dense']:6.1f} tok/s  "
          f"MoE/dense {med[p, 'moe'] / med[p, 'dense']:.2f}")
print(f"tokenmill/llama.cpp: MoE {med['tokenmill', 'moe'] / med['llama.cpp', 'moe']:.2f}  "
      f"dense {med['tokenmill', 'dense'] / med['llama.cpp', 'dense']:.2f}")
print(json.dumps(models))
PY

#!/usr/bin/env bash
# The router and data parallelism on this host, one deployment alive at a time. PART=all (default) or one of:
#  policy:   2 replicas (1 thread each, pinned to cores 0 and 1, KV_MIB each) behind `tokenmill router`,
#            round_robin vs least_load vs cache_aware, on (a) 40 MT-Bench two-turn conversations (answers to
#            EOS or 128 tokens), (b) N requests over PROMPTS tenants' ~1,000-token system prompts + MT-Bench
#            questions (answers 16-96 tokens); 8 clients; fresh replicas (cold caches) for every run
#            -> results/router_policy.jsonl (MODES, POLICIES, POLICY_OUT narrow it: a repeat of one workload)
#  overhead: one replica (2 threads): 200 one-token requests alternating direct / through the router
#            (results/router_latency.jsonl), then `tokenmill bench serve` at 1 and 16 streams, direct vs
#            through the router, alternated REPS times -> results/router_overhead.jsonl
#  dp:       `serve --threads 2` vs `serve --data-parallel-size 2` (1 thread per replica, pinned to its core)
#            vs the same 2 replicas both pinned to core 0, 16 streams, REPS times -> results/router_dp.jsonl
source "$(dirname "$0")/common.sh"
PART=${PART:-all}; REPS=${REPS:-2}; MODES=${MODES:-mtbench system}; POLICIES=${POLICIES:-round_robin least_load cache_aware}; KV_MIB=${KV_MIB:-160}; PROMPTS=${PROMPTS:-8}; N=${N:-64}
MT=$SHARED/data/mt_bench/question.jsonl
A=http://127.0.0.1:8031; B=http://127.0.0.1:8032; R=http://127.0.0.1:8030

replicas() {  # extra serve flags...: two pinned 1-thread replicas on :8031 and :8032
  "$TM" --log-level WARNING serve --model "$MODEL" --served-model-name smollm2 --port 8031 --cpu-cores 0 --threads 1 "$@" &
  RA=$!
  "$TM" --log-level WARNING serve --model "$MODEL" --served-model-name smollm2 --port 8032 --cpu-cores 1 --threads 1 "$@" &
  RB=$!
  wait_health $A; wait_health $B
}

if [ "$PART" = all ] || [ "$PART" = policy ]; then
  out=$RESULTS/${POLICY_OUT:-router_policy.jsonl}; : > "$out"
  for mode in $MODES; do
    for policy in $POLICIES; do
      replicas --kv-cache-memory "${KV_MIB}MiB"
      "$TM" --log-level WARNING router --port 8030 --policy $policy --replica $A --replica $B &
      rp=$!; wait_health $R
      "$PY" "$HERE/router_replay.py" --url $R --mode $mode --mt-bench "$MT" --wikitext "$SHARED/data/wikitext-2/valid.txt" \
        --prompts "$PROMPTS" --num $([ $mode = mtbench ] && echo 40 || echo "$N") --concurrency 8 \
        --max-tokens $([ $mode = mtbench ] && echo 128 || echo 96) --label $policy --out "$out"
      stop $rp; stop $RA; stop $RB
    done
  done
fi

if [ "$PART" = all ] || [ "$PART" = overhead ]; then
  out=$RESULTS/router_overhead.jsonl; : > "$out"; : > "$RESULTS/router_latency.jsonl"
  "$TM" --log-level WARNING serve --model "$MODEL" --served-model-name smollm2 --port 8031 --max-num-seqs 16 \
     --no-enable-prefix-caching &
  RA=$!; wait_health $A
  "$TM" --log-level WARNING router --port 8030 --replica $A &
  rp=$!; wait_health $R
  "$PY" "$HERE/router_latency.py" --direct $A --router $R -n 200 --out "$RESULTS/router_latency.jsonl"
  for r in $(seq 1 "$REPS"); do
    for c in 1 16; do
      n=$([ $c = 1 ] && echo 16 || echo "$N")
      bench_serve "direct c=$c" $A "$WORKLOAD" $c $n "$out"
      bench_serve "router c=$c" $R "$WORKLOAD" $c $n "$out"
    done
  done
  stop $rp; stop $RA
fi

if [ "$PART" = all ] || [ "$PART" = dp ]; then
  out=$RESULTS/router_dp.jsonl; : > "$out"
  for r in $(seq 1 "$REPS"); do
    for variant in "--threads 2" "--data-parallel-size 2" "--data-parallel-size 2 --cpu-cores 0"; do
      "$TM" --log-level WARNING serve --model "$MODEL" --served-model-name smollm2 --port 8030 --max-num-seqs 16 \
         --no-enable-prefix-caching $variant &
      pid=$!
      for _ in $(seq 1 300); do  # the data-parallel router answers /health once one replica is up: wait for both
        [ "$(curl -s $R/metrics | grep -c '^tokenmill:router_replica_healthy{.*} 1.0')" -ge 2 ] && break
        curl -sf $R/health >/dev/null 2>&1 && [ "$variant" = "--threads 2" ] && break
        sleep 0.5
      done
      bench_serve "serve $variant" $R "$WORKLOAD" 16 "$N" "$out"
      stop $pid
    done
  done
fi

"$PY" - "$RESULTS" "$PART" <<'PY'
import json, os, statistics, sys
res, part = sys.argv[1], sys.argv[2]
def rows(name):
    p = os.path.join(res, name)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
for r in rows("router_policy.jsonl"):
    print(f"{r['mode']:8s} {r['label']:12s} TTFT p50 {r['ttft_p50_s']:.3f}s mean {r['ttft_mean_s']:.3f}s "
          f"turn1 p50 {r['turn1_ttft_p50_s']} turn2 p50 {r['turn2_ttft_p50_s']}  hit {r['prefix_hit_rate']}  out tok/s {r['output_tokens_per_s']} "
          f"errors {r['errors']} {r['per_replica']} {r['decisions']}")
for r in rows("router_latency.jsonl"):
    print(f"one-token requests: TTFB direct {r['direct_ttfb_ms']} ms, via router {r['router_ttfb_ms']} ms "
          f"(+{r['added_ttfb_ms']} ms); whole request +{r['added_total_ms']} ms")
for name in ("router_overhead.jsonl", "router_dp.jsonl"):
    rs = rows(name)
    for peer in dict.fromkeys(r["peer"] for r in rs):
        g = [r for r in rs if r["peer"] == peer]
        med = lambda k: statistics.median(r[k] for r in g)
        print(f"{peer:40s} out tok/s {med('output_tokens_per_s'):7.1f}  TTFT p50 {med('ttft_p50_s') * 1000:8.1f} ms  "
              f"errors {sum(r['errors'] for r in g)}  runs {len(g)}")
PY

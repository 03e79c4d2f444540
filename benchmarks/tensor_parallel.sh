#!/usr/bin/env bash
# Tensor parallelism on this host, one engine alive at a time, REPS alternations:
#   TP=1 with 2 threads  vs  TP=2 with 1 thread per rank (pinned to cores 0 and 1; shared-memory
#   all-reduce)  vs  the same TP=2 over gloo (TOKENMILL_TP_SHM=0): decode tok/s at 1 and 16 streams;
#   then the all-reduce itself, shared memory vs gloo, 1 / 16 / 256 rows of the hidden size.
#   -> results/tensor_parallel.jsonl
source "$(dirname "$0")/common.sh"
REPS=${REPS:-2}
out=$RESULTS/tensor_parallel.jsonl; : > "$out"
for r in $(seq 1 "$REPS"); do
  "$PY" "$HERE/tp_bench.py" decode --model "$MODEL" --tp 1 --threads 2 --label "tp1 threads2" --out "$out"
  "$PY" "$HERE/tp_bench.py" decode --model "$MODEL" --tp 2 --threads 1 --label "tp2 shm" --out "$out"
  TOKENMILL_TP_SHM=0 "$PY" "$HERE/tp_bench.py" decode --model "$MODEL" --tp 2 --threads 1 --label "tp2 gloo" --out "$out"
done
"$PY" "$HERE/tp_bench.py" allreduce --out "$out"

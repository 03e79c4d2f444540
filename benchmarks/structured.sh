#!/usr/bin/env bash
# Structured outputs' cost: tokenmill serve (one server) answering the same chat prompts with and
# without a JSON schema at 1 and C concurrent streams, alternated, and the TTFT a new schema adds
# (structured_client.py). Goal (issue #18): >= 0.9x the unconstrained speed, < 50 ms per new schema.
# Writes results/structured[-ISA].jsonl.
source "$(dirname "$0")/common.sh"
C=${C:-16}
out=$RESULTS/structured$SUFFIX.jsonl; : > "$out"
"$TM" --log-level WARNING serve --model "$MODEL" --port 8020 --served-model-name default --max-num-seqs "$C" &
pid=$!; wait_health http://127.0.0.1:8020
"$PY" "$HERE/structured_client.py" --base-url http://127.0.0.1:8020 --concurrency "1,$C" --out "$out"
stop $pid

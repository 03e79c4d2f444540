# Shared settings for the benchmark scripts: paths, the default model, peer builds.
# Peers are built from public sources into benchmarks/.peers (git-ignored).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
PEERS=$HERE/.peers
RESULTS=$HERE/results
PY=$ROOT/.venv/bin/python
TM=$ROOT/.venv/bin/tokenmill
SHARED=${SHARED:-$ROOT/../shared}
WORKLOAD=${WORKLOAD:-$SHARED/bench/workload_smollm2_n256_seed0.jsonl}
MODEL=${MODEL:-$($PY -c 'from tokenmill.utils import default_model_path; print(default_model_path())')}
LLAMA_VERSION=0.3.36
mkdir -p "$PEERS" "$RESULTS"

# ISA=native (default) builds llama.cpp for this CPU; ISA=avx2 | avxvnni | avx512 | avx512vnni builds it for that
# instruction set only (GGML_NATIVE=OFF) and makes tokenmill use the same variant (TOKENMILL_CPU_ISA), so
# an AVX2 comparison is like for like on any host. Each ISA has its own build folder.
ISA=${ISA:-native}
case "$ISA" in
  native) GGML_ISA=(-DGGML_NATIVE=ON) ;;
  avx2) GGML_ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                  -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX_VNNI=OFF) ;;
  avxvnni) GGML_ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                     -DGGML_AVX_VNNI=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF) ;;
  avx512) GGML_ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                    -DGGML_AVX512=ON -DGGML_AVX512_VNNI=OFF) ;;
  avx512vnni) GGML_ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                        -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON) ;;
  *) echo "ISA must be native, avx2, avxvnni, avx512 or avx512vnni; got $ISA" >&2; exit 2 ;;
esac
[ "$ISA" = native ] || export TOKENMILL_CPU_ISA=$ISA
# PyTorch's own kernels (transformers' whole model; tokenmill's SDPA and the rest) pinned to the same
# instruction set: ATen's dispatch, MKL and oneDNN would otherwise use AVX-512 (or AMX) where the host has it
case "$ISA" in
  avx2) export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  avxvnni) export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2_VNNI ;;
  avx512 | avx512vnni) export ATEN_CPU_CAPABILITY=avx512 MKL_ENABLE_INSTRUCTIONS=AVX512 ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI ;;
esac
# On Xeons with AMX, llama.cpp's AMX code (ggml_backend_amx_mul_mat) segfaults in llama-bench: a native
# build (-march=native turns AMX on whatever GGML_AMX_* say) becomes every AVX-512 extension, AMX off
if [ "$ISA" = native ] && grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
  GGML_ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON
            -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
            -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  LLAMA_NOAMX=-noamx
fi
LLAMA_BUILD=$PEERS/llama.cpp-build$([ "$ISA" = native ] || echo "-$ISA")${LLAMA_NOAMX:-}
SUFFIX=$([ "$ISA" = native ] || echo "-$ISA")  # results files of a pinned ISA: name-$ISA.jsonl

# llama.cpp's server and llama-bench, from the llama.cpp sources vendored in the llama-cpp-python sdist
build_llamacpp() {
  [ -x "$LLAMA_BUILD/bin/llama-server" ] && [ -x "$LLAMA_BUILD/bin/llama-bench" ] &&
    [ -x "$LLAMA_BUILD/bin/llama-quantize" ] && [ -x "$LLAMA_BUILD/bin/llama-batched-bench" ] && return
  [ -f "$PEERS/dl/llama_cpp_python-$LLAMA_VERSION.tar.gz" ] ||
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d "$PEERS/dl"
  mkdir -p "$PEERS/src" && tar xzf "$PEERS/dl/llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$PEERS/src"
  cmake -S "$PEERS/src/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp" -B "$LLAMA_BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release "${GGML_ISA[@]}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$LLAMA_BUILD" -j 2 --target llama-server llama-bench llama-quantize llama-batched-bench
}

wait_health() {  # url [seconds, default 150]
  for _ in $(seq 1 $((${2:-150} * 2))); do curl -sf "$1/health" >/dev/null 2>&1 && return 0; sleep 0.5; done
  echo "server at $1 did not come up" >&2; return 1
}

stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }

bench_serve() {  # name url workload concurrency num_prompts out.jsonl: one `tokenmill bench serve` run, one JSON line
  "$TM" bench serve --base-url "$2" --model-name smollm2 --workload "$3" --num-prompts "$5" --concurrency "$4" \
     --output-json "$RESULTS/.last.json" > /dev/null
  "$PY" -c 'import json,sys; d=json.load(open(sys.argv[1]))["runs"][0]; print(json.dumps({"peer": sys.argv[2], **d}))' \
     "$RESULTS/.last.json" "$1" >> "$6"
}

summarize_serve() {  # out.jsonl: medians per peer
  "$PY" - "$1" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1])]
for peer in dict.fromkeys(r["peer"] for r in rows):
    rs = [r for r in rows if r["peer"] == peer]
    med = lambda k: statistics.median(r[k] for r in rs)
    print(f"{peer:14s} out tok/s {med('output_tokens_per_s'):7.1f}  TTFT p50 {med('ttft_p50_s'):6.2f}s p99 "
          f"{med('ttft_p99_s'):6.2f}s  ITL p99 {med('itl_p99_s'):.3f}s  short {max(r['short_outputs'] for r in rs)}")
PY
}

calib_texts() {  # dir: the texts the compression benchmarks calibrate and evaluate on, written once
  # code.txt: CPython's standard-library source (the first ~600 KB of its modules, sorted);
  # docs.txt: Python's language reference (pydoc_data.topics), English prose of software documentation
  mkdir -p "$1"
  [ -f "$1/code.txt" ] && [ -f "$1/docs.txt" ] && return
  "$PY" - "$1" <<'PY'
import os, sys, sysconfig, pydoc_data.topics as t
out, lib, code, n = sys.argv[1], sysconfig.get_paths()["stdlib"], [], 0
open(os.path.join(out, "docs.txt"), "w").write("".join(t.topics[k] for k in sorted(t.topics)))
for f in sorted(os.listdir(lib)):
    if f.endswith(".py") and n < 600_000:
        code.append(open(os.path.join(lib, f), encoding="utf-8", errors="replace").read()); n += len(code[-1])
open(os.path.join(out, "code.txt"), "w").write("\n\n".join(code))
PY
}

mixed_calib() {  # dir -> the --calib flags of the mixed calibration set (prose, code, chat turns)
  echo --calib "$SHARED/data/wikitext-2/valid.txt" --calib "$1/code.txt" --calib "$SHARED/data/mt_bench/question.jsonl"
}

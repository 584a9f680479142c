#!/usr/bin/env bash
# The GPU check of the CUDA backend, for a machine with an NVIDIA GPU (made for the H200 machine of the device tool:
# 16 cores, torch + transformers + nvcc + cmake + nanobind + scikit-build-core installed, no internet). In well under
# 10 minutes: builds the core with KVCMAS_CUDA=ON there, makes random-weight GGUF files of the SmolLM2-135M,
# Qwen2-0.5B and Llama-3-8B shapes there (they are too large to travel), runs the GPU tests (tests/test_backend_ops.py:
# every op against numpy on CUDA and CPU, whole-model logits and greedy decoding against the CPU backend, a shared
# corrected span, device OOM), then the benchmarks of scripts/gpu_bench.py (kvcmas and PyTorch side by side), and
# writes everything to one file, $OUT/gpu-check.txt (OUT defaults to /tmp/gpu-check).
#
# gguf-py (for the model files) is not on that machine's image: carry its wheel. Here, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform any -d .whl gguf==0.19.0
# and call the device tool with carry [".whl"] and the command `scripts/gpu-check.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
REPORT="$OUT/gpu-check.txt"
: > "$REPORT"
START=$(date +%s)
BUDGET=${BUDGET_S:-540}  # the whole script, seconds
JOBS=${JOBS:-16}
PY=${PYTHON:-python3}
log() { echo "$*" | tee -a "$REPORT"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { log ""; log "== $* (t=$(($(date +%s) - START)) s)"; }

step "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader; nvcc --version | tail -2
  "$PY" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)'
  nproc; git log --oneline -1; } 2>&1 | tee -a "$REPORT"

if ! "$PY" -c 'import gguf' 2>/dev/null; then
  if ls .whl/gguf-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  "$PY" -c 'import gguf' 2>/dev/null || log "gguf-py is missing and no .whl/gguf-*.whl was carried: model files and tests will fail"
fi
# A models/generated link from the machine the tree came from points nowhere here: the tests write their own.
[ -L models/generated ] && [ ! -e models/generated ] && rm -f models/generated

step "build (KVCMAS_CUDA=ON, sm_90)"
BUILD=build-gpu
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVCMAS_CUDA=ON -DKVCMAS_CUDA_ARCHITECTURES=90-real \
  -DKVCMAS_TESTING_MODULE=ON -DPython_EXECUTABLE="$(command -v "$PY")" -DKVCMAS_MODULE_DIR="$PWD/$BUILD/py" 2>&1 | tail -3 | tee -a "$REPORT"
if ! timeout 300 cmake --build "$BUILD" --parallel "$JOBS" > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log" | tee -a "$REPORT"
  log "BUILD FAILED"
  exit 1
fi
export KVCMAS_CORE_PATH=$(ls "$PWD/$BUILD"/py/_core*.so)
export PYTHONPATH=$PWD/python:$PWD/models${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import kvcmas_cpp; print("backends:", kvcmas_cpp.backends())' 2>&1 | tee -a "$REPORT"

step "bench models (random weights, F16)"
MODELS=/tmp/kvcmas-bench-models
timeout 180 "$PY" models/make_bench_models.py "$MODELS" smollm2-135m qwen2-0.5b llama3-8b 2>&1 | tee -a "$REPORT" &
MODELS_PID=$!

step "GPU tests (tests/test_backend_ops.py, tests/test_backend_vision_ops.py)"
timeout 150 "$PY" -m pytest -q -x tests/test_backend_ops.py tests/test_backend_vision_ops.py -rs -p no:cacheprovider 2>&1 | tail -25 | tee -a "$REPORT"
wait "$MODELS_PID"

step "benchmarks (scripts/gpu_bench.py; kvcmas and PyTorch, fp16 weights, f16 KV)"
deadline=$(( $(left) - 20 ))
[ "$deadline" -gt 30 ] && timeout $((deadline + 15)) "$PY" scripts/gpu_bench.py "$MODELS" --deadline-s "$deadline" 2>&1 \
  | tee -a "$REPORT"
step "done"

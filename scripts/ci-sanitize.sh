#!/usr/bin/env bash
# CI: the core's C++-backed Python tests under AddressSanitizer + UndefinedBehaviorSanitizer.
#
# Builds the core and its bindings with -DKVCMAS_SANITIZE=ON into build-asan/ (module in build-asan/py), then runs
# the test files that drive C++ code with the sanitizer runtimes preloaded into Python. Any ASan report aborts the
# process and any UBSan report halts it (UBSAN_OPTIONS=halt_on_error=1), so pytest exits non-zero on every finding;
# the logs are also scanned for reports, in case one is printed by a process that still exits 0.
#
# Leaks are not checked inside Python (the interpreter leaks by design at exit, and a suppression for it would match
# every stack, ours included); a separate C++ program, tests/sanitizers/leak_check.cpp, runs the core under
# LeakSanitizer instead.
#
# Usage: scripts/ci-sanitize.sh [pytest args]     (env: JOBS=ninja jobs, default 2; BUILD_DIR, default build-asan)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD_DIR=${BUILD_DIR:-build-asan}
JOBS=${JOBS:-2}
mkdir -p "$BUILD_DIR"
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)
TESTS=(
  tests/test_model_errors.py
  tests/test_gguf.py
  tests/test_kernels.py
  tests/test_attention_kernel.py
  tests/test_backend_ops.py
  tests/test_shared_spans.py
  tests/test_kv_slots.py
  tests/test_concurrency.py
  tests/test_kv_types.py
  tests/test_agents.py
  tests/test_sharing_core.py
)
# Fidelity tests that repeat C++ paths covered above (ridge corrections: test_sharing_core) many times over: minutes
# under ASan for no new code reached.
SKIP=(
  --deselect tests/test_agents.py::test_kvcmas_calibrates_online_then_reuses_with_corrections
  --deselect tests/test_agents.py::test_kvcmas_is_closer_to_exact_than_fullshared
  --deselect tests/test_agents.py::test_four_agents_over_a_2k_token_context_reuse_from_the_first_workflow_and_calibrate
)

start=$(date +%s)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DKVCMAS_SANITIZE=ON -DKVCMAS_TESTING_MODULE=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$(command -v "$PY")" -DKVCMAS_MODULE_DIR="$BUILD_DIR/py" >/dev/null
cmake --build "$BUILD_DIR" --parallel "$JOBS"
built=$(date +%s)

core_so=$(ls "$BUILD_DIR"/py/_core*.so)
libasan=$(gcc -print-file-name=libasan.so)
libstdcxx=$(gcc -print-file-name=libstdc++.so)
# libstdc++ must be preloaded too: Python does not link it, and ASan's __cxa_throw interceptor has to find the real
# one when the runtime starts (otherwise the first C++ exception fails an ASan CHECK).
for lib in "$libasan" "$libstdcxx"; do
  [ -f "$lib" ] || { echo "ci-sanitize: $lib not found (gcc's sanitizer runtime is required)" >&2; exit 2; }
done

log=$(mktemp -t kvcmas-asan-XXXXXX.log)
status=0
# -s: the sanitizers write to stderr, which pytest's capture would drop when the process aborts.
asan_python=(env PYTHONPATH="$PWD/python" KVCMAS_CORE_PATH="$core_so" LD_PRELOAD="$libasan $libstdcxx"
  ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
  UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" "$PY")
"${asan_python[@]}" -m pytest -q -s -p no:cacheprovider --durations=10 "${TESTS[@]}" "${SKIP[@]}" "$@" 2>&1 | tee "$log" || status=$?

# Leaks, without Python: tests/sanitizers/leak_check.cpp drives the core directly with LeakSanitizer on. A canary
# that leaks on purpose first proves LeakSanitizer works on this machine (it cannot run under ptrace, for example).
echo "ci-sanitize: leak check"
lsan_dir=$(mktemp -d -t kvcmas-lsan-XXXXXX)
x86_flags=()
case "$(uname -m)" in x86_64 | amd64 | i?86) x86_flags=(-DKC_X86=1) ;; esac
printf '#include <cstdlib>\nint main() { void * volatile p = std::malloc(77); p = nullptr; return 0; }\n' \
  >"$lsan_dir/canary.cpp"
g++ -fsanitize=address "$lsan_dir/canary.cpp" -o "$lsan_dir/canary"
if ASAN_OPTIONS=detect_leaks=1 "$lsan_dir/canary" >"$lsan_dir/canary.log" 2>&1 ||
    ! grep -q "LeakSanitizer: detected memory leaks" "$lsan_dir/canary.log"; then
  echo "ci-sanitize: LeakSanitizer does not work here (canary leak not reported)" >&2
  cat "$lsan_dir/canary.log" >&2
  status=1
fi
g++ -std=c++17 -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -Icpp "${x86_flags[@]}" \
  tests/sanitizers/leak_check.cpp "$BUILD_DIR/libkvcmas_core.a" -pthread -o "$lsan_dir/leak_check"
tiny_model=$(cd models && "${asan_python[@]}" -c 'import make_test_models as m; print(m.ensure_tiny_models()[("llama", "Q8_0")])')
ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1" UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
  "$lsan_dir/leak_check" "$tiny_model" "$lsan_dir" 2>&1 | tee -a "$log" || status=$?
rm -rf "$lsan_dir"

if grep -qE "ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|AddressSanitizer: CHECK failed|SUMMARY: UndefinedBehaviorSanitizer" "$log"; then
  echo "ci-sanitize: sanitizer report found (log: $log)" >&2
  status=1
fi
end=$(date +%s)
echo "ci-sanitize: build $((built - start)) s, tests $((end - built)) s, status $status"
[ "$status" = 0 ] && rm -f "$log"
exit "$status"

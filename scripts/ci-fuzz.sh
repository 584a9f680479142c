#!/usr/bin/env bash
# CI: bounded coverage-guided fuzzing (atheris / libFuzzer) of the GGUF reader, the tokenizer, chat templates and
# image decoding, the server's request parsing, and the request-content path of a sharing session.
#
# Each target runs for FUZZ_SECONDS (default 45) from its seed corpus in fuzz/corpus/<target>/ and the inputs of
# past findings in fuzz/regressions/<target>/, with a fixed libFuzzer seed (FUZZ_SEED, default 1) so that a run is
# reproducible. The GGUF inputs it generated are then replayed
# against the AddressSanitizer build of the core when one exists (build-asan/, made by scripts/ci-sanitize.sh):
# atheris cannot fuzz under gcc's ASan runtime (it takes over the coverage hooks), but replaying the corpus still
# catches memory errors on every input the fuzzer found interesting.
#
# The package is the installed one, or python/ with the core named by KVCMAS_CORE_PATH. Exits non-zero on the first
# crash, hang (10 s), exception or sanitizer report; the failing input is kept under $FUZZ_OUT (printed).
#
# Usage: scripts/ci-fuzz.sh [target...]     (targets: gguf tokenizer chat image server content; default all)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SECONDS_PER_TARGET=${FUZZ_SECONDS:-45}
SEED=${FUZZ_SEED:-1}
OUT=${FUZZ_OUT:-$(mktemp -d -t kvcmas-fuzz-XXXXXX)}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf tokenizer chat image server content)

"$PY" -c "import atheris" 2>/dev/null || { echo "ci-fuzz: atheris is not installed (pip install atheris)" >&2; exit 2; }
if [ -n "${KVCMAS_CORE_PATH:-}" ]; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi

status=0
for target in "${targets[@]}"; do
  work="$OUT/$target"
  mkdir -p "$work/corpus" "$work/artifacts"
  seeds=("fuzz/corpus/$target")
  [ -d "fuzz/regressions/$target" ] && seeds+=("fuzz/regressions/$target")
  t0=$(date +%s)
  if "$PY" "fuzz/fuzz_$target.py" -seed="$SEED" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=3072 \
      -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" "${seeds[@]}" \
      >"$work/log" 2>&1; then
    runs=$(grep -oE "^Done [0-9]+ runs" "$work/log" | grep -oE "[0-9]+" || echo "?")
    echo "ci-fuzz: $target: $runs executions in $(($(date +%s) - t0)) s, no findings"
  else
    status=1
    echo "ci-fuzz: $target FAILED (log: $work/log, inputs: $work/artifacts/)" >&2
    grep -E "Traceback|Error|ERROR|== |Test unit written|Base64" "$work/log" | tail -20 >&2 || true
  fi
done

asan_core=$(ls build-asan/py/_core*.so 2>/dev/null | head -1 || true)
if [[ " ${targets[*]} " == *" gguf "* && -n "$asan_core" && "$status" = 0 ]]; then
  work="$OUT/gguf"
  if env PYTHONPATH="$PWD/python" KVCMAS_CORE_PATH="$PWD/$asan_core" \
      LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
      ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
      "$PY" fuzz/fuzz_gguf.py -runs=0 -artifact_prefix="$work/artifacts/asan-" "$work/corpus" "fuzz/corpus/gguf" \
      >"$work/asan.log" 2>&1 && ! grep -qE "ERROR: AddressSanitizer|runtime error:" "$work/asan.log"; then
    echo "ci-fuzz: gguf: $(find "$work/corpus" -type f | wc -l) corpus inputs replayed under ASan+UBSan, no findings"
  else
    status=1
    echo "ci-fuzz: gguf corpus replay under ASan FAILED (log: $work/asan.log)" >&2
    grep -E "ERROR|runtime error|SUMMARY|Test unit written" "$work/asan.log" | tail -20 >&2 || true
  fi
fi
[ "$status" = 0 ] && rm -rf "$OUT"
exit "$status"

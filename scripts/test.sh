#!/usr/bin/env bash
# Every test: formatting check, the release suite (C++, and the Python tests against the package
# installed into .venv from these sources), the whole suite under ASan+UBSan, the concurrent parts
# under ThreadSanitizer, and each fuzz target for FUZZ_SECONDS (default 60) on its seed corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/install_python.sh   # the Python package the python_interop tests import (skipped when current)
FUZZ_SECONDS=${FUZZ_SECONDS:-60}

echo "== format check"
scripts/format.sh --check

echo "== release build and tests"
scripts/build.sh release
ctest --test-dir build/release --output-on-failure -j 2

echo "== ASan+UBSan build and tests"
scripts/build.sh asan
# (the mpi tests run Open MPI, whose own allocations LeakSanitizer would report: release build only)
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build/asan --output-on-failure -j 2 -LE 'python|mpi'

echo "== ThreadSanitizer build: the concurrent parts (engine, memory, loader, device pipeline, tensor-parallel loads, in-process collectives, checks as bytes land)"
scripts/build.sh tsan
TSAN_OPTIONS="halt_on_error=1 suppressions=$PWD/scripts/tsan.supp" ctest --test-dir build/tsan --output-on-failure -j 2 -LE 'python|mpi' \
  -R 'Loader|Engine|Pread|Buffer|Budget|Residen|Device|Cuda|Staging|Collective|Cooperative|TensorParallelLoad|LandingCheck'

echo "== fuzz smoke runs (${FUZZ_SECONDS}s each)"
scripts/build.sh fuzz
for fuzzer in build/fuzz/fuzz/*_fuzz; do
  name=$(basename "$fuzzer" _fuzz)
  work=$(mktemp -d)
  cp -r "fuzz/corpus/$name/." "$work/"
  dict=()
  [ -f "fuzz/$name.dict" ] && dict=(-dict="fuzz/$name.dict")
  echo "-- $name"
  "$fuzzer" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$work/" "${dict[@]}" "$work" 2>&1 | grep -E '^(stat::number_of_executed_units|Done|==.*ERROR)' || true
  if ls "$work"/crash-* "$work"/timeout-* "$work"/oom-* >/dev/null 2>&1; then
    echo "fuzzer $name found a failing input:" >&2; ls "$work"/crash-* "$work"/timeout-* "$work"/oom-* >&2; exit 1
  fi
  rm -rf "$work"
done
echo "== all tests passed"

#!/usr/bin/env bash
# Every test: formatting check, the release suite (C++, and the Python tests against the package
# installed into .venv from these sources), the whole suite under ASan+UBSan, the concurrent parts
# under ThreadSanitizer, and each fuzz target for FUZZ_SECONDS (default 60) on its seed corpus,
# FUZZ_JOBS of them at a time (default: one per core; each is one single-threaded process).
# Each stage prints its wall-clock time, and the end a summary of them (CI's limit is 90 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
FUZZ_JOBS=${FUZZ_JOBS:-$(nproc)}

timings=()
stage_name=""
stage_start=$SECONDS
end_stage() {
  if [ -n "$stage_name" ]; then
    local took=$((SECONDS - stage_start))
    timings+=("$(printf '%5d s  %s' "$took" "$stage_name")")
    echo "-- $stage_name: ${took} s"
  fi
}
stage() {  # stage NAME: ends the stage before, starts NAME
  end_stage
  stage_name=$1
  stage_start=$SECONDS
  echo "== $1"
}

stage "dependencies and the Python package"
scripts/install_deps.sh
scripts/install_python.sh   # the Python package the python_interop tests import (skipped when current)

stage "format check"
scripts/format.sh --check

stage "release build"
scripts/build.sh release
stage "release tests"
ctest --test-dir build/release --output-on-failure -j 2 --timeout 300

stage "ASan+UBSan build"
scripts/build.sh asan
stage "ASan+UBSan tests"
# (the mpi tests run Open MPI, whose own allocations LeakSanitizer would report: release build only)
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build/asan --output-on-failure -j 2 --timeout 300 -LE 'python|mpi'

stage "ThreadSanitizer build"
scripts/build.sh tsan
stage "ThreadSanitizer tests"
# the concurrent parts: engine, memory, loader, device pipeline, tensor-parallel loads, in-process
# collectives, checks as bytes land, the object cache's downloads beside its readers
TSAN_OPTIONS="halt_on_error=1 suppressions='$PWD/scripts/tsan.supp'" ctest --test-dir build/tsan --output-on-failure -j 2 --timeout 300 -LE 'python|mpi' \
  -R 'Loader|Engine|Pread|Buffer|Budget|Residen|Device|Cuda|Staging|Collective|Cooperative|TensorParallelLoad|LandingCheck|ObjectCache'

stage "fuzz build"
scripts/build.sh fuzz
stage "fuzz smoke runs (${FUZZ_SECONDS} s each, ${FUZZ_JOBS} at a time)"
fuzz_root=$(mktemp -d)
trap 'rm -rf "$fuzz_root"' EXIT
fuzz_one() {  # fuzz_one FUZZER: runs it on a copy of its corpus; output and findings in $fuzz_root/NAME
  local fuzzer=$1 name work
  name=$(basename "$fuzzer" _fuzz)
  work="$fuzz_root/$name"
  mkdir -p "$work/corpus"
  cp -r "fuzz/corpus/$name/." "$work/corpus/"
  local dict=()
  [ -f "fuzz/$name.dict" ] && dict=(-dict="fuzz/$name.dict")
  local rc=0
  "$fuzzer" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$work/" "${dict[@]}" "$work/corpus" > "$work/log" 2>&1 || rc=$?
  echo "$rc" > "$work/rc"
}
fuzzers=(build/fuzz/fuzz/*_fuzz)
if [ ! -x "${fuzzers[0]}" ]; then
  echo "no fuzz targets in build/fuzz/fuzz/" >&2
  exit 1
fi
running=0
for fuzzer in "${fuzzers[@]}"; do
  if [ "$running" -ge "$FUZZ_JOBS" ]; then
    wait -n
    running=$((running - 1))
  fi
  fuzz_one "$fuzzer" &
  running=$((running + 1))
done
wait
failed=()
for fuzzer in "${fuzzers[@]}"; do
  name=$(basename "$fuzzer" _fuzz)
  echo "-- $name"
  grep -E '^(stat::number_of_executed_units|Done|==.*ERROR)' "$fuzz_root/$name/log" || true
  # A failure: libFuzzer's non-zero exit, or an input it wrote (crash, timeout, oom, leak).
  shopt -s nullglob
  found=("$fuzz_root/$name"/crash-* "$fuzz_root/$name"/timeout-* "$fuzz_root/$name"/oom-*
         "$fuzz_root/$name"/leak-*)
  shopt -u nullglob
  rc=$(cat "$fuzz_root/$name/rc")
  if [ "${#found[@]}" -gt 0 ] || [ "$rc" != 0 ]; then
    echo "fuzzer $name failed (exit $rc); the end of its log:" >&2
    tail -n 40 "$fuzz_root/$name/log" >&2
    if [ "${#found[@]}" -gt 0 ]; then
      # kept where scripts/fuzz_campaign.sh keeps its findings (git-ignored)
      mkdir -p "fuzz/artifacts/$name"
      cp "${found[@]}" "fuzz/artifacts/$name/"
      echo "its failing inputs, copied to fuzz/artifacts/$name/: ${found[*]##*/}" >&2
    fi
    failed+=("$name")
  fi
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz smoke runs failed: ${failed[*]}" >&2
  exit 1
fi
end_stage

echo "== all tests passed; wall-clock time per stage:"
printf '%s\n' "${timings[@]}"
echo "$(printf '%5d s' "$SECONDS")  in all"

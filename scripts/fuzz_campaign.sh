#!/usr/bin/env bash
# A fuzzing campaign: runs each libFuzzer target (all of build/fuzz/fuzz/*_fuzz, or the ones
# named) for a given time and/or number of executions on its corpus in the repository
# (fuzz/corpus/<name>), then minimizes what it has (the old corpus plus every input it kept) back
# into fuzz/corpus/<name>. docs/fuzzing.md has the results and the commands that produced them.
#
#   scripts/fuzz_campaign.sh [-t SECONDS] [-r RUNS] [-m SUMMARY.md] [-J SUMMARY.json] [-B] [NAME...]
#     -t SECONDS  stop each fuzzer after this many seconds (libFuzzer -max_total_time)
#     -r RUNS     stop each fuzzer after this many executions (libFuzzer -runs); with -t as well,
#                 whichever comes first. Neither: 600 seconds.
#     -m FILE     append a markdown table row per fuzzer to FILE (a header first if it is new)
#     -J FILE     append a JSON object per fuzzer to FILE (one per line)
#     -B          do not build (use build/fuzz as it is)
#     NAME        header, index, shard, ... (the fuzzer is build/fuzz/fuzz/NAME_fuzz)
#
# Minimizing: the seeds written by hand (any file whose name is not libFuzzer's 40-hex-digit
# SHA-1: the examples, the reproducers of fixed bugs) are always kept as they are; libFuzzer
# -merge=1 then adds, from the old corpus and the new inputs, only those that bring coverage the
# kept set lacks. The result replaces fuzz/corpus/<name>, so running the script again starts where
# this run left off (and, with nothing new found, leaves the corpus as it is).
#
# Failing inputs (crash-*, timeout-*, oom-*, leak-*) go to fuzz/artifacts/<name>/ (git-ignored);
# the script goes on with the other fuzzers and exits 1 at the end naming every one found in this
# run. Each fuzzer runs alone (one process, no -jobs/-workers) under `nice -n 19`, so a campaign
# can share a machine with builds; a fuzzer stopped for a while (SIGSTOP) just runs fewer inputs
# in its time.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="" runs="" md="" json="" build=1
while getopts "t:r:m:J:Bh" opt; do
  case "$opt" in
    t) seconds=$OPTARG ;;
    r) runs=$OPTARG ;;
    m) md=$OPTARG ;;
    J) json=$OPTARG ;;
    B) build=0 ;;
    *) sed -n '2,16p' "$0" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ -z "$seconds" ] && [ -z "$runs" ] && seconds=600

if [ "$build" = 1 ]; then
  JOBS=${JOBS:-1} nice -n 19 scripts/build.sh fuzz
fi

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in build/fuzz/fuzz/*_fuzz; do names+=("$(basename "$f" _fuzz)"); done
fi

if [ -n "$md" ] && [ ! -s "$md" ]; then
  {
    echo "| fuzzer | executions | seconds | exec/s | corpus before (files, bytes) | corpus after (files, bytes) | cov | ft | result |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|---|"
  } >"$md"
fi

# "files bytes" of a directory.
corpus_size() {
  local n b
  n=$(find "$1" -maxdepth 1 -type f | wc -l)
  b=$(find "$1" -maxdepth 1 -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  echo "$n $b"
}

failures=()
for name in "${names[@]}"; do
  fuzzer=build/fuzz/fuzz/${name}_fuzz
  corpus=fuzz/corpus/$name
  if [ ! -x "$fuzzer" ]; then echo "no fuzzer $fuzzer" >&2; exit 2; fi
  mkdir -p "$corpus" "fuzz/artifacts/$name"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  mkdir "$work/in" "$work/min"
  cp -r "$corpus/." "$work/in/"
  read -r before_files before_bytes < <(corpus_size "$corpus")
  dict=()
  [ -f "fuzz/$name.dict" ] && dict=(-dict="fuzz/$name.dict")
  limits=()
  [ -n "$seconds" ] && limits+=(-max_total_time="$seconds")
  [ -n "$runs" ] && limits+=(-runs="$runs")
  touch "$work/start"

  echo "== $name: ${limits[*]} on $corpus ($before_files files, $before_bytes bytes)"
  start=$(date +%s.%N)
  set +e
  nice -n 19 "$fuzzer" "${limits[@]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="fuzz/artifacts/$name/" "${dict[@]}" "$work/in" >"$work/log" 2>&1
  rc=$?
  set -e
  elapsed=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "%.0f", e - s}')
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/log" | tail -1)
  # The last status line ("#N DONE cov: X ft: Y corp: ...", or the last pulse before a crash).
  last=$(grep -E '^#[0-9]+.*cov: ' "$work/log" | tail -1 || true)
  [ -z "$execs" ] && execs=$(sed -E 's/^#([0-9]+).*/\1/' <<<"$last")
  [ -z "$rate" ] && rate=$(sed -nE 's/.*exec\/s: ([0-9]+).*/\1/p' <<<"$last")

  # Minimize: the hand-written seeds first, then whatever of the rest adds coverage.
  find "$corpus" -maxdepth 1 -regextype posix-extended -type f ! -regex '.*/[0-9a-f]{40}' -exec cp {} "$work/min/" \;
  nice -n 19 "$fuzzer" -merge=1 -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="fuzz/artifacts/$name/" "$work/min" "$work/in" >"$work/merge.log" 2>&1 || {
    echo "merge of $name failed:" >&2; tail -20 "$work/merge.log" >&2; exit 1
  }
  rm -rf "$corpus"
  mkdir -p "$corpus"
  cp -r "$work/min/." "$corpus/"
  read -r after_files after_bytes < <(corpus_size "$corpus")
  # Coverage of the corpus kept: what a fresh run starts from.
  inited=$(nice -n 19 "$fuzzer" -runs=0 -rss_limit_mb=2048 "$corpus" 2>&1 | grep -E 'INITED|DONE' | tail -1 || true)
  cov=$(sed -nE 's/.*cov: ([0-9]+).*/\1/p' <<<"$inited")
  ft=$(sed -nE 's/.*ft: ([0-9]+).*/\1/p' <<<"$inited")

  found=$(find "fuzz/artifacts/$name" -type f -newer "$work/start" | sort)
  result=ok
  if [ -n "$found" ]; then
    result="FAILED: $(echo $found)"
    failures+=($found)
  elif [ "$rc" != 0 ]; then
    result="FAILED: fuzzer exited $rc"
    failures+=("$name (exit $rc; log below)")
    tail -30 "$work/log" >&2
  fi
  echo "   $name: ${execs:-?} executions in ${elapsed}s (${rate:-?} exec/s); corpus" \
    "$before_files files/$before_bytes bytes -> $after_files files/$after_bytes bytes;" \
    "cov ${cov:-?} ft ${ft:-?}; $result"
  if [ -n "$md" ]; then
    echo "| $name | ${execs:-?} | $elapsed | ${rate:-?} | $before_files, $before_bytes | $after_files, $after_bytes | ${cov:-?} | ${ft:-?} | $result |" >>"$md"
  fi
  if [ -n "$json" ]; then
    printf '{"fuzzer":"%s","executions":%s,"seconds":%s,"exec_per_sec":%s,"corpus_before":{"files":%s,"bytes":%s},"corpus_after":{"files":%s,"bytes":%s},"cov":%s,"ft":%s,"result":"%s","date":"%s"}\n' \
      "$name" "${execs:-null}" "$elapsed" "${rate:-null}" "$before_files" "$before_bytes" \
      "$after_files" "$after_bytes" "${cov:-null}" "${ft:-null}" "$result" \
      "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >>"$json"
  fi
  rm -rf "$work"
  trap - EXIT
done

if [ ${#failures[@]} -gt 0 ]; then
  echo "failing inputs found:" >&2
  printf '  %s\n' "${failures[@]}" >&2
  exit 1
fi

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

# Sorts new artifacts: a timeout-* or slow-unit-* input that now runs within the timeout only ran
# long because the process was stopped or starved (libFuzzer's clock is wall-clock): moved to
# fuzz/artifacts/<name>/stalled/. True when anything else (a real finding) is left.
real_findings() {
  local f real=1
  for f in "$@"; do
    case "$(basename "$f")" in
      timeout-* | slow-unit-*)
        if nice -n 19 "$fuzzer" -timeout=10 -rss_limit_mb=2048 "$f" >/dev/null 2>&1; then
          mkdir -p "fuzz/artifacts/$name/stalled"
          mv "$f" "fuzz/artifacts/$name/stalled/"
          continue
        fi ;;
    esac
    real=0
  done
  return $real
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
  touch "$work/start"

  what=""
  [ -n "$seconds" ] && what+="${seconds}s "
  [ -n "$runs" ] && what+="$runs runs "
  echo "== $name: ${what}on $corpus ($before_files files, $before_bytes bytes)"
  # Runs the fuzzer until the time or the runs are used up; after a stall (real_findings) the
  # fuzzer starts again for what is left.
  start=$(date +%s.%N)
  end=$(($(date +%s) + ${seconds:-0}))
  execs=0 stalls=0 stalled_s=0 rc=0
  : >"$work/all.log"
  while :; do
    limits=()
    if [ -n "$seconds" ]; then
      left=$((end - $(date +%s)))
      [ "$left" -le 0 ] && break
      limits+=(-max_total_time="$left")
    fi
    if [ -n "$runs" ]; then
      [ "$execs" -ge "$runs" ] && break
      limits+=(-runs="$((runs - execs))")
    fi
    touch "$work/segment"
    set +e
    nice -n 19 "$fuzzer" "${limits[@]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="fuzz/artifacts/$name/" "${dict[@]}" "$work/in" >"$work/log" 2>&1
    rc=$?
    set -e
    cat "$work/log" >>"$work/all.log"
    n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/log" | tail -1)
    # Without final stats (a crash), the last status line ("#N ... cov: ...").
    [ -z "$n" ] && n=$(grep -E '^#[0-9]+' "$work/log" | tail -1 | sed -E 's/^#([0-9]+).*/\1/')
    execs=$((execs + ${n:-0}))
    new=$(find "fuzz/artifacts/$name" -maxdepth 1 -type f -newer "$work/segment")
    if [ -n "$new" ] && ! real_findings $new; then
      stalls=$((stalls + 1))
      # How long the unit seemed to run: the time the process stood still, roughly.
      still=$(sed -nE 's/^(ALARM: working on the last Unit for|Slowest unit:) ([0-9]+) s.*/\2/p' "$work/log" | sort -n | tail -1)
      stalled_s=$((stalled_s + ${still:-0}))
      echo "   (a timeout or slow unit that does not reproduce: the process stood still ~${still:-?}s)"
      [ "$rc" != 0 ] && { rc=0; continue; }
    fi
    break
  done
  elapsed=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN {printf "%.0f", e - s}')
  # exec/s over the time the fuzzer could run (stalls left out)
  rate=$(awk -v n="$execs" -v t="$((elapsed - stalled_s))" 'BEGIN {printf "%.0f", (t > 0 ? n / t : 0)}')

  # Minimize: the hand-written seeds first, then whatever of the rest adds coverage.
  find "$corpus" -maxdepth 1 -regextype posix-extended -type f ! -regex '.*/[0-9a-f]{40}' -exec cp {} "$work/min/" \;
  # (an input that fails here failed above too; the merge's own artifacts are dropped)
  nice -n 19 "$fuzzer" -merge=1 -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$work/merge-" "$work/min" "$work/in" >"$work/merge.log" 2>&1 || {
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

  found=$(find "fuzz/artifacts/$name" -maxdepth 1 -type f -newer "$work/start" | sort)
  result=ok
  [ "$stalls" -gt 0 ] && result="ok ($stalls stalls, ${stalled_s}s)"
  if [ -n "$found" ]; then
    result="FAILED: $(echo $found)"
    failures+=($found)
  elif [ "$rc" != 0 ]; then
    result="FAILED: fuzzer exited $rc"
    failures+=("$name (exit $rc; log below)")
    tail -30 "$work/all.log" >&2
  fi
  echo "   $name: $execs executions in ${elapsed}s (${rate:-?} exec/s); corpus" \
    "$before_files files/$before_bytes bytes -> $after_files files/$after_bytes bytes;" \
    "cov ${cov:-?} ft ${ft:-?}; $result"
  if [ -n "$md" ]; then
    echo "| $name | $execs | $elapsed | ${rate:-?} | $before_files, $before_bytes | $after_files, $after_bytes | ${cov:-?} | ${ft:-?} | $result |" >>"$md"
  fi
  if [ -n "$json" ]; then
    printf '{"fuzzer":"%s","executions":%s,"seconds":%s,"exec_per_sec":%s,"corpus_before":{"files":%s,"bytes":%s},"corpus_after":{"files":%s,"bytes":%s},"cov":%s,"ft":%s,"stalls":%s,"stalled_seconds":%s,"result":"%s","date":"%s"}\n' \
      "$name" "$execs" "$elapsed" "$rate" "$before_files" "$before_bytes" \
      "$after_files" "$after_bytes" "${cov:-null}" "${ft:-null}" "$stalls" "$stalled_s" "$result" \
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

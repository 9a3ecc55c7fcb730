#!/usr/bin/env bash
# A lent GPU machine's session (docs/gpu.md, "On the lent GPU machine"): the GPU check, the
# benchmark, the models, the host checksum cost and a profile, each phase under its own time
# limit so that a slow one cannot take the next one's time, with every output brought back in at
# most eight files (the device tool's limit). Run on the GPU machine, from the checkout, with the
# kit (.gpukit, built on the development VM by scripts/gpu_kit.sh: the GPU machine has no network)
# carried. Two calls, the second at once, fit a 15-minute session with room for a short rerun:
#
#   PHASES=check OUT=... scripts/gpu_session.sh                          # timeout_s 400
#   PHASES="models verify probe profile" OUT=... scripts/gpu_session.sh  # timeout_s 300
#
# PHASES (default: all five in that order, which is refused: their limits exceed one call):
#   check    build, GPU tests, the CLI's device checksums against the host load, then the warm
#            benchmark, the rows that matter most first (CHECK_SECONDS, default 370)
#   models   from_pretrained (plain, loading(to_device=False), loading(to_device=True)), then
#            load_checkpoint_and_dispatch (MODELS_SECONDS, default 200)
#   verify   what checksums cost a host load on this machine's cores, warm and cold
#            (bench/verify_bench.py on one ~1 GB shard; issue 15's targets, which 2-core VMs
#            cannot show; VERIFY_SECONDS, default 30)
#   probe    whether copying straight from registered page-cache pages could beat the staging
#            ring (bench/register_probe.py on one ~1 GB shard; PROBE_SECONDS, default 15)
#   profile  one from_pretrained in loading(to_device=True), in a fresh process, under cProfile
#            (the top 30 by cumulative time; PROFILE_SECONDS, default 25)
# The chosen phases' limits must sum to at most MAX_SECONDS (570: one call may run 600 s); more
# is refused (exit 2) before anything runs, as is a missing kit. Each phase runs as a bash process
# of its own (errexit holds inside it) under `timeout -k 10`; a phase that fails or runs out of
# time is reported and the next one still runs; the exit status is 1 when any failed.
# Also: LOADERS (bench/gpu_bench.py's loaders; default below, the ones that matter first),
# CHILD_SECONDS (the most one loader's child may run, default 75: a hung peer loses its row, not
# the phase), REPEATS, MODEL_REPEATS (default 3 and 2), GPU_KIT (default .gpukit). Every phase
# builds first when the build is missing.
# Outputs in $OUT: session.log (everything printed, the profile included, line by line as it
# comes), check.tgz (build.log, gpu_tests.log, bench.log, load_cuda.json, gpu_bench.json,
# doctor.json), models.tgz (models.log and its JSON) and verify.tgz (the build's output and
# verify_bench's JSON), each archive written as soon as its phase ends, also when it failed or
# ran out of time (gpu_bench.json is rewritten after every row).
set -uo pipefail
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$self")/.." || exit 2
kit=${GPU_KIT:-.gpukit}
work=${TMPDIR:-/tmp}/gpu_session

# The first .safetensors file of the first of the folders "$@" that holds one (sorted by name:
# model-00001-of-... first).
first_shard() {
  local d f
  for d in "$@"; do
    f=$(find "$d" -maxdepth 1 -name '*.safetensors' 2>/dev/null | sort | head -n 1)
    if [ -n "$f" ]; then
      echo "$f"
      return 0
    fi
  done
  return 1
}

# --- the phases: each runs as `bash gpu_session.sh --phase NAME` (set -e), under its timeout ---
default_loaders="tensorferry (gds off),safetensors,runai-model-streamer,fastsafetensors"
default_loaders+=",tensorferry (load_file),tensorferry (load_into)"
default_loaders+=",tensorferry (gds off, verify off)"
default_loaders+=",tensorferry (tp 0/8),tensorferry (device budget 1GB),tensorferry (tp 0/2)"
default_loaders+=",tensorferry (get_tensor),safetensors (get_tensor)"

phase_check() {
  exec env GPU_CHECK_OUT="$work/check" GPU_KIT="$kit" JOBS="${JOBS:-16}" WERROR=OFF \
    KEEP_GOING=1 REPEATS="${REPEATS:-3}" VERIFY_PAIRS="${VERIFY_PAIRS:-3}" HOST_VERIFY_ROUNDS=0 \
    BENCH_ARGS="--modes warm --child-timeout ${CHILD_SECONDS:-75}" \
    LOADERS="${LOADERS:-$default_loaders}" scripts/gpu_check.sh all
}

phase_models() {
  exec env GPU_CHECK_OUT="$work/models" GPU_KIT="$kit" JOBS="${JOBS:-16}" WERROR=OFF \
    KEEP_GOING=1 MODEL_REPEATS="${MODEL_REPEATS:-2}" MODEL_FLOWS="from_pretrained dispatch" \
    scripts/gpu_check.sh models
}

# Builds (gpu_check.sh build) unless the CLI and .venv are there (made by an earlier phase of
# this session: the tree has not changed since); the build's own output goes to $1 (for verify:
# verify.tgz, build_console.log beside gpu_check's build.log), its tail to the session on failure.
build_quietly() {
  local dir=$1
  [ -x build/release/bin/tensorferry ] && [ -x .venv/bin/python ] && return 0
  if ! env GPU_CHECK_OUT="$dir" GPU_KIT="$kit" JOBS="${JOBS:-16}" WERROR=OFF \
      scripts/gpu_check.sh build > "$dir/build_console.log" 2>&1; then
    tail -n 30 "$dir/build_console.log"
    echo "gpu_session: the build failed (its output's end above; whole in $dir, archived for" \
      "verify only)" >&2
    return 1
  fi
}

phase_verify() {
  # One shard of the check's checkpoint, else of the models' (a warm machine keeps data/), else
  # of a checkpoint made for it (~1 GB shards).
  local dir=$work/verify shard
  build_quietly "$dir"
  # shellcheck source=/dev/null
  . "$kit/env.sh"
  if ! shard=$(first_shard data/gpu_check data/default); then
    build/release/bin/tensorferry gen data/verify --preset default --layers 16 --no-sync \
      > "$dir/gen.log" 2>&1 || { cat "$dir/gen.log"; return 1; }
    shard=$(first_shard data/verify)
  fi
  echo "shard: $shard"
  PYTHONUNBUFFERED=1 .venv/bin/python bench/verify_bench.py "$shard" \
    --cli build/release/bin/tensorferry --rounds 3 --engine io_uring --save "$dir/verify.json"
}

phase_probe() {
  local shard
  build_quietly "$work/probe"
  # shellcheck source=/dev/null
  . "$kit/env.sh"
  shard=$(first_shard data/gpu_check data/default data/verify) ||
    { echo "gpu_session: no checkpoint under data/ to probe (run check or verify first)" >&2
      return 1; }
  echo "shard: $shard"
  PYTHONUNBUFFERED=1 .venv/bin/python bench/register_probe.py "$shard" --repeats 3
}

phase_profile() {
  build_quietly "$work/profile"
  # The kit's environment: the module links its libraries.
  # shellcheck source=/dev/null
  . "$kit/env.sh"
  PYTHONUNBUFFERED=1 .venv/bin/python bench/model_bench.py "${MODEL_DATA:-data/default}" \
    --flow from_pretrained --device-map cuda --child tf-to-device --profile 30
}

if [ "${1:-}" = --phase ]; then
  set -e
  "phase_$2"
  exit
fi

# --- the session ---------------------------------------------------------------------------------
: "${OUT:?OUT: the folder whose files come back}"
phases=${PHASES:-check models verify probe profile}
declare -A limit=([check]=${CHECK_SECONDS:-370} [models]=${MODELS_SECONDS:-200}
                  [verify]=${VERIFY_SECONDS:-30} [probe]=${PROBE_SECONDS:-15}
                  [profile]=${PROFILE_SECONDS:-25})
total=0
for phase in $phases; do
  case "$phase" in
    check | models | verify | probe | profile) total=$((total + limit[$phase])) ;;
    *) echo "gpu_session: unknown phase '$phase' (check, models, verify, probe, profile)" >&2
       exit 2 ;;
  esac
done
max_total=${MAX_SECONDS:-570}
if [ "$total" -gt "$max_total" ]; then
  cat >&2 <<EOF
gpu_session: the phases '$phases' may take $total s, more than $max_total s of one call (the
device tool stops a command at 600 s). Run two calls, the second at once (docs/gpu.md):
  PHASES=check OUT=\$OUT scripts/gpu_session.sh                          # timeout_s 400
  PHASES="models verify probe profile" OUT=\$OUT scripts/gpu_session.sh  # timeout_s 300
EOF
  exit 2
fi
if [ ! -f "$kit/env.sh" ]; then
  echo "gpu_session: $kit/env.sh is missing: build the kit on the development VM first" \
    "(scripts/gpu_kit.sh, needs the network) and carry it ([\"$kit\"]); the GPU machine has" \
    "no package registry" >&2
  exit 2
fi

rm -rf "$work"
mkdir -p "$work/check" "$work/models" "$work/verify" "$work/probe" "$work/profile"
mkdir -p "$OUT"
log=$OUT/session.log
failed=()

run_phase() {
  # $1: name, $2: seconds. Prints the phase's lines but CMake's and ninja's progress ("[ 42%]",
  # "[12/300]"), line by line, into session.log; "[gpu loader] ..." lines stay.
  local name=$1 seconds=$2
  echo "== $name (at most $seconds s)" | tee -a "$log"
  local start=$SECONDS
  timeout -k 10 "$seconds" bash "$self" --phase "$name" 2>&1 |
    grep --line-buffered -vE '^\[( *[0-9]+%|[0-9]+/[0-9]+)\]' >> "$log"
  local rc=${PIPESTATUS[0]} why=""
  case "$rc" in
    0) ;;
    124 | 137) why=" (timed out at $seconds s)" ;;
    *) why=" (failed)" ;;
  esac
  [ "$rc" = 0 ] || failed+=("$name$why")
  echo "== $name: exit $rc after $((SECONDS - start)) s$why" | tee -a "$log"
}

for phase in $phases; do
  run_phase "$phase" "${limit[$phase]}"
  case "$phase" in  # what the phase left, also when it failed or ran out of time
    check | models | verify) tar czf "$OUT/$phase.tgz" -C "$work/$phase" . ;;
  esac
done
# The summary lines, for the reply's tail.
summary='^(pinned|pageable|tensorferry|safetensors|runai|fastsafetensors|staged|register|chunked)'
summary+=' .* GB/s|^warm: |^  (floor|warm|cold)'
summary+='|checksum|GB/s;|exit [0-9]+ after|passed|failed|timed out'
grep -E "$summary" "$log" | grep -vE '^  ((warm|cold) round|data/)' | tail -70
if [ ${#failed[@]} -gt 0 ]; then
  echo "== gpu_session: phases failed: $(printf '%s, ' "${failed[@]}" | sed 's/, $//')" \
    "(their output: session.log)" | tee -a "$log"
  exit 1
fi
echo "== gpu_session: every phase passed: $phases" | tee -a "$log"

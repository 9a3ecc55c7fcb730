#!/usr/bin/env bash
# One call of a lent GPU machine (docs/gpu.md, "On the lent GPU machine"): the GPU check, the
# benchmark and the models, each phase under its own time limit so that a slow one cannot take the
# next one's time, with every output brought back in at most eight files (the device tool's
# limit). Run on the GPU machine, from the checkout, with the kit (.gpukit) carried:
#
#   OUT=... scripts/gpu_session.sh            # device tool: carry [".gpukit"], timeout_s 570
#
# Settings (seconds; the defaults fit a 570 s call on a fresh H200, the build ~85 s):
#   CHECK_SECONDS   build, GPU tests and the warm benchmark (default 320)
#   MODELS_SECONDS  the models: from_pretrained (plain, loading(), loading(to_device=True)),
#                   then load_checkpoint_and_dispatch (default 200)
#   PROFILE_SECONDS one from_pretrained in loading(to_device=True), in a fresh process, under
#                   cProfile (the top 30 by cumulative time; default 40; 0: skipped)
#   LOADERS         bench/gpu_bench.py's loaders (default: below, the ones that matter first)
#   REPEATS, MODEL_REPEATS (default 3 and 2)
# Outputs in $OUT: session.log (everything printed, the profile included), check.tgz (build.log,
# gpu_tests.log, bench.log, load_cuda.json, gpu_bench.json, doctor.json) and models.tgz (models.log
# and its JSON), each archive written as soon as its phase ends.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
: "${OUT:?OUT: the folder whose files come back}"
check_seconds=${CHECK_SECONDS:-320}
models_seconds=${MODELS_SECONDS:-200}
profile_seconds=${PROFILE_SECONDS:-40}
default_loaders="tensorferry (gds off),safetensors,tensorferry (load_file),tensorferry (load_into)"
default_loaders+=",tensorferry (device budget 1GB),runai-model-streamer,fastsafetensors"
default_loaders+=",tensorferry (tp 0/2),tensorferry (tp 0/8),tensorferry (gds off, verify off)"
loaders=${LOADERS:-$default_loaders}
work=${TMPDIR:-/tmp}/gpu_session
rm -rf "$work"
mkdir -p "$work/check" "$work/models"
log=$OUT/session.log

run_phase() {
  # $1: name, $2: seconds, then the command. Prints its lines without the build's progress.
  local name=$1 seconds=$2
  shift 2
  echo "== $name (at most $seconds s)" | tee -a "$log"
  local start=$SECONDS
  timeout "$seconds" "$@" 2>&1 | grep -vE '^\[' | tee -a "$log" > /dev/null
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$log"
}

run_phase check "$check_seconds" env GPU_CHECK_OUT="$work/check" JOBS="${JOBS:-16}" WERROR=OFF \
  KEEP_GOING=1 REPEATS="${REPEATS:-3}" VERIFY_PAIRS="${VERIFY_PAIRS:-3}" HOST_VERIFY_ROUNDS=0 \
  BENCH_ARGS="--modes warm" LOADERS="$loaders" scripts/gpu_check.sh all
tar czf "$OUT/check.tgz" -C "$work/check" .
run_phase models "$models_seconds" env GPU_CHECK_OUT="$work/models" JOBS="${JOBS:-16}" \
  WERROR=OFF KEEP_GOING=1 MODEL_REPEATS="${MODEL_REPEATS:-2}" \
  MODEL_FLOWS="from_pretrained dispatch" scripts/gpu_check.sh models
tar czf "$OUT/models.tgz" -C "$work/models" .
if [ "$profile_seconds" -gt 0 ]; then
  # The kit's environment (the module links its libraries); the inner shell expands the rest.
  # shellcheck disable=SC1091,SC2016
  run_phase profile "$profile_seconds" bash -c '. .gpukit/env.sh && PYTHONUNBUFFERED=1 \
    .venv/bin/python bench/model_bench.py "${MODEL_DATA:-data/default}" --flow from_pretrained \
    --device-map cuda --child tf-to-device --profile 30'
fi
# The summary lines, for the reply's tail.
summary='^(pinned|pageable|tensorferry|safetensors|runai|fastsafetensors) .* GB/s|^warm: '
summary+='|checksum|GB/s;|exit [0-9]+ after|passed|failed'
grep -E "$summary" \
  "$log" | grep -v '^  ' | tail -60

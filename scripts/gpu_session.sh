#!/usr/bin/env bash
# A lent GPU machine's session (docs/gpu.md, "On the lent GPU machine"): the GPU check, the
# benchmark, the models, the host checksum cost and a profile, each phase under its own time
# limit so that a slow one cannot take the next one's time, with every output brought back in at
# most eight files (the device tool's limit). Run on the GPU machine, from the checkout, with the
# kit (.gpukit) carried; two calls fit a 15-minute session:
#
#   PHASES=check OUT=... scripts/gpu_session.sh                  # fresh machine: timeout_s 510
#   PHASES="models verify probe profile" OUT=... scripts/gpu_session.sh  # at once: timeout_s 310
#
# PHASES (default: all five in that order):
#   check    build, GPU tests and the warm benchmark (CHECK_SECONDS, default 480)
#   models   from_pretrained (plain, loading(to_device=False), loading(to_device=True)), then
#            load_checkpoint_and_dispatch (MODELS_SECONDS, default 180)
#   verify   what checksums cost a host load on this machine's cores, warm and cold
#            (bench/verify_bench.py on one ~1 GB shard; issue 15's targets, which 2-core VMs
#            cannot show; VERIFY_SECONDS, default 50)
#   probe    whether copying straight from registered page-cache pages could beat the staging
#            ring (bench/register_probe.py on one ~1 GB shard; PROBE_SECONDS, default 30)
#   profile  one from_pretrained in loading(to_device=True), in a fresh process, under cProfile
#            (the top 30 by cumulative time; PROFILE_SECONDS, default 25)
# Also: LOADERS (bench/gpu_bench.py's loaders; default below, the ones that matter first),
# REPEATS, MODEL_REPEATS (default 3 and 2). Every phase builds first when the build is missing.
# Outputs in $OUT: session.log (everything printed, the profile included), check.tgz (build.log,
# gpu_tests.log, bench.log, load_cuda.json, gpu_bench.json, doctor.json) and models.tgz (models.log
# and its JSON), each archive written as soon as its phase ends.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
: "${OUT:?OUT: the folder whose files come back}"
phases=${PHASES:-check models verify probe profile}
check_seconds=${CHECK_SECONDS:-480}
models_seconds=${MODELS_SECONDS:-180}
verify_seconds=${VERIFY_SECONDS:-50}
probe_seconds=${PROBE_SECONDS:-30}
profile_seconds=${PROFILE_SECONDS:-25}
for phase in $phases; do
  case "$phase" in
    check | models | verify | probe | profile) ;;
    *) echo "gpu_session: unknown phase '$phase' (check, models, verify, probe, profile)" >&2
       exit 2 ;;
  esac
done
default_loaders="tensorferry (gds off),safetensors,tensorferry (load_file),tensorferry (load_into)"
default_loaders+=",tensorferry (device budget 1GB),runai-model-streamer,fastsafetensors"
default_loaders+=",tensorferry (tp 0/2),tensorferry (tp 0/8),tensorferry (gds off, verify off)"
default_loaders+=",tensorferry (get_tensor),safetensors (get_tensor)"
loaders=${LOADERS:-$default_loaders}
work=${TMPDIR:-/tmp}/gpu_session
rm -rf "$work"
mkdir -p "$work/check" "$work/models" "$work/verify"
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

for phase in $phases; do
  case "$phase" in
    check)
      run_phase check "$check_seconds" env GPU_CHECK_OUT="$work/check" JOBS="${JOBS:-16}" \
        WERROR=OFF KEEP_GOING=1 REPEATS="${REPEATS:-3}" VERIFY_PAIRS="${VERIFY_PAIRS:-3}" \
        HOST_VERIFY_ROUNDS=0 BENCH_ARGS="--modes warm" LOADERS="$loaders" scripts/gpu_check.sh all
      tar czf "$OUT/check.tgz" -C "$work/check" .
      ;;
    models)
      run_phase models "$models_seconds" env GPU_CHECK_OUT="$work/models" JOBS="${JOBS:-16}" \
        WERROR=OFF KEEP_GOING=1 MODEL_REPEATS="${MODEL_REPEATS:-2}" \
        MODEL_FLOWS="from_pretrained dispatch" scripts/gpu_check.sh models
      tar czf "$OUT/models.tgz" -C "$work/models" .
      ;;
    verify)
      # One shard of the check's checkpoint, else of the models' (a warm machine keeps data/),
      # else a checkpoint made for it (~1 GB shards).
      # shellcheck disable=SC1091,SC2016
      run_phase verify "$verify_seconds" bash -c 'env GPU_CHECK_OUT="$1" JOBS="${JOBS:-16}" \
        WERROR=OFF scripts/gpu_check.sh build > /dev/null && . .gpukit/env.sh && \
        shard=$(find data/gpu_check data/default -maxdepth 1 -name "*.safetensors" 2>/dev/null |
                sort | head -1) && \
        if [ -z "$shard" ]; then build/release/bin/tensorferry gen data/verify --preset default \
          --layers 16 --no-sync > /dev/null && shard=$(ls data/verify/*.safetensors | head -1); fi &&
        echo "shard: $shard" && PYTHONUNBUFFERED=1 .venv/bin/python bench/verify_bench.py \
          "$shard" --cli build/release/bin/tensorferry --rounds 3 --engine io_uring' _ "$work/verify"
      ;;
    probe)
      # shellcheck disable=SC1091,SC2016
      run_phase probe "$probe_seconds" bash -c '. .gpukit/env.sh && \
        shard=$(find data/gpu_check data/default data/verify -maxdepth 1 -name "*.safetensors" \
                2>/dev/null | sort | head -1) && echo "shard: $shard" && [ -n "$shard" ] && \
        PYTHONUNBUFFERED=1 .venv/bin/python bench/register_probe.py "$shard" --repeats 3'
      ;;
    profile)
      # The kit's environment (the module links its libraries); the inner shell expands the rest.
      # shellcheck disable=SC1091,SC2016
      run_phase profile "$profile_seconds" bash -c '. .gpukit/env.sh && PYTHONUNBUFFERED=1 \
        .venv/bin/python bench/model_bench.py "${MODEL_DATA:-data/default}" --flow \
        from_pretrained --device-map cuda --child tf-to-device --profile 30'
      ;;
  esac
done
# The summary lines, for the reply's tail.
summary='^(pinned|pageable|tensorferry|safetensors|runai|fastsafetensors|staged|register|chunked)'
summary+=' .* GB/s|^warm: |^  (floor|warm|cold)'
summary+='|checksum|GB/s;|exit [0-9]+ after|passed|failed'
grep -E "$summary" \
  "$log" | grep -vE '^  ((warm|cold) round|data/)' | tail -70

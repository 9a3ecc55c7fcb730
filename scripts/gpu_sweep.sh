#!/usr/bin/env bash
# Tuning sweep for the device pipeline on a GPU machine (docs/gpu.md): warm loads of the GPU-check
# checkpoint through bench/gpu_bench.py with TENSORFERRY_DEVICE_PRODUCERS x TENSORFERRY_STAGING_BYTES
# (SWEEP_PRODUCERS, SWEEP_STAGING), GDS off, then the other tensorferry variants once (warm).
# Outputs: $GPU_CHECK_OUT/sweep.log and sweep-*.json. Builds and generates the checkpoint first
# (scripts/gpu_check.sh build; tensorferry gen as gpu_check.sh does) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${GPU_CHECK_OUT:-build/gpu_check}
mkdir -p "$out"
data=${DATA:-data/gpu_check}
scripts/gpu_check.sh build > /dev/null
kit=${GPU_KIT:-.gpukit}
# shellcheck source=/dev/null
[ -f "$kit/env.sh" ] && . "$kit/env.sh"
tf=build/release/bin/tensorferry
if ! { [ -f "$data/model.safetensors.index.json" ] && "$tf" verify "$data" >/dev/null 2>&1; }; then
  rm -rf "$data"
  # shellcheck disable=SC2086
  gen_args=${GEN_ARGS:---preset default --layers 64}
  "$tf" gen "$data" $gen_args --no-sync > /dev/null
fi
py=.venv/bin/python
for p in ${SWEEP_PRODUCERS:-4 8 16}; do
  for s in ${SWEEP_STAGING:-64MiB 256MiB}; do
    echo "== producers $p staging $s" | tee -a "$out/sweep.log"
    TENSORFERRY_DEVICE_PRODUCERS=$p TENSORFERRY_STAGING_BYTES=$s "$py" bench/gpu_bench.py "$data" \
      --modes warm --repeats "${REPEATS:-3}" --loaders "tensorferry (gds off)" \
      --json "$out/sweep-$p-$s.json" 2>&1 | grep -v '^pinned' | tee -a "$out/sweep.log"
  done
done
if [ -n "${SWEEP_VARIANTS:-1}" ]; then
  echo "== variants (defaults)" | tee -a "$out/sweep.log"
  "$py" bench/gpu_bench.py "$data" --modes warm --repeats "${REPEATS:-3}" \
    --loaders "tensorferry,tensorferry (device budget 1GB),tensorferry (load_into),tensorferry (tp 0/2),tensorferry (tp 0/8)" \
    --json "$out/sweep-variants.json" 2>&1 | tee -a "$out/sweep.log"
fi

#!/usr/bin/env bash
# Tuning sweep for the device pipeline on a GPU machine (docs/gpu.md): warm loads of the GPU-check
# checkpoint to the device through the CLI (`tensorferry load --device cuda:0 --gds off --repeat N
# --no-checksum --json`), one process per configuration, over SWEEP_PRODUCERS x SWEEP_STAGING x
# SWEEP_SLOT (TENSORFERRY_DEVICE_PRODUCERS, TENSORFERRY_STAGING_BYTES, TENSORFERRY_STAGING_SLOT).
# A configuration's figure is the median GB/s of its runs after the first (the first allocates the
# device buffers, later runs reuse them); configurations alternate in rounds (SWEEP_ROUNDS, default
# 2), so drift of the machine spreads over all of them.
#
# Outputs: $GPU_CHECK_OUT/sweep.log (a line per run and the table), and $SWEEP_BEST: the best
# configuration as shell assignments, for a later `set -a; . <that file>; set +a` before
# scripts/gpu_check.sh bench. With OUT set (the device tool's folder whose files come back), both
# default to it ($OUT/sweep.log, $OUT/gpu_sweep_best.env); without, to build/gpu_check/sweep.log
# and build/gpu_sweep_best.env. Builds and generates the checkpoint first (as
# scripts/gpu_check.sh does) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${OUT:-}" ]; then
  out=${GPU_CHECK_OUT:-$OUT}
  best_file=${SWEEP_BEST:-$OUT/gpu_sweep_best.env}
else
  out=${GPU_CHECK_OUT:-build/gpu_check}
  best_file=${SWEEP_BEST:-build/gpu_sweep_best.env}
fi
mkdir -p "$out" "$(dirname "$best_file")"
data=${DATA:-data/gpu_check}
GPU_CHECK_OUT=$out scripts/gpu_check.sh build > /dev/null
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
[ -x "$py" ] || py=python3
cat "$data"/*.safetensors > /dev/null  # warm

log=$out/sweep.log
results=$(mktemp)
trap 'rm -f "$results"' EXIT
for round in $(seq "${SWEEP_ROUNDS:-2}"); do
  for p in ${SWEEP_PRODUCERS:-8 16}; do
    for s in ${SWEEP_STAGING:-64MiB 128MiB 256MiB}; do
      for slot in ${SWEEP_SLOT:-8MiB}; do
        json=$(TENSORFERRY_DEVICE_PRODUCERS=$p TENSORFERRY_STAGING_BYTES=$s \
          TENSORFERRY_STAGING_SLOT=$slot "$tf" load "$data" --device cuda:0 --gds off \
          --repeat "${SWEEP_REPEAT:-4}" --no-checksum --json)
        "$py" - "$p" "$s" "$slot" "$round" "$json" <<'PY' | tee -a "$log" >> "$results"
import json, statistics, sys
p, s, slot, rnd, doc = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
runs = doc["runs_gb_per_s"]
later = runs[1:] or runs
print(json.dumps({"producers": int(p), "staging": s, "slot": slot, "round": int(rnd),
                  "runs": runs, "median": statistics.median(later)}))
PY
      done
    done
  done
done
"$py" - "$results" "$best_file" <<'PY' | tee -a "$log"
import collections, json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
by = collections.defaultdict(list)
for r in rows:
    by[(r["producers"], r["staging"], r["slot"])].extend(r["runs"][1:] or r["runs"])
table = sorted(((statistics.median(v), k) for k, v in by.items()), reverse=True)
print("producers staging  slot    warm GB/s (median of the runs after each process's first)")
for gbps, (p, s, slot) in table:
    print(f"{p:9d} {s:8s} {slot:7s} {gbps:7.2f}")
_, (p, s, slot) = table[0]
with open(sys.argv[2], "w") as f:
    f.write(f"TENSORFERRY_DEVICE_PRODUCERS={p}\nTENSORFERRY_STAGING_BYTES={s}\n"
            f"TENSORFERRY_STAGING_SLOT={slot}\n")
print(f"best: producers {p}, staging {s}, slot {slot}")
PY

#!/usr/bin/env bash
# The one command for a GPU machine (docs/gpu.md, "Running the GPU check"): builds the release
# flavour, says what CUDA and GDS look like here (tensorferry doctor), runs the GPU-labelled CTest
# tests (real device, -V for their throughput lines), the fake-runtime device tests as a sanity
# check, the Python device tests (torch CUDA tensors against safetensors), a CLI checksum check
# (device load == host load), then bench/gpu_bench.py on data/default (generated when absent).
#
# Needs what the CPU build needs plus a CUDA driver and PyTorch with CUDA in .venv (or the
# python given as PYTHON); fastsafetensors / runai-model-streamer are compared when installed,
# skipped with a note otherwise. DATA=<dir> picks another checkpoint; REPEATS (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."
data=${DATA:-data/default}
py=${PYTHON:-.venv/bin/python}
out=${OUT:-build/gpu_check}
mkdir -p "$out"

echo "== build (release)"
scripts/build.sh release
tf=build/release/bin/tensorferry
scripts/install_python.sh

echo "== tensorferry doctor"
"$tf" doctor | tee "$out/doctor.txt"
"$tf" doctor --json > "$out/doctor.json"
if ! "$py" -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["cuda_available"] else 1)' \
    "$out/doctor.json"; then
  echo "gpu_check: no usable CUDA device here (see the doctor report above)" >&2
  exit 1
fi

echo "== GPU-labelled C++ tests (real device)"
if ! ctest --test-dir build/release -L gpu --output-on-failure -V > "$out/ctest_gpu.txt" 2>&1; then
  tail -n 80 "$out/ctest_gpu.txt"
  echo "gpu_check: GPU tests failed (full log: $out/ctest_gpu.txt)" >&2
  exit 1
fi
grep -E 'gds=|\[gpu loader\]|Skipped|tests passed' "$out/ctest_gpu.txt" || true

echo "== device tests against the fake runtime (sanity)"
ctest --test-dir build/release -j "$(nproc)" --output-on-failure -R 'LoaderDevice|DevicePipeline|DeviceLoadCli|DeviceMemory|StagingRing'

echo "== Python device tests"
if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: $py has no CUDA-enabled torch: the Python GPU tests and the benchmark need it" >&2
  exit 1
fi
TENSORFERRY_CLI="$PWD/$tf" TENSORFERRY_FAKE_CUDA="$PWD/build/release/lib/libtensorferry_fake_cudart.so" \
  "$py" -m pytest -q -p no:cacheprovider tests/python/test_device.py -rs

echo "== checkpoint $data"
if [ -f "$data/model.safetensors.index.json" ] && "$tf" verify "$data" >/dev/null 2>&1; then
  echo "$data already holds a valid checkpoint"
else
  rm -rf "$data"
  "$tf" gen "$data"
fi

echo "== CLI: the device load's checksum equals the host load's"
host=$("$tf" load "$data" --json --engine pread)
for gds in off auto; do
  dev=$("$tf" load "$data" --json --device cuda:0 --gds "$gds")
  echo "$dev" > "$out/load_cuda_gds_$gds.json"
  "$py" - "$host" "$dev" "$gds" <<'PY'
import json, sys
host, dev, gds = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
assert host["checksum"] == dev["checksum"], (host["checksum"], dev["checksum"])
print(f"gds {gds}: checksum {dev['checksum']} == host; {dev['gb_per_s']:.2f} GB/s; "
      f"staged {dev['staged_bytes']/1e9:.2f} GB, GDS {dev['gds_bytes']/1e9:.2f} GB "
      f"({dev['gds_reason'] or 'every read'}); peak device {dev['peak_device_bytes']/1e9:.2f} GB")
PY
done

echo "== benchmark (bench/gpu_bench.py)"
"$py" bench/gpu_bench.py "$data" --repeats "${REPEATS:-3}" --json "$out/gpu_bench.json" | tee "$out/gpu_bench.txt"
echo "== GPU check passed; outputs in $out"

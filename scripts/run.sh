#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build (library, CLI, and the Python package
# into .venv), generate the default synthetic Llama-style checkpoint (about 4.2 GB, 5 shards, with
# model.safetensors.index.json), inspect and verify it, then benchmark every engine cold and warm
# against the same-run hardware references (`tensorferry bench`). Pass another directory as $1 to
# use it instead of data/default; BENCH_RUNS (default 3) sets the runs per configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh release
scripts/install_python.sh   # the tensorferry Python package into .venv (skipped when current)
tf=build/release/bin/tensorferry
out=${1:-data/default}
if [ -e "$out" ] && "$tf" verify "$out" >/dev/null 2>&1; then
  echo "[run] $out already holds a valid checkpoint; not regenerating"
elif [ -e "$out" ] && [ "$out" != data/default ]; then
  # Only the default folder is ours to replace: a directory the caller named is never deleted.
  echo "[run] $out exists but is not a checkpoint that verifies; give a new directory (gen writes" \
       "the default checkpoint there) or a valid checkpoint" >&2
  exit 1
else
  rm -rf "$out"
  "$tf" gen "$out"
fi
"$tf" inspect "$out"
"$tf" verify "$out"
"$tf" bench "$out" --runs "${BENCH_RUNS:-3}"

#!/usr/bin/env bash
# Loaders on a slow file system, cold (docs/benchmarks.md, "Slow file systems"): the checkpoint is
# read through tf_slowfs (bench/slowfs/slowfs.cc), a FUSE passthrough that waits LATENCY_US in every
# request to model a network share, by bench/python_load_bench.py: tensorferry's default (which
# reads, never maps, files on FUSE and network file systems), tensorferry forced to mmap (its
# default before), and safetensors' default (mmap) and backend="pread", each in a fresh process,
# alternating, both the mount's and the source's page cache evicted before every run.
#
#   bench/slow_fs_bench.sh [CHECKPOINT_DIR]     # default data/small (generated when missing)
#   LATENCY_US=2000 RUNS=5 JSON=out.json bench/slow_fs_bench.sh data/small
#
# Needs root (or fusermount3 rights), /dev/fuse, and tf_slowfs built (libfuse3-dev:
# scripts/install_deps.sh; scripts/build.sh release).
set -euo pipefail
cd "$(dirname "$0")/.."
checkpoint=$(realpath -m "${1:-data/small}")
LATENCY_US=${LATENCY_US:-500}
RUNS=${RUNS:-3}
LOADERS=${LOADERS:-"tensorferry load_file,tensorferry load_file (mmap),tensorferry Loader.load,safetensors load_file,safetensors load_file (pread)"}
slowfs=build/release/bin/tf_slowfs
[ -x "$slowfs" ] || { echo "no $slowfs: install libfuse3-dev and build (scripts/build.sh release)" >&2; exit 2; }
if [ ! -d "$checkpoint" ]; then
  build/release/bin/tensorferry gen "$checkpoint" --preset small >/dev/null
fi
mnt=$(mktemp -d /tmp/tf-slowfs.XXXXXX)
cleanup() { fusermount3 -u "$mnt" 2>/dev/null || umount "$mnt" 2>/dev/null || true; rmdir "$mnt" 2>/dev/null || true; }
trap cleanup EXIT
"$slowfs" "$checkpoint" "$mnt" --latency-us="$LATENCY_US" -o max_threads=128
for _ in $(seq 50); do mountpoint -q "$mnt" && break; sleep 0.1; done
mountpoint -q "$mnt" || { echo "tf_slowfs did not mount $mnt" >&2; exit 1; }
echo "# tf_slowfs: $checkpoint at $mnt, ${LATENCY_US} us per request" >&2
args=("$mnt" --modes cold --runs "$RUNS" --loaders "$LOADERS" --evict-also "$checkpoint")
[ -n "${JSON:-}" ] && args+=(--json "$JSON")
.venv/bin/python bench/python_load_bench.py "${args[@]}"

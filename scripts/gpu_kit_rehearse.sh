#!/usr/bin/env bash
# Rehearses the GPU kit offline (docs/gpu.md, "GPU kit"): in a clean Debian 12 root made with
# debootstrap that has only what the GPU machine brings of its own (a compiler, CMake, ninja and a
# Python holding torch and the Python build tools), with no network, scripts/gpu_check.sh must
# build the library, CLI and Python module from the kit alone and pass the CPU test suite (the
# device tests on the fake CUDA runtime). Too slow for scripts/test.sh; run it by hand after
# changing the kit or the build's dependencies.
#
#   scripts/gpu_kit_rehearse.sh       GPU_KIT_ROOT=<dir> (default /var/tmp/tensorferry-gpukit-root)
#
# Idempotent: the root and its Python are made once (stamps inside the root) and reused; the kit is
# refreshed by scripts/gpu_kit.sh; the project is copied afresh each time (tracked and untracked,
# not ignored, files: what the device tool sends) with the kit beside it, so every rehearsal builds
# from nothing. Logs: build/gpu_kit_rehearsal/ (gpu_check.sh's, and rehearsal.txt: durations, kit
# size, result).
#
# Stand-ins for the GPU machine's preinstalled set (its python3 is a venv, /opt/torch/.venv, with
# torch and the rest; /work/.library/device/KINDS.md): the root gets /opt/torch/.venv made with
# Debian's Python 3.11 (the GPU machine's is 3.12: the kit's cp312 peer wheels are only installed
# by the bench phase, which needs a GPU and is not rehearsed) holding this project's pinned torch,
# numpy, safetensors, pytest, nanobind and scikit-build-core (requirements.txt), installed while
# the network is still there. With REHEARSE_SEED_VENV (default .venv, made by
# scripts/install_deps.sh) of the same Python minor version, its site-packages are hard-linked in
# (no 3 GB torch download) and the peers the GPU machine lacks are uninstalled; otherwise pip
# installs the set from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
root=${GPU_KIT_ROOT:-/var/tmp/tensorferry-gpukit-root}
seed=${REHEARSE_SEED_VENV:-.venv}
logs=$PWD/build/gpu_kit_rehearsal
suite=bookworm
# What the GPU machine has of its own besides Python's packages: a compiler, CMake, ninja, and a
# Python with its headers (the module build needs Python.h).
root_packages=g++,cmake,ninja-build,python3,python3-dev,python3-venv,ca-certificates
# The GPU machine's Python packages this project uses (KINDS.md lists them all).
stand_in=(torch numpy safetensors pytest nanobind scikit-build-core)
# Peers in requirements.txt that the GPU machine lacks (the kit carries their wheels).
peers=(fastsafetensors runai-model-streamer)

[ "$(id -u)" = 0 ] || { echo "gpu_kit_rehearse: needs root (debootstrap, chroot, unshare)" >&2; exit 1; }
mkdir -p "$logs"
t0=$SECONDS
stamp() { echo "$root/.tensorferry-$1"; }

# --- 1. the root -------------------------------------------------------------------------------
if [ ! -f "$(stamp root)" ]; then
  command -v debootstrap >/dev/null || { apt-get update -qq; apt-get install -y -qq debootstrap >/dev/null; }
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  echo "[rehearse] debootstrap $suite into $root ($root_packages) from $mirror"
  rm -rf "$root"
  debootstrap --variant=minbase --include="$root_packages" "$suite" "$root" "$mirror" \
    > "$logs/debootstrap.log" 2>&1 || { tail -n 20 "$logs/debootstrap.log"; exit 1; }
  echo "$root_packages" > "$(stamp root)"
fi

# Runs a command in the root: own mount (and, with NET=none, network) namespace, /dev and /proc.
in_root() {
  local net=() offline=0
  [ "${NET:-}" = none ] && net=(--net) offline=1
  unshare --mount --pid --fork "${net[@]}" bash -c '
    root=$1 offline=$2; shift 2
    # A new network namespace has only a loopback interface, and it is down (torch.distributed
    # tests over gloo need 127.0.0.1).
    if [ "$offline" = 1 ]; then ip link set lo up; fi
    mount --rbind /dev "$root/dev"
    mount -t proc proc "$root/proc"
    exec chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
      PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"' _ "$root" "$offline" "$@"
}

# A root made with another package list gets the missing packages (network still on).
if [ "$(cat "$(stamp root)")" != "$root_packages" ]; then
  echo "[rehearse] installing into the root: ${root_packages//,/ }"
  in_root apt-get update -qq
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ${root_packages//,/ } > "$logs/apt.log" 2>&1 ||
    { tail -n 20 "$logs/apt.log"; exit 1; }
  echo "$root_packages" > "$(stamp root)"
fi
echo "[rehearse] root ready ($((SECONDS - t0)) s)"

# --- 2. the stand-in for the GPU machine's Python ----------------------------------------------
want_py="${stand_in[*]} | $(grep -iE "^($(IFS='|'; echo "${stand_in[*]}"))==" requirements.txt | sort | paste -sd' ')"
if [ ! -f "$(stamp python)" ] || [ "$(cat "$(stamp python)")" != "$want_py" ]; then
  echo "[rehearse] /opt/torch/.venv in the root: ${stand_in[*]}"
  rm -rf "$root/opt/torch/.venv"
  in_root python3 -m venv /opt/torch/.venv
  root_minor=$(in_root python3 -c 'import sys; print(*sys.version_info[:2])')
  seed_minor=$([ -x "$seed/bin/python" ] && "$seed/bin/python" -c 'import sys; print(*sys.version_info[:2])' || true)
  if [ "$root_minor" = "$seed_minor" ]; then
    seed_site=$("$seed/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    root_site=$root$(in_root /opt/torch/.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "[rehearse] hard-linking $seed_site (Python $seed_minor) into the root"
    rm -rf "$root_site"
    cp -al "$seed_site" "$root_site"
    rm -rf "$root_site"/tensorferry "$root_site"/tensorferry-*.dist-info
    in_root /opt/torch/.venv/bin/python -m pip uninstall -q -y "${peers[@]}"
  else
    echo "[rehearse] pip install from PyPI (no seed venv of Python $root_minor)"
    mapfile -t pins < <(grep -iE "^($(IFS='|'; echo "${stand_in[*]}"))==" requirements.txt)
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    in_root /opt/torch/.venv/bin/python -m pip install -q "${pins[@]}"
  fi
  in_root /opt/torch/.venv/bin/python -c 'import torch, numpy, safetensors, pytest, nanobind, scikit_build_core'
  echo "$want_py" > "$(stamp python)"
fi
echo "[rehearse] stand-in Python ready ($((SECONDS - t0)) s)"

# --- 3. the kit, and the project as the device tool sends it -----------------------------------
scripts/gpu_kit.sh > "$logs/gpu_kit.log" 2>&1 || { tail -n 20 "$logs/gpu_kit.log"; exit 1; }
# What the device tool sends: tracked and untracked, not ignored, files that exist (a tracked file
# deleted from the working tree is listed by git but not sent).
sent_files() {
  local f
  git ls-files -z -co --exclude-standard --deduplicate |
    while IFS= read -r -d '' f; do
      if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
    done
}
kit_bytes=$(du -sb .gpukit | cut -f1)
tree_bytes=$(sent_files | du -cb --files0-from=- | tail -n 1 | cut -f1)
work=$root/work/tensorferry
rm -rf "$root/work"
mkdir -p "$work" "$root/work/out"
sent_files | tar --null -T - -cf - | tar -xf - -C "$work"
cp -a .gpukit "$work/.gpukit"

# --- 4. offline: build, module, CPU tests ------------------------------------------------------
echo "[rehearse] offline in the root: scripts/gpu_check.sh build cpu-tests"
t_check=$SECONDS
status=passed
if ! NET=none in_root bash -c '
    set -e
    # No network: only the loopback interface exists in this namespace.
    if grep -vqE "^ *(lo|Inter-| face)" /proc/net/dev; then echo "network present" >&2; exit 1; fi
    echo "network: none (interfaces: $(awk -F: "NR>2 {print \$1}" /proc/net/dev | xargs))"
    cd /work/tensorferry
    GPU_KIT=.gpukit PYTHON=/opt/torch/.venv/bin/python3 GPU_CHECK_OUT=/work/out JOBS='"${JOBS:-2}"' \
      scripts/gpu_check.sh build cpu-tests' 2>&1 | tee "$logs/gpu_check_console.txt"; then
  status=failed
fi
check_s=$((SECONDS - t_check))
cp "$root"/work/out/* "$logs/" 2>/dev/null || true
{
  echo "rehearsal $(date -u +%Y-%m-%dT%H:%M:%SZ): $status"
  echo "root: $root (debootstrap $suite minbase + $root_packages; /opt/torch/.venv: ${stand_in[*]})"
  echo "offline gpu_check.sh build cpu-tests: ${check_s} s with JOBS=${JOBS:-2} on $(nproc) cores"
  echo "kit: $kit_bytes bytes; working tree sent: $tree_bytes bytes; together $((kit_bytes + tree_bytes)) of 67108864"
  echo "whole rehearsal: $((SECONDS - t0)) s"
} | tee "$logs/rehearsal.txt"
[ "$status" = passed ]

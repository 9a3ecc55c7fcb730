#!/usr/bin/env bash
# Installs everything tensorferry needs on a fresh Debian 12 machine, idempotently: Debian packages
# only when one is missing, the virtual environment only when requirements.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(cmake ninja-build g++ clang libclang-rt-14-dev clang-format
              libsimdjson-dev libzip-dev pkg-config time libcli11-dev libgtest-dev googletest liburing-dev
              libxxhash-dev libssl-dev  # integrity checksums: XXH3 (header-only), SHA-256 of hub-cache blobs
              python3-venv python3-dev fio openssl  # python3-dev: Python.h, for the package's module;
                                                    # openssl: keys and JWT checks of the GCS tests
              libcurl4-openssl-dev nginx-light  # object storage: libcurl (loaded at run time), the HTTP test server
              openmpi-bin libopenmpi-dev  # MPI: tensorferry::mpi, tensorferry-mpi, the mpi tests
              fuse3 libfuse3-dev)  # tf_slowfs: the slow file system of the file-system tests and benchmark

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[deps] installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "[deps] Debian packages present"
fi

# Free space first, in MB (MiB), as measured on a fresh clone (a CI rehearsal on an 11.0 GB file
# system peaked at 9.3 GB used): .venv 6,200; .venv-vllm 1,700 (a layer over .venv:
# scripts/install_vllm.sh); then the larger of the release build with the tests' temporary files
# (100 + 1,100: the Python suite's go when it ends) and all the builds still missing (release 100,
# asan 900, tsan 300, fuzz 200). pip's temporary files while it installs (up to 3,000) are gone
# before the builds. Failing here names what is missing instead of pip's ENOSPC half-way through
# an install. Where everything but .venv-vllm fits, it is left out (.venv-vllm.skipped says why,
# and the vLLM plugin's tests skip with that reason) rather than failing every other test.
need_mb=0
PY=${PYTHON:-python3}
# A virtual environment is current when its interpreter still runs and it was installed from the
# same requirements by the same Python ABI (sys.implementation.cache_tag, e.g. cpython-311:
# compiled wheels and our module are per ABI, not per patch release): the stamp holds both. One whose interpreter is gone (a Python removed or upgraded under it) is
# made again from scratch.
if [ -e .venv ] && ! .venv/bin/python -c '' 2>/dev/null; then
  echo "[deps] .venv's interpreter no longer runs: making .venv again"
  rm -rf .venv
fi
venv_py=.venv/bin/python
[ -x "$venv_py" ] || venv_py=$PY
want=$( (cat requirements.txt requirements-nodeps.txt
         "$venv_py" -c 'import sys; print(sys.implementation.cache_tag)') | sha256sum | cut -d' ' -f1)
venv_current=1
[ "$(cat .venv/.requirements.sha256 2>/dev/null)" = "$want" ] || { venv_current=0; need_mb=$((need_mb + 6200)); }
vllm_mb=0
# (.venv-vllm is a layer over .venv: made anew whenever .venv is; one not current goes now, so that
# the space it held counts as free)
if ! { [ "$venv_current" = 1 ] && scripts/install_vllm.sh --current; }; then
  vllm_mb=1700
  rm -rf .venv-vllm
fi
declare -A build_mb=([release]=100 [asan]=900 [tsan]=300 [fuzz]=200)
builds_mb=0
for flavour in "${!build_mb[@]}"; do
  [ -d "build/$flavour" ] || builds_mb=$((builds_mb + build_mb[$flavour]))
done
tests_mb=1100
[ -d build/release ] || tests_mb=$((tests_mb + build_mb[release]))
need_mb=$((need_mb + (builds_mb > tests_mb ? builds_mb : tests_mb)))
free_mb=$(($(df -Pk . | awk 'NR == 2 {print $4}') / 1024))
gb() { awk -v mb="$1" 'BEGIN {printf "%.1f GiB", mb / 1024}'; }
with_vllm=1
if ((free_mb < need_mb + vllm_mb)); then
  if ((free_mb < need_mb)); then
    echo "[deps] not enough disk space: $(gb $free_mb) free on the file system of $PWD; the" \
      "install, builds and tests still to do need about $(gb $((need_mb + vllm_mb))), or" \
      "$(gb $need_mb) without .venv-vllm (MiB: .venv 6,200, .venv-vllm 1,700, then the larger" \
      "of the release build with the tests' temporary files, 1,200, and the builds, 1,500)" >&2
    exit 1
  fi
  with_vllm=0
fi

if [ ! -x .venv/bin/python ]; then
  echo "[deps] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha256
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[deps] installing Python requirements into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -r requirements.txt
  .venv/bin/python -m pip install -q --no-deps -r requirements-nodeps.txt
  echo "$want" > "$stamp"
else
  echo "[deps] Python requirements present"
fi

# The vLLM loader plugin's tests run the real vLLM from its own virtual environment (its pins
# conflict with requirements.txt): .venv-vllm, skipped when current.
if [ "$with_vllm" = 1 ]; then
  rm -f .venv-vllm.skipped
  scripts/install_vllm.sh
else
  reason="$(gb $free_mb) free on the file system of $PWD: enough for .venv, the builds and the tests ($(gb $need_mb)), not for .venv-vllm too ($(gb $vllm_mb) more)"
  echo "[deps] WARNING: not installing .venv-vllm, the vLLM plugin's tests will be skipped: $reason" >&2
  rm -rf .venv-vllm
  echo "$reason" > .venv-vllm.skipped
fi

#!/usr/bin/env bash
# Builds the Python package and installs it into .venv (pip install . through scikit-build-core,
# with the build tree kept in build/python so rebuilds are incremental). Idempotent: skipped when
# the installed package was built from the same sources (scripts/python_source_hash.py, embedded
# in the package as tensorferry._core.SOURCE_HASH). FORCE=1 rebuilds anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
want=$("$py" scripts/python_source_hash.py)
have=$(cd / && "$OLDPWD/$py" -c 'import tensorferry._core as c; print(c.SOURCE_HASH)' 2>/dev/null || true)
if [ "$want" = "$have" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "[python] tensorferry package up to date (sources $want)"
  exit 0
fi
echo "[python] building and installing the tensorferry package into .venv (sources $want)"
# Developer mode: the bindings compile with the project's strict warnings (-Werror unless
# WERROR=OFF); tests and tools are not part of the package.
nice -n 10 "$py" -m pip install --quiet --no-build-isolation --no-deps \
  -C build-dir=build/python \
  -C cmake.define.TENSORFERRY_DEVELOPER_MODE=ON \
  -C cmake.define.TENSORFERRY_WERROR="${WERROR:-ON}" \
  -C cmake.define.TENSORFERRY_SOURCE_HASH="$want" \
  -C build.tool-args=-j"${JOBS:-$(nproc)}" \
  .
got=$(cd / && "$OLDPWD/$py" -c 'import tensorferry._core as c; print(c.SOURCE_HASH)')
if [ "$got" != "$want" ]; then
  echo "[python] installed package reports sources $got, expected $want" >&2
  exit 1
fi
echo "[python] installed tensorferry (sources $want)"

#!/usr/bin/env bash
# Installs the pinned vLLM (requirements-vllm.txt) into its own virtual environment, .venv-vllm,
# for the vLLM loader plugin's tests (tests/python/test_vllm.py). Idempotent: skipped when the
# environment was installed from the same requirements-vllm.txt. vLLM pins its own torch and
# transformers, which conflict with requirements.txt: hence a separate environment. tensorferry
# itself is not installed there: the tests put the package installed in .venv on PYTHONPATH.
# The interpreter is the one .venv was made with (the tests load the compiled module built for
# .venv into this environment), else $PYTHON or python3.
# The environment is made again from scratch when its interpreter no longer runs or is another
# Python version than .venv's (the module would not load). --current: only tell, by the exit
# status, whether it is current (0) or would be installed (1).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
if [ -x .venv/bin/python ]; then
  base=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
else
  base=${PYTHON:-python3}
fi
# The interpreter's ABI (e.g. cpython-311): what compiled wheels and our module are built for.
version() { "$1" -c 'import sys; print(sys.implementation.cache_tag)' 2>/dev/null; }
base_version=$(version "$base") || {
  echo "[vllm] the Python to make $venv with ($base) does not run" >&2
  exit 1
}
stamp=$venv/.requirements.sha256
want=$( (cat requirements-vllm.txt; echo "$base_version") | sha256sum | cut -d' ' -f1)
fresh=0
[ -x "$venv/bin/python" ] && [ "$(version "$venv/bin/python")" = "$base_version" ] || fresh=1
if [ "${1:-}" = --current ]; then
  [ "$fresh" = 0 ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]
  exit
fi
if [ "$fresh" = 1 ]; then
  if [ -e "$venv" ]; then
    echo "[vllm] $venv is not $base_version's (or does not run): making it again"
    rm -rf "$venv"
  fi
  echo "[vllm] creating $venv with $base"
  "$base" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[vllm] installing requirements-vllm.txt into $venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q -r requirements-vllm.txt
  echo "$want" > "$stamp"
else
  echo "[vllm] vLLM present in $venv"
fi

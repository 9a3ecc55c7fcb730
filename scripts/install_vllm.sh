#!/usr/bin/env bash
# Installs the pinned vLLM (requirements-vllm.txt) into its own virtual environment, .venv-vllm,
# for the vLLM loader plugin's tests (tests/python/test_vllm.py). Idempotent: skipped when the
# environment was installed from the same requirements-vllm.txt. vLLM pins its own torch and
# transformers, which conflict with requirements.txt: hence a separate environment. tensorferry
# itself is not installed there: the tests put the package installed in .venv on PYTHONPATH.
# The interpreter is the one .venv was made with (the tests load the compiled module built for
# .venv into this environment), else $PYTHON or python3.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
if [ ! -x "$venv/bin/python" ]; then
  if [ -x .venv/bin/python ]; then
    base=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
  else
    base=${PYTHON:-python3}
  fi
  echo "[vllm] creating $venv with $base"
  "$base" -m venv "$venv"
fi
stamp=$venv/.requirements.sha256
want=$(sha256sum requirements-vllm.txt | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[vllm] installing requirements-vllm.txt into $venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$venv/bin/python" -m pip install -q -r requirements-vllm.txt
  echo "$want" > "$stamp"
else
  echo "[vllm] vLLM present in $venv"
fi

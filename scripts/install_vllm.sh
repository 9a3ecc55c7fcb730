#!/usr/bin/env bash
# Installs the pinned vLLM (requirements-vllm.txt) into its own virtual environment, .venv-vllm,
# for the vLLM loader plugin's tests (tests/python/test_vllm.py) and benchmark. Idempotent:
# skipped when the environment was installed from the same requirements-vllm.txt over the same
# .venv. tensorferry itself is not installed there: the tests put the package installed in .venv on
# PYTHONPATH.
#
# The environment is a layer over .venv, to fit machines with little disk: a .pth file puts
# .venv's site-packages after its own, so torch (with its CUDA libraries, about 5 GB: requirements.txt
# pins the torch vLLM pins) and every other package .venv holds at a version vLLM accepts are
# shared; pip installs only the rest (vLLM, the transformers it pins, its server's and tokenizers'
# packages, a numpy below 2.4 for mistral_common: about 110 packages) into .venv-vllm, whose own
# site-packages come first. vLLM's requirements are installed except those that are GPU kernels or
# media codecs (SKIP below, about 2.5 GB), which its CPU platform never imports when it builds a
# model and loads its weights, all these tests do with it.
#
# The interpreter is the one .venv was made with (the tests load the compiled module built for
# .venv into this environment). The environment is made again from scratch when its interpreter
# no longer runs, is another Python version than .venv's (the module would not load), or .venv's
# packages changed since (the layer was resolved over others). --current: only tell, by
# the exit status, whether it is current (0) or would be installed (1).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-vllm
if [ ! -x .venv/bin/python ]; then
  [ "${1:-}" = --current ] && exit 1
  echo "[vllm] .venv is missing: run scripts/install_deps.sh first ($venv is a layer over it)" >&2
  exit 1
fi
base=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
base_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The interpreter's ABI (e.g. cpython-311): what compiled wheels and our module are built for.
version() { "$1" -c 'import sys; print(sys.implementation.cache_tag)' 2>/dev/null; }
base_version=$(version "$base") || {
  echo "[vllm] the Python to make $venv with ($base) does not run" >&2
  exit 1
}
# vLLM's requirements not installed: GPU kernels (CUDA, cuDNN, CUTLASS, FlashInfer, TileLang,
# Triton MLA kernels) and audio, image and video codecs.
# (Only those nothing else installed requires: apache-tvm-ffi, which xgrammar needs, and OpenCV,
# which mistral_common[image] needs, are installed at vLLM's versions.)
SKIP=(flashinfer-python tilelang nvidia-cudnn-frontend nvtx nvidia-cutlass-dsl
      quack-kernels tokenspeed-mla humming-kernels numba
      torchaudio torchvision torchcodec PyNvVideoCodec)
stamp=$venv/.requirements.sha256
# (.venv's packages: the names and versions of its distributions, which the layer was resolved
# over, but for tensorferry's own, which install_python.sh adds after)
want=$( (cat requirements-vllm.txt; echo "$base_version"; echo "${SKIP[*]}"; echo "$base_site"
         ls "$base_site" | grep -E '\.dist-info$' | grep -v '^tensorferry-' | LC_ALL=C sort) | sha256sum | cut -d' ' -f1)
fresh=0
[ -x "$venv/bin/python" ] && [ "$(version "$venv/bin/python")" = "$base_version" ] || fresh=1
[ "$(cat "$stamp" 2>/dev/null)" = "$want" ] || fresh=1
if [ "${1:-}" = --current ]; then
  [ "$fresh" = 0 ]
  exit
fi
if [ "$fresh" = 0 ]; then
  echo "[vllm] vLLM present in $venv"
  exit 0
fi
if [ -e "$venv" ]; then
  echo "[vllm] $venv is not current (requirements-vllm.txt, .venv or the Python changed): making it again"
  rm -rf "$venv"
fi
echo "[vllm] creating $venv with $base, a layer over .venv"
"$base" -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base_site" > "$site/tensorferry-venv-base.pth"
echo "[vllm] installing requirements-vllm.txt into $venv"
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
# vLLM without its requirements, then those requirements less SKIP, with the rest of the file.
vllm_pin=$(grep -E '^vllm==' requirements-vllm.txt)
"$venv/bin/python" -m pip install -q --no-deps "$vllm_pin"
reqs_text=$("$venv/bin/python" - "${SKIP[@]}" <<'PYEOF'
import importlib.metadata, re, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
skip = {norm(n) for n in sys.argv[1:]}
for line in importlib.metadata.requires("vllm") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue  # an extra, or another platform's
    if norm(r.name) not in skip:
        print(line.split(";")[0].strip())
PYEOF
)  # (a failure here stops the script: set -e, unlike a process substitution)
mapfile -t reqs <<< "$reqs_text"
grep -vE '^(vllm==|#|$)' requirements-vllm.txt > "$venv/requirements-rest.txt" || true
log=$(mktemp)
trap 'rm -f "$log"' EXIT
rc=0
"$venv/bin/python" -m pip install -q "${reqs[@]}" -r "$venv/requirements-rest.txt" 2> "$log" || rc=$?
# pip's resolver then names each of vLLM's requirements SKIP left out as not installed: expected,
# not shown; any other conflict (a version vLLM does not accept) or error is.
skip_re=$(IFS='|'; echo "${SKIP[*]}")
other=$(grep -viE "^vllm [^ ]+ requires ($skip_re)[^a-z0-9_.-].*, which is not installed\.\$|^ERROR: pip's dependency resolver does not currently" "$log" || true)
if [ -n "$other" ]; then
  grep -iE "^ERROR: pip's dependency resolver" "$log" >&2 || true
  echo "$other" >&2
fi
[ "$rc" = 0 ] || exit "$rc"
# torch must come from .venv (requirements.txt pins vLLM's torch): one installed here is 5 GB
# more on disk, which the space check of scripts/install_deps.sh does not count on.
torch_at=$("$venv/bin/python" -c 'import importlib.util as u; print(u.find_spec("torch").origin)')
case "$torch_at" in
  "$base_site"/*) ;;
  *) echo "[vllm] warning: torch was installed into $venv ($torch_at), not shared with .venv:" \
       "requirements.txt's torch is not the one vLLM pins" >&2 ;;
esac
echo "$want" > "$stamp"

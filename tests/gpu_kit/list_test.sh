#!/usr/bin/env bash
# The GPU kit (scripts/gpu_kit.sh) must carry every Debian -dev package the build finds
# (scripts/install_deps.sh's list, less Open MPI, which the kit leaves out on purpose) and a pinned
# version of each peer wheel: a dependency added to the build but not to the kit would only show on
# the offline GPU machine. Reads lists only; fetches nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
listing=$(scripts/gpu_kit.sh --list)
# The -dev packages named in install_deps.sh's APT_PACKAGES array (read whole: comments dropped
# before the array's closing parenthesis is looked for); python3-dev is the GPU machine's own.
deps=$(sed 's/#.*//' scripts/install_deps.sh | sed -n '/^APT_PACKAGES=(/,/)/p' |
       tr ' ()' '\n\n\n' | grep -E -- '-dev$' |
       grep -v -E '^(libopenmpi-dev|libclang-rt-.*|python3-dev)$' || true)
[ -n "$deps" ] || { echo "FAIL: no -dev packages found in scripts/install_deps.sh"; exit 1; }
failed=0
for p in $deps; do
  if ! grep -qx "  $p" <<<"$listing"; then
    echo "FAIL: $p (scripts/install_deps.sh) is not in the GPU kit's packages"
    failed=1
  fi
done
for w in fastsafetensors runai-model-streamer; do
  grep -qE "^  $w==[0-9]" <<<"$listing" || { echo "FAIL: no pinned wheel of $w in the kit"; failed=1; }
done
[ "$failed" = 0 ] || { echo "$listing"; exit 1; }
echo "gpu kit lists $(echo "$deps" | wc -w) build packages and the peer wheels"

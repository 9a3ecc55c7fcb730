#!/usr/bin/env bash
# Configures and builds one flavour into build/<flavour>:
#   release  optimized library, CLI and tests (developer mode: strict warnings)
#   asan     ASan + UBSan, tests
#   tsan     ThreadSanitizer, tests
#   fuzz     clang, libFuzzer targets with ASan + UBSan
# WERROR=OFF keeps the strict warnings but not as errors (a compiler newer than Debian 12's).
set -euo pipefail
cd "$(dirname "$0")/.."
flavour=${1:-release}
jobs=${JOBS:-$(nproc)}
common=(-G Ninja -DTENSORFERRY_DEVELOPER_MODE=ON -DTENSORFERRY_WERROR="${WERROR:-ON}"
        -DTENSORFERRY_PYTHON="$PWD/.venv/bin/python")
case "$flavour" in
  release) args=(-DCMAKE_BUILD_TYPE=Release) ;;
  asan) args=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ -DTENSORFERRY_SANITIZE=address,undefined) ;;
  tsan) args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ -DTENSORFERRY_SANITIZE=thread) ;;
  fuzz) args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ -DTENSORFERRY_BUILD_FUZZERS=ON
              -DTENSORFERRY_SANITIZE=address,undefined -DTENSORFERRY_BUILD_TESTS=OFF -DTENSORFERRY_BUILD_TOOLS=OFF) ;;
  *) echo "unknown flavour: $flavour (release|asan|tsan|fuzz)" >&2; exit 2 ;;
esac
cmake -S . -B "build/$flavour" "${common[@]}" "${args[@]}" >/dev/null
cmake --build "build/$flavour" -j "$jobs"

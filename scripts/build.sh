#!/usr/bin/env bash
# Configures and builds one flavour into build/<flavour>:
#   release  optimized library, CLI and tests (developer mode: strict warnings)
#   asan     ASan + UBSan, tests
#   tsan     ThreadSanitizer, tests
#   fuzz     clang, libFuzzer targets with ASan + UBSan
# WERROR=OFF keeps the strict warnings but not as errors (a compiler newer than Debian 12's).
# UNITY=ON/OFF: each CLI and each folder's tests as one translation unit, or file by file
# (default: ON below 8 jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
flavour=${1:-release}
jobs=${JOBS:-$(nproc)}
# Each CLI, and the tests of each folder, as one translation unit (CMakeLists.txt,
# TENSORFERRY_UNITY_TOOLS and _TESTS) saves parsing and compiling the same headers many times where
# cores are few; with many, the files compile side by side as soon, and each is built on its own.
unity=ON
[ "$jobs" -ge 8 ] && unity=OFF
common=(-G Ninja -DTENSORFERRY_DEVELOPER_MODE=ON -DTENSORFERRY_WERROR="${WERROR:-ON}"
        -DTENSORFERRY_PYTHON="$PWD/.venv/bin/python"
        -DTENSORFERRY_UNITY_TOOLS="${UNITY:-$unity}" -DTENSORFERRY_UNITY_TESTS="${UNITY:-$unity}")
# The sanitizer and fuzz flavours carry line tables only (-gline-tables-only, unless
# DEBUG_INFO=full): their reports name every frame's function, file and line as with -g, in less
# disk, which CI's machines are short of (the asan build: 0.87 GB, 1.1 GB with -g).
lines=-gline-tables-only
[ "${DEBUG_INFO:-}" = full ] && lines=-g
case "$flavour" in
  release) args=(-DCMAKE_BUILD_TYPE=Release) ;;
  asan) args=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="$lines" -DCMAKE_CXX_COMPILER=clang++
              -DTENSORFERRY_SANITIZE=address,undefined) ;;
  tsan) args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 $lines -DNDEBUG"
              -DCMAKE_CXX_COMPILER=clang++ -DTENSORFERRY_SANITIZE=thread) ;;
  fuzz) args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 $lines -DNDEBUG"
              -DCMAKE_CXX_COMPILER=clang++ -DTENSORFERRY_BUILD_FUZZERS=ON
              -DTENSORFERRY_SANITIZE=address,undefined -DTENSORFERRY_BUILD_TESTS=OFF -DTENSORFERRY_BUILD_TOOLS=OFF) ;;
  *) echo "unknown flavour: $flavour (release|asan|tsan|fuzz)" >&2; exit 2 ;;
esac
cmake -S . -B "build/$flavour" "${common[@]}" "${args[@]}" >/dev/null
cmake --build "build/$flavour" -j "$jobs"

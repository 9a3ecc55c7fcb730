#!/usr/bin/env bash
# clang-format every C++ source: `scripts/format.sh` rewrites, `scripts/format.sh --check` fails on
# any difference.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.cc' '*.h' 2>/dev/null || find include src tools fuzz -name '*.cc' -o -name '*.h')
if [ "${1:-}" = "--check" ]; then
  clang-format --dry-run --Werror "${files[@]}"
  echo "format ok (${#files[@]} files)"
else
  clang-format -i "${files[@]}"
fi

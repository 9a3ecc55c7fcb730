#!/usr/bin/env bash
# The tensorferry-mpi tool under mpirun, 2 ranks: tests/mpi/tool_test.sh TOOL CLI.
#   * a wrong flag, rules file or flag combination is a usage error (exit 2), a wrong
#     TENSORFERRY_* variable a failure (exit 1), each with one "error:" line naming it, from every
#     rank together (no rank left waiting in a collective, no MPI_Abort); so is a checkpoint that
#     one rank cannot open (exit 1);
#   * --explain --json is one JSON document holding the plan's text, and loads nothing;
#   * cooperative and sliced give every rank the same slices (their --checksum per rank agree).
# Exit 77 (ctest: skipped) where mpirun or python3 is missing.
set -uo pipefail
tool=$1
cli=$2
here="$(cd "$(dirname "$0")" && pwd)"
for need in mpirun python3; do
  if ! command -v "$need" >/dev/null 2>&1; then
    echo "$need not found: skipped"
    exit 77
  fi
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$cli" gen "$tmp/ckpt" --preset tiny --shard-size 64KB --no-sync >/dev/null || exit 1
failures=0

# expect CODE NEEDLE ARGS...: the tool exits CODE and its stderr holds NEEDLE once.
expect() {
  local code=$1 needle=$2
  shift 2
  "$here/run.sh" 2 "$tool" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  local n
  n=$(grep -c -F -- "$needle" "$tmp/err")
  if [[ $rc -ne $code || $n -ne 1 ]]; then
    echo "FAIL: tensorferry-mpi $*: exit $rc (expected $code), \"$needle\" printed $n times (expected once)"
    cat "$tmp/err"
    failures=$((failures + 1))
  fi
}

expect 2 "error: invalid_argument: --budget" load "$tmp/ckpt" --budget banana
expect 2 "error: not_found: --shard-rules: $tmp/nothing" load "$tmp/ckpt" --shard-rules "$tmp/nothing"
expect 2 "--explain prints the cooperative mode's plan: not with --mode sliced" \
  load "$tmp/ckpt" --mode sliced --explain
TENSORFERRY_BUDGET=banana expect 1 "error: invalid_argument: TENSORFERRY_* environment variables" \
  load "$tmp/ckpt"
expect 2 "--mode: banana not in" load "$tmp/ckpt" --mode banana
# A checkpoint only one rank cannot open (missing on its host): that rank's error, every rank's
# exit 1, no MPI_Abort.
cat >"$tmp/per_rank.sh" <<SH
#!/usr/bin/env bash
rank=\${OMPI_COMM_WORLD_RANK:-\${PMI_RANK:-0}}
if [[ \$rank == 1 ]]; then exec "$tool" "\$1" "$tmp/missing"; fi
exec "$tool" "\$@"
SH
chmod +x "$tmp/per_rank.sh"
real_tool=$tool
tool="$tmp/per_rank.sh"
expect 1 "error: not_found:" load "$tmp/ckpt"
tool=$real_tool
if grep -q "MPI_ABORT" "$tmp/err" "$tmp/out"; then
  echo "FAIL: a checkpoint one rank cannot open ended in MPI_Abort"
  cat "$tmp/err"
  failures=$((failures + 1))
fi

# --explain --json: one document with the plan's text.
if ! "$here/run.sh" 2 "$tool" load "$tmp/ckpt" --explain --json >"$tmp/explain" 2>"$tmp/err" ||
  ! python3 - "$tmp/explain" <<'PY'; then
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["ranks"] == 2 and doc["mode"] == "cooperative", doc
assert doc["explain"].startswith("cooperative plan: 2 ranks on 1 host"), doc["explain"]
assert "runs" not in doc, doc
PY
  echo "FAIL: --explain --json"
  cat "$tmp/explain" "$tmp/err"
  failures=$((failures + 1))
fi

# Cooperative and sliced: the same slices on every rank.
for mode in cooperative sliced; do
  "$here/run.sh" 2 "$tool" load "$tmp/ckpt" --mode "$mode" --json --checksum >"$tmp/$mode.json" 2>"$tmp/err" || {
    echo "FAIL: --mode $mode"
    cat "$tmp/err"
    failures=$((failures + 1))
  }
done
if ! python3 - "$tmp/cooperative.json" "$tmp/sliced.json" <<'PY'; then
import json, sys
coop, sliced = (json.load(open(p)) for p in sys.argv[1:])
def sums(doc):
    return [r["checksum"] for r in doc["runs"][0]["per_rank"]]
assert len(sums(coop)) == 2 and sums(coop) == sums(sliced), (sums(coop), sums(sliced))
assert sums(coop)[0] != sums(coop)[1], sums(coop)  # two different slices
PY
  echo "FAIL: cooperative and sliced checksums differ"
  failures=$((failures + 1))
fi

if [[ $failures -ne 0 ]]; then
  echo "$failures failures"
  exit 1
fi
echo "tensorferry-mpi: all checks passed"

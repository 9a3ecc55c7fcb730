#!/usr/bin/env bash
# Cooperative vs independent sliced loading across the multi-host rehearsal (issue 17;
# docs/distributed.md, "Multi-host rehearsal" and "Choosing what to exchange").
#
# Builds a rehearsal of HOSTS network namespaces (scripts/multihost.sh) whose links run at RATE and
# whose storage reads run at STORAGE_RATE per host (blkio throttling), stages CKPT on every host,
# and loads it with tensorferry-mpi, RANKS_PER_HOST ranks per host, with O_DIRECT (every read goes
# to the throttled disk: storage-bound, no page cache shared between hosts), REPEATS times per
# contender, the contenders alternating within each repetition (each repetition starting one
# contender later):
#   sliced          every rank reads its own slices (--mode sliced)
#   exchange-all    cooperative, every tensor exchanged (--exchange all)
#   exchange-auto   cooperative, the cost model's choice (--exchange auto) with the rates given
#   exchange-measured  the same with the network rate measured by the probe (no --network-rate)
#   exchange-none   cooperative path, nothing exchanged (the model's "all local")
# A contender NAME:before runs NAME with the binary TF_MPI_BEFORE instead (before/after a change,
# alternating in the same runs).
# Prints one JSON line per run and a summary (median wall seconds per contender) at the end; the
# cost model's plan (--explain) first. Root only. Environment (defaults in brackets):
#   HOSTS [4] RANKS_PER_HOST [2] RATE [200mbit] STORAGE_RATE [20mbps, tc units: 20 MB/s]
#   CKPT [data/small]
#   REPEATS [3] CONTENDERS ["sliced exchange-all exchange-auto exchange-none"] PREFIX [tfcoop]
#   COLD [1]: --cold, the files evicted from every host's page cache before each run (else the
#   staged copies are cached, and strided slices read exactly from the cache are not throttled)
#   BUDGET [32MB]: --budget, bytes per rank per round of the cooperative exchange
#   MODEL_STORAGE / MODEL_NETWORK: the rates given to the cost model, bytes per second per host
#   [STORAGE_RATE and RATE's bytes per second]; TF_MPI [build/release/bin/tensorferry-mpi];
#   TF_MPI_BEFORE (for NAME:before contenders); SHARD_RULES [builtin] (--shard-rules).
set -euo pipefail
cd "$(dirname "$0")/.."

HOSTS=${HOSTS:-4}
RANKS_PER_HOST=${RANKS_PER_HOST:-2}
RATE=${RATE:-200mbit}
STORAGE_RATE=${STORAGE_RATE:-20mbps}
CKPT=${CKPT:-data/small}
REPEATS=${REPEATS:-3}
CONTENDERS=${CONTENDERS:-sliced exchange-all exchange-auto exchange-none}
PREFIX=${PREFIX:-tfcoop}
TF_MPI=${TF_MPI:-$PWD/build/release/bin/tensorferry-mpi}
COLD=${COLD:-1}
BUDGET=${BUDGET:-32MB}
SHARD_RULES=${SHARD_RULES:-builtin}
TF_MPI_BEFORE=${TF_MPI_BEFORE:-}

[ "$(id -u)" = 0 ] || { echo "multihost_coop: needs root (network namespaces, cgroups)" >&2; exit 2; }
[ -x "$TF_MPI" ] || { echo "multihost_coop: $TF_MPI not built" >&2; exit 2; }
[ -e "$CKPT" ] || { echo "multihost_coop: checkpoint $CKPT not found" >&2; exit 2; }

# Rates in bytes per second for the cost model, from the rehearsal's own spellings.
to_bytes_per_second() {
  python3 - "$1" <<'EOF'
import re, sys
v = sys.argv[1].strip().lower()
m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(bit|b|bps)?", v)
if not m:
    sys.exit(f"cannot read rate {sys.argv[1]!r}")
n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
print(int(n / 8 if m.group(3) == "bit" else n))
EOF
}
MODEL_STORAGE=${MODEL_STORAGE:-$(to_bytes_per_second "$STORAGE_RATE")}
MODEL_NETWORK=${MODEL_NETWORK:-$(to_bytes_per_second "$RATE")}

mh=scripts/multihost.sh
cleanup() { "$mh" down --prefix "$PREFIX" >/dev/null 2>&1 || true; }
trap cleanup EXIT
"$mh" up --prefix "$PREFIX" --hosts "$HOSTS" --rate "$RATE" --storage-rate "$STORAGE_RATE" >&2
path=$("$mh" stage --prefix "$PREFIX" "$CKPT" ckpt)
echo "# $(date -u +%FT%TZ) $(uptime | sed 's/.*load average/load average/')" >&2
echo "# $HOSTS hosts x $RANKS_PER_HOST ranks, link $RATE, storage $STORAGE_RATE per host," \
  "cold $COLD, budget $BUDGET, model storage $MODEL_STORAGE B/s network $MODEL_NETWORK B/s," \
  "checkpoint $CKPT" >&2

run() {  # contender -> one JSON document on stdout
  local args=(load "$path" --shard-rules "$SHARD_RULES" --direct on --json --budget "$BUDGET"
              --storage-rate "$MODEL_STORAGE")
  local bin=$TF_MPI name=$1
  if [[ $name == *:before ]]; then
    [ -x "$TF_MPI_BEFORE" ] || { echo "multihost_coop: $name needs TF_MPI_BEFORE" >&2; return 2; }
    bin=$TF_MPI_BEFORE
    name=${name%:before}
  fi
  [ "$COLD" = 1 ] && args+=(--cold)
  case $name in
    sliced) args+=(--mode sliced) ;;
    exchange-all) args+=(--mode cooperative --exchange all) ;;
    exchange-auto) args+=(--mode cooperative --exchange auto --network-rate "$MODEL_NETWORK") ;;
    exchange-measured) args+=(--mode cooperative --exchange auto) ;;  # the probe's rate
    exchange-none) args+=(--mode cooperative --exchange none) ;;
    *) echo "unknown contender $1" >&2; return 2 ;;
  esac
  "$mh" mpirun --prefix "$PREFIX" --ranks-per-host "$RANKS_PER_HOST" -- "$bin" "${args[@]}"
}

"$mh" mpirun --prefix "$PREFIX" --ranks-per-host "$RANKS_PER_HOST" -- "$TF_MPI" load "$path" \
  --shard-rules "$SHARD_RULES" --explain --budget "$BUDGET" --storage-rate "$MODEL_STORAGE" \
  --network-rate "$MODEL_NETWORK" | sed -n '1,6p' >&2

results=$(mktemp)
read -r -a contenders <<<"$CONTENDERS"
n=${#contenders[@]}
for ((rep = 1; rep <= REPEATS; rep++)); do
  # Each repetition starts one contender later, so none always runs right after the same one.
  for ((j = 0; j < n; j++)); do
    c=${contenders[$(((rep - 1 + j) % n))]}
    doc=$(run "$c")
    python3 - "$c" "$rep" "$doc" "$RANKS_PER_HOST" <<'EOF' | tee -a "$results"
import json, sys
c, rep, doc = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
per_host = int(sys.argv[4])
r = doc["runs"][0]
ranks = r["per_rank"]
# Ranks fill the hosts in order (mpirun --map-by slot, RANKS_PER_HOST slots per host).
host_read = {}
for x in ranks:
    host_read[x["rank"] // per_host] = host_read.get(x["rank"] // per_host, 0) + x["bytes_read"]
print(json.dumps({"contender": c, "repeat": rep, "wall_seconds": r["wall_seconds"],
                  "bytes_read_total": r["bytes_read_total"],
                  "bytes_read_busiest_host": max(host_read.values()),
                  "bytes_sent_total": sum(x["bytes_sent"] for x in ranks),
                  "exchanged_tensors": ranks[0]["exchanged_tensors"],
                  "local_tensors": ranks[0]["local_tensors"],
                  "measured_network_rate": ranks[0].get("measured_network_rate", 0),
                  "probe_seconds": ranks[0].get("probe_seconds", 0),
                  # The slowest rank's, as multihost_gloo_bench.py prints them.
                  "slowest_read_exchange_local_network_seconds": [
                      round(max(x.get(k, 0) for x in ranks), 3)
                      for k in ("read_seconds", "exchange_seconds", "local_seconds",
                                "network_seconds")],
                  "estimate": doc.get("estimate", {}).get("chosen", {}).get("seconds")}))
EOF
  done
done
python3 - "$results" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["contender"], []).append(r)
base = statistics.median(r["wall_seconds"] for r in by.get("sliced", rows))
for c, rs in by.items():
    med = statistics.median(r["wall_seconds"] for r in rs)
    print(json.dumps({"contender": c, "median_wall_seconds": round(med, 3),
                      "runs": [round(r["wall_seconds"], 3) for r in rs],
                      "speedup_vs_sliced": round(base / med, 2),
                      "bytes_read_total": rs[0]["bytes_read_total"],
                      "bytes_read_busiest_host": rs[0]["bytes_read_busiest_host"],
                      "estimate_seconds": rs[0]["estimate"]}))
EOF
rm -f "$results"

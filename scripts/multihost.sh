#!/usr/bin/env bash
# shellcheck disable=SC2015  # "test && test || die": die is meant to run when either test fails
# A multi-host rehearsal on one machine (docs/distributed.md, "Multi-host rehearsal"): N "hosts"
# as Linux network namespaces, each joined to a bridge by a veth pair whose two ends are shaped by
# tc (a bandwidth, and a latency where the kernel has sch_netem), and Open MPI's mpirun across
# them over TCP, launched without ssh. Needs root, iproute2, util-linux (unshare, flock), and Open
# MPI for the mpirun command.
#
#   scripts/multihost.sh up --hosts N [--rate R] [--delay D] [--prefix P]
#   scripts/multihost.sh down [--prefix P]
#   scripts/multihost.sh status [--prefix P]
#   scripts/multihost.sh exec [--prefix P] HOST cmd...
#   scripts/multihost.sh mpirun [--prefix P] [--ranks-per-host K] [--hosts M] -- program args...
#   scripts/multihost.sh stage [--prefix P] SRC NAME
#   scripts/multihost.sh measure [--prefix P] [--bytes N] FROM TO
#
# Names: namespaces P-h1..P-hN, veths P-h1..P-hN (the bridge ends; the other end is eth0 inside
# the host), bridge P-br, per-host /etc/netns/P-hI/hosts, state under $MULTIHOST_DIR/P (default
# /var/tmp/tensorferry-multihost/P). P defaults to $MULTIHOST_PREFIX or "tfmh"; at most 10
# characters [a-z0-9]. The subnet is a free 10.x.y.0/24 (none of `ip -o addr` and no route
# overlaps it); host I is .I, the bridge (the root namespace, where mpirun runs) is .254.
#
# HOST is h1..hN, 1..N or the host's IP address. Every command run in a host (exec, and Open MPI's
# daemons) runs in its network namespace, with its own UTS namespace (hostname P-hI) and its own
# mount namespace in which the host's private storage directory $MULTIHOST_DIR/P/hosts/hI is
# bind-mounted over $MULTIHOST_DIR/P/local: the same path names a different directory on every
# host. `stage SRC NAME` copies SRC into every host's storage (separate files: separate page-cache
# pages), so `$MULTIHOST_DIR/P/local/NAME` is each host's own copy. Environment inside a host:
# TF_MULTIHOST_HOST (hI), TF_MULTIHOST_IP, TF_MULTIHOST_LOCAL (the local path), GLOO_SOCKET_IFNAME
# (eth0, unless set).
set -euo pipefail

SELF=$(readlink -f "$0")
BASE=${MULTIHOST_DIR:-/var/tmp/tensorferry-multihost}
PREFIX=${MULTIHOST_PREFIX:-tfmh}
LOCK=/run/lock/tensorferry-multihost.lock

die() {
  echo "multihost: $*" >&2
  exit 1
}

usage() {
  sed -n '/^#   scripts/s/^#   //p' "$SELF" >&2
  exit 2
}

check_prefix() {
  [[ $PREFIX =~ ^[a-z][a-z0-9]{0,9}$ ]] ||
    die "--prefix '$PREFIX': 1 to 10 characters [a-z0-9], starting with a letter (interface names are at most 15)"
}

need_root() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, veths, tc)"
  ip netns list >/dev/null 2>&1 || die "'ip netns' is not available: $(ip netns list 2>&1 | head -1)"
}

state() { echo "$BASE/$PREFIX"; }

# Loads the state of a running rehearsal: SUBNET (a.b.c), HOSTS, RATE, DELAY.
load_state() {
  local f
  f="$(state)/env"
  [ -f "$f" ] ||
    die "no rehearsal '$PREFIX' is up ($f missing): run 'scripts/multihost.sh up --prefix $PREFIX --hosts N'"
  # shellcheck disable=SC1090
  . "$f"
}

# A rate in tc's units to bytes per second.
rate_bytes() {
  local r=$1 n unit
  [[ $r =~ ^([0-9]+(\.[0-9]+)?)([a-zA-Z]*)$ ]] ||
    die "--rate '$r': expected a number and a unit (bit, kbit, mbit, gbit, bps, kbps, mbps, gbps)"
  n=${BASH_REMATCH[1]}
  unit=${BASH_REMATCH[3],,}
  case $unit in
    bit | "") awk -v n="$n" 'BEGIN{printf "%d", n/8}' ;;
    kbit) awk -v n="$n" 'BEGIN{printf "%d", n*1000/8}' ;;
    mbit) awk -v n="$n" 'BEGIN{printf "%d", n*1e6/8}' ;;
    gbit) awk -v n="$n" 'BEGIN{printf "%d", n*1e9/8}' ;;
    bps) awk -v n="$n" 'BEGIN{printf "%d", n}' ;;
    kbps) awk -v n="$n" 'BEGIN{printf "%d", n*1000}' ;;
    mbps) awk -v n="$n" 'BEGIN{printf "%d", n*1e6}' ;;
    gbps) awk -v n="$n" 'BEGIN{printf "%d", n*1e9}' ;;
    *) die "--rate '$r': unknown unit '$unit' (bit, kbit, mbit, gbit, bps, kbps, mbps, gbps)" ;;
  esac
}

ip2int() {
  local IFS=.
  # shellcheck disable=SC2206
  local o=($1)
  echo $(((o[0] << 24) | (o[1] << 16) | (o[2] << 8) | o[3]))
}

# Every IPv4 network in use on this machine (addresses and routes, all tables), as "base/len".
used_networks() {
  ip -o -4 addr show | awk '{print $4}'
  # A route's destination is its first word, or its second after a route type.
  ip -4 route show table all |
    awk '$1 ~ /^(unicast|local|broadcast|multicast|anycast|unreachable|blackhole|prohibit|throw|nat)$/ {print $2; next} {print $1}' |
    sed -e 's#^default$#0.0.0.0/0#' | grep -E '^[0-9.]+(/[0-9]+)?$' | sed -e '/\//!s#$#/32#' || true
}

# The first 10.x.y.0/24 (x from 200, starting at a point given by the prefix) that overlaps no
# network in use, as "10.x.y".
pick_subnet() {
  local nets=() n base len start i x y cand lo hi nlo nhi clash
  mapfile -t nets < <(used_networks)
  start=$(($(printf '%s' "$PREFIX" | cksum | cut -d' ' -f1) % 12800))
  for ((i = 0; i < 12800; i++)); do
    x=$((200 + ((start + i) / 256) % 50))
    y=$(((start + i) % 256))
    cand=10.$x.$y
    lo=$(ip2int "$cand.0")
    hi=$((lo + 255))
    clash=0
    for n in "${nets[@]}"; do
      base=${n%/*}
      len=${n#*/}
      ((len == 0)) && continue # the default route overlaps everything; it is not an address
      nlo=$(($(ip2int "$base") & ((0xffffffff << (32 - len)) & 0xffffffff)))
      nhi=$((nlo + (1 << (32 - len)) - 1))
      if ((nlo <= hi && lo <= nhi)); then
        clash=1
        break
      fi
    done
    ((clash)) || {
      echo "$cand"
      return
    }
  done
  die "no free 10.x.y.0/24 subnet found"
}

host_index() {
  local h=$1 i
  case $h in
    h[0-9]*) i=${h#h} ;;
    [0-9]*.*) [[ $h == "$SUBNET".* ]] || die "host '$h' is not in rehearsal '$PREFIX' ($SUBNET.0/24)"; i=${h##*.} ;;
    *) i=$h ;;
  esac
  [[ $i =~ ^[0-9]+$ ]] && ((i >= 1 && i <= HOSTS)) || die "no host '$h' in rehearsal '$PREFIX' (hosts h1..h$HOSTS)"
  echo "$i"
}

# Applies the shaping of one direction: tbf for the rate, netem (with the tbf as its child) for
# a delay.
shape() {
  local ns=$1 dev=$2 with_delay=$3 run=()
  [ -n "$ns" ] && run=(ip netns exec "$ns")
  local rb burst err
  if [ -n "$RATE" ]; then
    rb=$(rate_bytes "$RATE")
    burst=$((rb / 200)) # 5 ms at the rate, at least 64 KiB (one GSO packet)
    ((burst < 65536)) && burst=65536
  fi
  if [ "$with_delay" = 1 ] && [ -n "$DELAY" ]; then
    err=$("${run[@]}" tc qdisc replace dev "$dev" root handle 1: netem delay "$DELAY" limit 100000 2>&1) ||
      die "tc: cannot add 'netem delay $DELAY' on $dev ($err); the kernel needs sch_netem for --delay" \
        "(tbf, for --rate, works without it)"
    if [ -n "$RATE" ]; then
      err=$("${run[@]}" tc qdisc replace dev "$dev" parent 1:1 handle 10: tbf rate "$RATE" burst "$burst" latency 100ms 2>&1) ||
        die "tc: cannot add 'tbf rate $RATE' under netem on $dev ($err)"
    fi
  elif [ -n "$RATE" ]; then
    err=$("${run[@]}" tc qdisc replace dev "$dev" root handle 1: tbf rate "$RATE" burst "$burst" latency 100ms 2>&1) ||
      die "tc: cannot add 'tbf rate $RATE' on $dev ($err)"
  fi
}

do_down() {
  local ns pid l
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^$PREFIX-h[0-9]+$" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
      kill -TERM "$pid" 2>/dev/null || true
    done
    ip netns del "$ns" || die "cannot delete network namespace $ns"
    rm -rf "/etc/netns/$ns"
  done
  for l in $(ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^$PREFIX-(br|h[0-9]+x?)$" || true); do
    if ! ip link del "$l" 2>/dev/null && ip link show "$l" >/dev/null 2>&1; then
      die "cannot delete link $l"
    fi
  done
  rm -rf "/etc/netns/$PREFIX"-h* "$(state)"
  # Only when empty (no other rehearsal, nothing of anyone else); a MULTIHOST_DIR given by the caller stays.
  rmdir /etc/netns 2>/dev/null || true
  [ -n "${MULTIHOST_DIR:-}" ] || rmdir "$BASE" 2>/dev/null || true
}

do_up() {
  local hosts=0 i ns veth
  RATE="" DELAY=""
  while (($#)); do
    case $1 in
      --hosts) hosts=${2:?--hosts N}; shift 2 ;;
      --rate) RATE=${2:?--rate R}; shift 2 ;;
      --delay) DELAY=${2:?--delay D}; shift 2 ;;
      --prefix) PREFIX=${2:?--prefix P}; shift 2 ;;
      *) die "up: unknown argument '$1'" ;;
    esac
  done
  check_prefix
  [[ $hosts =~ ^[0-9]+$ ]] && ((hosts >= 1 && hosts <= 99)) || die "up: --hosts N with N in 1..99 (got '$hosts')"
  [ -n "$RATE" ] && rate_bytes "$RATE" >/dev/null
  [ -n "$DELAY" ] && { [[ $DELAY =~ ^[0-9.]+(s|ms|us)$ ]] || die "--delay '$DELAY': expected a number and s, ms or us"; }
  HOSTS=$hosts
  # `up` on a rehearsal that is up re-creates it from nothing.
  do_down
  SUBNET=$(pick_subnet)
  trap 'echo "multihost: up failed; tearing down $PREFIX" >&2; do_down' EXIT
  mkdir -p "$(state)/local"
  ip link add "$PREFIX-br" type bridge || die "cannot create bridge $PREFIX-br"
  ip addr add "$SUBNET.254/24" dev "$PREFIX-br"
  ip link set "$PREFIX-br" up
  for ((i = 1; i <= hosts; i++)); do
    ns=$PREFIX-h$i
    veth=$PREFIX-h$i
    mkdir -p "$(state)/hosts/h$i"
    ip netns add "$ns" || die "cannot create network namespace $ns"
    ip link add "$veth" type veth peer name "${veth}x" || die "cannot create veth pair $veth"
    ip link set "${veth}x" netns "$ns"
    ip netns exec "$ns" ip link set "${veth}x" name eth0
    ip netns exec "$ns" ip addr add "$SUBNET.$i/24" dev eth0
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" ip link set eth0 up
    ip link set "$veth" master "$PREFIX-br"
    ip link set "$veth" up
    shape "$ns" eth0 1 # what the host sends (with the delay: one-way latency D between hosts)
    shape "" "$veth" 0 # what the host receives
  done
  # Every host resolves every host's name (ip netns exec bind-mounts /etc/netns/NS/hosts).
  for ((i = 1; i <= hosts; i++)); do
    mkdir -p "/etc/netns/$PREFIX-h$i"
    {
      echo "127.0.0.1 localhost"
      for ((j = 1; j <= hosts; j++)); do echo "$SUBNET.$j $PREFIX-h$j"; done
      echo "$SUBNET.254 $PREFIX-br"
    } >"/etc/netns/$PREFIX-h$i/hosts"
  done
  cat >"$(state)/env" <<EOF
SUBNET=$SUBNET
HOSTS=$hosts
RATE='$RATE'
DELAY='$DELAY'
EOF
  {
    echo '#!/bin/sh'
    echo '# Open MPI plm_rsh_agent: <host> <command...> runs the command in that host.'
    printf 'exec env MULTIHOST_DIR=%q %q agent --prefix %q "$@"\n' "$BASE" "$SELF" "$PREFIX"
  } >"$(state)/agent"
  chmod +x "$(state)/agent"
  trap - EXIT
  echo "multihost: $PREFIX up: $hosts hosts on $SUBNET.0/24 (h1=$SUBNET.1 .. h$hosts=$SUBNET.$hosts," \
    "bridge $SUBNET.254)${RATE:+, rate $RATE}${DELAY:+, delay $DELAY}"
}

# Runs argv in host $1 (an index): network namespace, own hostname, own storage at local/.
in_host() {
  local i=$1
  shift
  local ns=$PREFIX-h$i
  ip netns list | awk '{print $1}' | grep -qx "$ns" || die "network namespace $ns is gone: run 'up' again"
  # shellcheck disable=SC2016  # the inner script's $1.. are its own arguments
  exec ip netns exec "$ns" env TF_MULTIHOST_HOST="h$i" TF_MULTIHOST_IP="$SUBNET.$i" \
    TF_MULTIHOST_LOCAL="$(state)/local" GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-eth0}" \
    unshare --uts -- /bin/sh -c '
      hostname "$1" && mount --bind "$2" "$3" ||
        { echo "multihost: cannot set up host $1 (hostname, bind mount of $2)" >&2; exit 1; }
      shift 3
      exec "$@"' \
    sh "$ns" "$(state)/hosts/h$i" "$(state)/local" "$@"
}

do_exec() {
  while [[ ${1:-} == --prefix ]]; do PREFIX=${2:?--prefix P}; shift 2; done
  (($# >= 2)) || die "exec HOST cmd..."
  check_prefix
  load_state
  local i
  i=$(host_index "$1")
  shift
  in_host "$i" "$@"
}

# Open MPI's launcher: `agent [--prefix P] <host> <command...>`, as ssh would run it (the words
# joined, run by a shell).
do_agent() {
  while [[ ${1:-} == --prefix ]]; do PREFIX=${2:?--prefix P}; shift 2; done
  (($# >= 2)) || die "agent HOST command..."
  load_state
  local i
  i=$(host_index "$1")
  shift
  in_host "$i" /bin/sh -c "$*"
}

do_mpirun() {
  local k=1 m="" i
  while (($#)); do
    case $1 in
      --ranks-per-host) k=${2:?--ranks-per-host K}; shift 2 ;;
      --hosts) m=${2:?--hosts M}; shift 2 ;;
      --prefix) PREFIX=${2:?--prefix P}; shift 2 ;;
      --) shift; break ;;
      *) die "mpirun: unknown argument '$1' (program arguments go after --)" ;;
    esac
  done
  (($#)) || die "mpirun [--ranks-per-host K] [--hosts M] -- program args..."
  check_prefix
  load_state
  command -v mpirun >/dev/null || die "mpirun not found (apt-get install openmpi-bin)"
  m=${m:-$HOSTS}
  [[ $k =~ ^[0-9]+$ ]] && ((k >= 1)) || die "--ranks-per-host '$k': a positive number"
  [[ $m =~ ^[0-9]+$ ]] && ((m >= 1 && m <= HOSTS)) || die "--hosts '$m': 1..$HOSTS"
  local hostfile
  hostfile=$(state)/hostfile.$$
  for ((i = 1; i <= m; i++)); do echo "$SUBNET.$i slots=$k"; done >"$hostfile"
  local rc=0
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun \
    --hostfile "$hostfile" -np $((m * k)) --map-by slot \
    --mca plm_rsh_agent "$(state)/agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca btl tcp,self --mca btl_tcp_if_include "$SUBNET.0/24" \
    --mca oob_tcp_if_include "$SUBNET.0/24" "$@" || rc=$?
  rm -f "$hostfile"
  return $rc
}

do_stage() {
  while [[ ${1:-} == --prefix ]]; do PREFIX=${2:?--prefix P}; shift 2; done
  (($# == 2)) || die "stage SRC NAME"
  load_state
  local src=$1 name=$2 i
  [ -e "$src" ] || die "stage: '$src' does not exist"
  [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "stage: NAME '$name' must be one path component"
  for ((i = 1; i <= HOSTS; i++)); do
    rm -rf "$(state)/hosts/h$i/$name"
    cp -a "$src" "$(state)/hosts/h$i/$name" || die "stage: cannot copy $src to host h$i"
  done
  echo "$(state)/local/$name"
}

# A timed TCP transfer of N bytes from host FROM to host TO; prints one JSON line (bytes, seconds,
# bits per second) as the receiver saw it (first byte to the sender's end).
do_measure() {
  local bytes=$((20 * 1000 * 1000)) port=$((20000 + RANDOM % 20000))
  local args=()
  while (($#)); do
    case $1 in
      --bytes) bytes=${2:?--bytes N}; shift 2 ;;
      --prefix) PREFIX=${2:?--prefix P}; shift 2 ;;
      *) args+=("$1"); shift ;;
    esac
  done
  ((${#args[@]} == 2)) || die "measure [--bytes N] FROM TO"
  load_state
  local from to py=${PYTHON:-python3}
  from=$(host_index "${args[0]}")
  to=$(host_index "${args[1]}")
  ((from != to)) || die "measure: FROM and TO must be different hosts"
  local out
  out=$(mktemp)
  # shellcheck disable=SC2016
  ("$SELF" exec --prefix "$PREFIX" "$to" "$py" -c '
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(30)
c, _ = s.accept(); c.settimeout(60)
got = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if t0 is None: t0 = time.monotonic()
    got += len(b)
dt = time.monotonic() - t0
print(json.dumps({"bytes": got, "seconds": dt, "bits_per_second": got * 8 / dt}))
' "$SUBNET.$to" "$port" >"$out") &
  local rpid=$!
  # shellcheck disable=SC2016
  "$SELF" exec --prefix "$PREFIX" "$from" "$py" -c '
import socket, sys, time
deadline = time.monotonic() + 20
while True:
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
chunk = b"\0" * (1 << 20); left = int(sys.argv[3])
while left > 0:
    n = s.send(chunk[:min(left, len(chunk))]); left -= n
s.shutdown(socket.SHUT_WR); s.recv(1); s.close()
' "$SUBNET.$to" "$port" "$bytes" || {
    kill "$rpid" 2>/dev/null || true
    rm -f "$out"
    die "measure: the sender in h$from failed"
  }
  wait "$rpid" || {
    rm -f "$out"
    die "measure: the receiver in h$to failed"
  }
  cat "$out"
  rm -f "$out"
}

do_status() {
  while [[ ${1:-} == --prefix ]]; do PREFIX=${2:?--prefix P}; shift 2; done
  load_state
  local i
  echo "prefix=$PREFIX subnet=$SUBNET.0/24 hosts=$HOSTS rate=${RATE:-none} delay=${DELAY:-none} bridge=$SUBNET.254"
  for ((i = 1; i <= HOSTS; i++)); do
    echo "h$i $SUBNET.$i $PREFIX-h$i $(state)/hosts/h$i"
  done
}

cmd=${1:-}
(($#)) && shift
case $cmd in
  up)
    need_root
    exec 9>"$LOCK"
    flock 9
    do_up "$@"
    ;;
  down)
    need_root
    while (($#)); do
      case $1 in
        --prefix) PREFIX=${2:?--prefix P}; shift 2 ;;
        *) die "down: unknown argument '$1'" ;;
      esac
    done
    check_prefix
    exec 9>"$LOCK"
    flock 9
    do_down
    ;;
  status) do_status "$@" ;;
  exec) need_root; do_exec "$@" ;;
  agent) do_agent "$@" ;;
  mpirun) need_root; do_mpirun "$@" ;;
  stage) do_stage "$@" ;;
  measure) need_root; do_measure "$@" ;;
  *) usage ;;
esac

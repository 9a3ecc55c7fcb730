#!/usr/bin/env bash
# shellcheck disable=SC2015  # "test && test || die": die is meant to run when either test fails
# A multi-host rehearsal on one machine (docs/distributed.md, "Multi-host rehearsal"): N "hosts"
# as Linux network namespaces, each joined to a bridge by a veth pair whose two ends are shaped by
# tc (a bandwidth, and a latency where the kernel has sch_netem), and Open MPI's mpirun across
# them over TCP, launched without ssh. Needs root, iproute2, util-linux (unshare, flock), and Open
# MPI for the mpirun command.
#
#   scripts/multihost.sh up --hosts N [--rate R] [--delay D] [--storage-rate S] [--prefix P]
#   scripts/multihost.sh down [--prefix P]
#   scripts/multihost.sh status [--prefix P]
#   scripts/multihost.sh exec [--prefix P] HOST cmd...
#   scripts/multihost.sh mpirun [--prefix P] [--ranks-per-host K] [--hosts M] -- program args...
#   scripts/multihost.sh stage [--prefix P] SRC NAME
#   scripts/multihost.sh measure [--prefix P] [--bytes N] FROM TO
#   scripts/multihost.sh measure-storage [--prefix P] [--bytes N] HOST...
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
#
# --storage-rate S (tc's units, as --rate: 100mbps is 100 MB/s, 800mbit is 100 MB/s) limits what
# each host reads from the disk that holds $MULTIHOST_DIR to S, every host on its own: one cgroup
# per host, tensorferry-P-hI, in the cgroup v1 blkio hierarchy (blkio.throttle.read_bps_device) or,
# where there is none, in the unified hierarchy with its io controller (io.max rbps), and every
# command run in a host joins its host's cgroup. Reads that reach the disk are throttled; page-cache
# hits are not (benchmark cold: O_DIRECT, or evict every host's copy; tensorferry-mpi --cold evicts
# on rank 0's host only); writes are not throttled.
# `measure-storage` reads a file of N bytes with O_DIRECT in every HOST at once.
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

# Loads the state of a running rehearsal: SUBNET (a.b.c), HOSTS, RATE, DELAY, and the storage
# throttle: STORAGE_RATE (empty: none), STORAGE_DEV (the disk, MAJ:MIN), STORAGE_CGROUP (v1 or v2),
# STORAGE_ROOT (the hierarchy's directory that holds the hosts' cgroups).
load_state() {
  local f
  f="$(state)/env"
  [ -f "$f" ] ||
    die "no rehearsal '$PREFIX' is up ($f missing): run 'scripts/multihost.sh up --prefix $PREFIX --hosts N'"
  STORAGE_RATE="" STORAGE_DEV="" STORAGE_CGROUP="" STORAGE_ROOT=""
  # shellcheck disable=SC1090
  . "$f"
}

# A rate in tc's units to bytes per second ($2: the option it came from, for errors).
rate_bytes() {
  local r=$1 opt=${2:---rate} n unit
  [[ $r =~ ^([0-9]+(\.[0-9]+)?)([a-zA-Z]*)$ ]] ||
    die "$opt '$r': expected a number and a unit (bits/s: bit, kbit, mbit, gbit; bytes/s: bps, kbps, mbps, gbps)"
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
    *) die "$opt '$r': unknown unit '$unit' (bits/s: bit, kbit, mbit, gbit; bytes/s: bps, kbps, mbps, gbps)" ;;
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

# The cgroup directories where hosts' storage cgroups can live, one "KIND DIR" a line: the cgroup v1
# blkio hierarchy's root (KIND v1) when it has blk-throttle, then the unified hierarchy's root (v2)
# when its io controller is free (not bound to v1).
storage_hierarchies() {
  local dir
  dir=$(findmnt -rn -t cgroup -o TARGET,OPTIONS 2>/dev/null | awk '$2 ~ /(^|,)blkio(,|$)/ {print $1; exit}')
  if [ -n "$dir" ] && [ -f "$dir/blkio.throttle.read_bps_device" ]; then echo "v1 $dir"; fi
  dir=$(findmnt -rn -t cgroup2 -o TARGET 2>/dev/null | head -1)
  if [ -n "$dir" ] && grep -qw io "$dir/cgroup.controllers" 2>/dev/null; then echo "v2 $dir"; fi
  return 0
}

# The whole disk (MAJ:MIN) that holds directory $1: blk-throttle takes disks, not partitions (the
# kernel answers ENODEV for a partition), so a partition is replaced by its disk.
storage_disk() {
  local dir=$1 d src sys
  d=$(stat -c %d "$dir") || die "--storage-rate: cannot stat $dir"
  d="$((((d >> 8) & 0xfff) | ((d >> 32) & ~0xfff))):$(((d & 0xff) | ((d >> 12) & ~0xff)))"
  if [ ! -e "/sys/dev/block/$d" ]; then
    # A filesystem on an anonymous device number (btrfs): its mount's source, when that is a disk.
    src=$(findmnt -n -o SOURCE -T "$dir" 2>/dev/null | tail -1) # the topmost of stacked mounts
    src=${src%%[*}
    if [ -b "$src" ]; then
      d="$((16#$(stat -L -c %t "$src"))):$((16#$(stat -L -c %T "$src")))"
    else
      die "--storage-rate: $dir is on $(stat -f -c %T "$dir")" \
        "(${src:-no source}, device $d), not on a block device; set MULTIHOST_DIR to a directory on a disk"
    fi
  fi
  sys=$(readlink -f "/sys/dev/block/$d")
  [ -e "$sys/partition" ] && d=$(cat "$sys/../dev")
  echo "$d"
}

# Writes $1 into the cgroup file $2, or dies saying what the kernel answered.
cg_write() {
  local err
  err=$({ printf '%s\n' "$1" >"$2"; } 2>&1) || die "cannot write '$1' to $2: ${err##*: }"
}

# Before anything is created: the disk under the state directory (STORAGE_DEV) and the hierarchy
# to throttle it with (STORAGE_CGROUP, STORAGE_ROOT), or dies saying which is missing.
storage_check() {
  local dir kind root bps
  bps=$(rate_bytes "$STORAGE_RATE" --storage-rate) || exit 1
  ((bps > 0)) || die "--storage-rate '$STORAGE_RATE': must be above 0"
  dir=$(state)
  while [ ! -d "$dir" ]; do dir=$(dirname "$dir"); done # where the state directory will be created
  STORAGE_DEV=$(storage_disk "$dir") || exit 1
  read -r kind root < <(storage_hierarchies) ||
    die "--storage-rate: no cgroup controller to throttle reads: neither a cgroup v1 'blkio' hierarchy" \
      "with blkio.throttle.read_bps_device nor a cgroup2 hierarchy with the 'io' controller is mounted" \
      "(findmnt -t cgroup,cgroup2); leaving '$PREFIX' as it was"
  STORAGE_CGROUP=$kind STORAGE_ROOT=$root
}

# One cgroup per host, tensorferry-P-hI, reading at most STORAGE_RATE from STORAGE_DEV (storage_check
# found both).
storage_setup() {
  local bps kind=$STORAGE_CGROUP root=$STORAGE_ROOT i cg
  bps=$(rate_bytes "$STORAGE_RATE" --storage-rate) || exit 1
  if [ "$kind" = v2 ] && ! grep -qw io "$root/cgroup.subtree_control"; then
    cg_write +io "$root/cgroup.subtree_control" # stays on after down: others may rely on it
  fi
  for ((i = 1; i <= HOSTS; i++)); do
    cg=$root/tensorferry-$PREFIX-h$i
    mkdir "$cg" || die "cannot create cgroup $cg"
    if [ "$kind" = v1 ]; then
      cg_write "$STORAGE_DEV $bps" "$cg/blkio.throttle.read_bps_device"
    else
      cg_write "$STORAGE_DEV rbps=$bps" "$cg/io.max"
    fi
  done
}

# Empties (TERM, then KILL) and removes every host cgroup named with the prefix, in either hierarchy.
storage_teardown() {
  local kind root cg pids sig t
  while read -r kind root; do
    for cg in "$root/tensorferry-$PREFIX"-h*; do
      [[ -d $cg && ${cg##*/} =~ ^tensorferry-$PREFIX-h[0-9]+$ ]] || continue
      for sig in TERM KILL; do
        pids=$(cat "$cg/cgroup.procs")
        [ -n "$pids" ] || break
        # shellcheck disable=SC2086  # one pid a word
        kill -s "$sig" $pids 2>/dev/null || true
        for ((t = 0; t < 50; t++)); do
          [ -n "$(cat "$cg/cgroup.procs")" ] || break
          sleep 0.1
        done
      done
      rmdir "$cg" 2>/dev/null ||
        die "cannot remove cgroup $cg (processes still in it: $(tr '\n' ' ' <"$cg/cgroup.procs"))"
    done
  done < <(storage_hierarchies)
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
  storage_teardown
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
  RATE="" DELAY="" STORAGE_RATE="" STORAGE_DEV="" STORAGE_CGROUP="" STORAGE_ROOT=""
  while (($#)); do
    case $1 in
      --hosts) hosts=${2:?--hosts N}; shift 2 ;;
      --rate) RATE=${2:?--rate R}; shift 2 ;;
      --delay) DELAY=${2:?--delay D}; shift 2 ;;
      --storage-rate) STORAGE_RATE=${2:?--storage-rate S}; shift 2 ;;
      --prefix) PREFIX=${2:?--prefix P}; shift 2 ;;
      *) die "up: unknown argument '$1'" ;;
    esac
  done
  check_prefix
  [[ $hosts =~ ^[0-9]+$ ]] && ((hosts >= 1 && hosts <= 99)) || die "up: --hosts N with N in 1..99 (got '$hosts')"
  [ -n "$RATE" ] && rate_bytes "$RATE" >/dev/null
  if [ -n "$STORAGE_RATE" ]; then storage_check; fi
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
  if [ -n "$STORAGE_RATE" ]; then storage_setup; fi
  cat >"$(state)/env" <<EOF
SUBNET=$SUBNET
HOSTS=$hosts
RATE='$RATE'
DELAY='$DELAY'
STORAGE_RATE='$STORAGE_RATE'
STORAGE_DEV='$STORAGE_DEV'
STORAGE_CGROUP='$STORAGE_CGROUP'
STORAGE_ROOT='$STORAGE_ROOT'
EOF
  {
    echo '#!/bin/sh'
    echo '# Open MPI plm_rsh_agent: <host> <command...> runs the command in that host.'
    printf 'exec env MULTIHOST_DIR=%q %q agent --prefix %q "$@"\n' "$BASE" "$SELF" "$PREFIX"
  } >"$(state)/agent"
  chmod +x "$(state)/agent"
  trap - EXIT
  echo "multihost: $PREFIX up: $hosts hosts on $SUBNET.0/24 (h1=$SUBNET.1 .. h$hosts=$SUBNET.$hosts," \
    "bridge $SUBNET.254)${RATE:+, rate $RATE}${DELAY:+, delay $DELAY}${STORAGE_RATE:+, storage reads $STORAGE_RATE per host from disk $STORAGE_DEV (cgroup $STORAGE_CGROUP)}"
}

# Runs argv in host $1 (an index): network namespace, own hostname, own storage at local/, and,
# with a storage rate, the host's cgroup (joined by this process before it execs: every child stays).
in_host() {
  local i=$1
  shift
  local ns=$PREFIX-h$i cg err me=$BASHPID # this process: the command substitution below is another
  ip netns list | awk '{print $1}' | grep -qx "$ns" || die "network namespace $ns is gone: run 'up' again"
  if [ -n "$STORAGE_RATE" ]; then
    cg=$STORAGE_ROOT/tensorferry-$PREFIX-h$i
    [ -d "$cg" ] || die "cgroup $cg of host h$i (--storage-rate $STORAGE_RATE) is gone: run 'up' again"
    err=$({ echo "$me" >"$cg/cgroup.procs"; } 2>&1) || die "cannot join cgroup $cg: ${err##*: }"
  fi
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
  # mpi_yield_when_idle: the hosts of the rehearsal share this machine's CPUs, and a rank that
  # spins in a collective (Open MPI's default with a slot per rank) would take them from the other
  # hosts' ranks, which separate machines do not share (docs/benchmarks.md, "Multi-host
  # rehearsal": it made the cooperative path with nothing exchanged 4-8% slower than sliced).
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun \
    --hostfile "$hostfile" -np $((m * k)) --map-by slot \
    --mca plm_rsh_agent "$(state)/agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca btl tcp,self --mca btl_tcp_if_include "$SUBNET.0/24" \
    --mca oob_tcp_if_include "$SUBNET.0/24" --mca mpi_yield_when_idle 1 "$@" || rc=$?
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

# Timed O_DIRECT reads of N bytes, in every HOST at once: each host reads its own file (written into
# its storage first, random bytes, fsynced), all starting at the same moment; prints one JSON line
# per host (host, bytes, seconds, bytes_per_second, and the wall-clock start and end of its read).
do_measure_storage() {
  local bytes=$((100 * 1000 * 1000)) args=() py=${PYTHON:-python3}
  while (($#)); do
    case $1 in
      --bytes) bytes=${2:?--bytes N}; shift 2 ;;
      --prefix) PREFIX=${2:?--prefix P}; shift 2 ;;
      *) args+=("$1"); shift ;;
    esac
  done
  ((${#args[@]} >= 1)) || die "measure-storage [--bytes N] HOST..."
  [[ $bytes =~ ^[0-9]+$ ]] && ((bytes >= 1048576)) || die "measure-storage: --bytes '$bytes': 1048576 or more"
  load_state
  local h i idx=() name tmp files pids=() start k rc=0
  for h in "${args[@]}"; do
    i=$(host_index "$h")
    [[ " ${idx[*]} " != *" $i "* ]] || die "measure-storage: host h$i given twice"
    idx+=("$i")
  done
  name=.measure-storage.$$
  tmp=$(mktemp -d)
  files=("$tmp")
  for i in "${idx[@]}"; do files+=("$(state)/hosts/h$i/$name"); done
  # shellcheck disable=SC2064  # the paths are fixed now
  trap "rm -rf $(printf '%q ' "${files[@]}")" EXIT
  for i in "${idx[@]}"; do
    head -c "$bytes" /dev/urandom >"$(state)/hosts/h$i/$name" ||
      die "measure-storage: cannot write $bytes bytes into host h$i's storage $(state)/hosts/h$i"
  done
  sync "${files[@]:1}"
  start=$("$py" -c 'import time; print(time.time() + 1.0)')
  for k in "${!idx[@]}"; do
    i=${idx[$k]}
    # shellcheck disable=SC2016
    "$SELF" exec --prefix "$PREFIX" "$i" "$py" -c '
import json, mmap, os, sys, time
path, start = sys.argv[1], float(sys.argv[2])
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
while time.time() < start:
    time.sleep(min(0.01, max(0.0, start - time.time())))
t0, w0, got = time.monotonic(), time.time(), 0
while True:
    n = os.readv(fd, [buf])
    if n == 0:
        break
    got += n
dt, w1 = time.monotonic() - t0, time.time()
print(json.dumps({"host": os.environ["TF_MULTIHOST_HOST"], "bytes": got, "seconds": dt,
                  "bytes_per_second": got / dt, "start": w0, "end": w1}))
' "$(state)/local/$name" "$start" >"$tmp/$k" &
    pids+=($!)
  done
  for k in "${!pids[@]}"; do
    wait "${pids[k]}" || { echo "multihost: measure-storage: the reader in h${idx[k]} failed" >&2; rc=1; }
  done
  ((rc == 0)) || exit 1
  for k in "${!idx[@]}"; do cat "$tmp/$k"; done
}

do_status() {
  while [[ ${1:-} == --prefix ]]; do PREFIX=${2:?--prefix P}; shift 2; done
  load_state
  local i
  echo "prefix=$PREFIX subnet=$SUBNET.0/24 hosts=$HOSTS rate=${RATE:-none} delay=${DELAY:-none}" \
    "bridge=$SUBNET.254 storage_rate=${STORAGE_RATE:-none}${STORAGE_RATE:+ storage_device=$STORAGE_DEV}${STORAGE_RATE:+ storage_cgroup=$STORAGE_CGROUP:$STORAGE_ROOT}"
  for ((i = 1; i <= HOSTS; i++)); do
    echo "h$i $SUBNET.$i $PREFIX-h$i $(state)/hosts/h$i${STORAGE_RATE:+ $STORAGE_ROOT/tensorferry-$PREFIX-h$i}"
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
  measure-storage) need_root; do_measure_storage "$@" ;;
  *) usage ;;
esac

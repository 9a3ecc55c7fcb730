"""The multi-host rehearsal of scripts/multihost.sh (docs/distributed.md, "Multi-host rehearsal"):
hosts as network namespaces on a shaped bridge, tensorferry-mpi across them over TCP (cooperative
equals sliced), torch.distributed (gloo) across them (cooperative equals sliced byte for byte),
the configured rate measured, the per-host storage rate (cgroup blkio/io throttling) measured, and
nothing left behind. Needs root and `ip netns`."""
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from conftest import CLI, ROOT

SCRIPT = os.path.join(ROOT, "scripts", "multihost.sh")
MPI_TOOL = os.path.join(os.path.dirname(os.path.abspath(CLI)), "tensorferry-mpi")
RATE_MBIT = 100
STORAGE_MBPS = 40  # per host, MB/s: 2 hosts at once stay far below this VM's ~900 MB/s disk


def _netns_unavailable():
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, tc)"
    try:
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    if r.returncode != 0:
        return f"`ip netns` is unavailable: {r.stderr.strip()}"
    return None


_reason = _netns_unavailable()
if _reason:
    pytest.skip(_reason, allow_module_level=True)


def _sh(*args, env=None, timeout=60, check=True):
    r = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                       env=env)
    if check:
        assert r.returncode == 0, f"multihost.sh {' '.join(args)}: rc {r.returncode}\n{r.stderr}"
    return r


def _cgroup_roots():
    """The cgroup hierarchies --storage-rate may use: v1 blkio, and the unified one."""
    roots = []
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, fstype, opts = line.split()[:4]
            if fstype == "cgroup2" or (fstype == "cgroup" and "blkio" in opts.split(",")):
                roots.append(mnt)
    return roots


def _leftovers(prefix, state_dir):
    """Everything named with `prefix` that still exists: namespaces, links, files, cgroups."""
    names = [line.split()[0] for line in
             subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=True).stdout.splitlines() if line.strip()]
    names += [line.split(": ")[1].split("@")[0] for line in
              subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                             check=True).stdout.splitlines()]
    left = [n for n in names if re.fullmatch(rf"{prefix}-(br|h\d+x?)", n)]
    left += glob.glob(f"/etc/netns/{prefix}-h*")
    left += [p for p in [os.path.join(state_dir, prefix)] if os.path.exists(p)]
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    left += [line for line in addrs.splitlines() if f"{prefix}-" in line]
    for root in _cgroup_roots():
        left += glob.glob(os.path.join(root, f"tensorferry-{prefix}-h*"))
    return left


def _prefix(letter):
    return f"tf{letter}{os.getpid() % 1000000}"


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """Two hosts at RATE_MBIT each, with a unique prefix; always torn down, and checked gone."""
    state = str(tmp_path_factory.mktemp("multihost"))
    prefix = _prefix("m")
    env = dict(os.environ, MULTIHOST_DIR=state, MULTIHOST_PREFIX=prefix)
    try:
        _sh("up", "--hosts", "2", "--rate", f"{RATE_MBIT}mbit", env=env)
        status = _sh("status", env=env).stdout.split()
        subnet = dict(kv.split("=", 1) for kv in status if "=" in kv)["subnet"]
        yield {"prefix": prefix, "env": env, "state": state,
               "ips": [subnet.replace(".0/24", f".{i}") for i in (1, 2)]}
    finally:
        _sh("down", env=env)
        assert _leftovers(prefix, state) == []


@pytest.fixture(scope="module")
def staged_checkpoint(rehearsal, tmp_path_factory):
    """The tiny preset, copied into every host's own storage; the path each host sees."""
    src = str(tmp_path_factory.mktemp("mh-tiny") / "ckpt")
    r = subprocess.run([CLI, "gen", src, "--preset", "tiny", "--no-sync"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    path = _sh("stage", src, "tiny", env=rehearsal["env"]).stdout.strip()
    total = 0
    for f in glob.glob(os.path.join(src, "*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0]
                     for k, v in header.items() if k != "__metadata__")
    return {"path": path, "src": src, "tensor_bytes": total}


def test_each_host_has_its_own_network_name_and_storage(rehearsal, staged_checkpoint):
    env, path = rehearsal["env"], staged_checkpoint["path"]
    seen = []
    for i, host in enumerate(("h1", "h2")):
        out = _sh("exec", host, "sh", "-c",
                  f'hostname; echo "$TF_MULTIHOST_IP"; ip -o -4 addr show dev eth0; '
                  f'stat -c %i {path}/model.safetensors', env=env).stdout.split("\n")
        assert out[0] == f"{rehearsal['prefix']}-h{i + 1}"
        assert out[1] == rehearsal["ips"][i]
        assert rehearsal["ips"][i] + "/24" in out[2]
        seen.append(out[3])
    assert seen[0] != seen[1], "the hosts share one copy of the checkpoint"
    assert not os.path.exists(path + "/model.safetensors"), "the local path leaks into the root"


@pytest.mark.skipif(not os.path.exists(MPI_TOOL), reason=f"{MPI_TOOL} is not built")
def test_mpi_across_hosts_cooperative_equals_sliced(rehearsal, staged_checkpoint):
    env = rehearsal["env"]
    placed = _sh("mpirun", "--ranks-per-host", "2", "--", "sh", "-c",
                 'echo "$OMPI_COMM_WORLD_RANK $(hostname)"', env=env).stdout.split("\n")
    where = dict(line.split() for line in placed if line.strip())
    p = rehearsal["prefix"]
    assert where == {"0": f"{p}-h1", "1": f"{p}-h1", "2": f"{p}-h2", "3": f"{p}-h2"}

    docs = {}
    for name, mode, extra in (("cooperative", "cooperative", ["--exchange", "all"]),
                              ("auto", "cooperative", ["--exchange", "auto"]),
                              ("sliced", "sliced", [])):
        r = _sh("mpirun", "--ranks-per-host", "2", "--", MPI_TOOL, "load",
                staged_checkpoint["path"], "--mode", mode, "--shard-rules", "builtin", "--json",
                "--checksum", *extra, env=env, timeout=120)
        docs[name] = json.loads(r.stdout)
        assert docs[name]["ranks"] == 4 and docs[name]["mode"] == mode
    coop = docs["cooperative"]["runs"][0]
    sliced = docs["sliced"]["runs"][0]
    # The cost model's choice (auto): two hosts seen, some tensors exchanged, the same slices.
    auto = docs["auto"]
    assert auto["hosts"] == 2 and auto["exchange"] == "auto"
    # Planned with the network rate the probe measured through MPI, the same on every rank and
    # at most about the shaped link's (bytes per second per host).
    assert auto["network_rate_measured"] is True
    rates = {x["measured_network_rate"] for x in auto["runs"][0]["per_rank"]}
    assert len(rates) == 1 and 0 < rates.pop() <= 1.5 * RATE_MBIT * 1e6 / 8, auto["runs"][0]
    assert all(x["measured_network_rate"] == 0 for x in coop["per_rank"])
    # The probe's time, which the plan counts (and --explain prints): agreed by every rank.
    probes = {x["probe_seconds"] for x in auto["runs"][0]["per_rank"]}
    assert len(probes) == 1 and 0 < probes.pop() < 60, auto["runs"][0]
    assert auto["probe_seconds"] > 0
    assert auto["estimate"]["chosen"]["seconds"] <= auto["estimate"]["all_local"]["seconds"]
    assert [x["checksum"] for x in auto["runs"][0]["per_rank"]] == \
        [x["checksum"] for x in sliced["per_rank"]]
    assert docs["cooperative"]["hosts"] == 2
    # Every rank ends with the same slices either way: the same bytes, and the same checksum
    # (CRC32C per tensor, combined in name order), which is also the single-process sliced load's.
    assert [x["bytes"] for x in coop["per_rank"]] == [x["bytes"] for x in sliced["per_rank"]]
    assert all(x["bytes"] > 0 for x in coop["per_rank"])
    assert [x["checksum"] for x in coop["per_rank"]] == [x["checksum"] for x in sliced["per_rank"]]
    assert len({x["checksum"] for x in coop["per_rank"]}) == 4
    for rank in range(4):
        one = subprocess.run([CLI, "load", staged_checkpoint["src"], "--tp-rank", str(rank),
                              "--tp-size", "4", "--json"], capture_output=True, text=True,
                             timeout=60)
        assert one.returncode == 0, one.stderr
        assert json.loads(one.stdout)["checksum"] == coop["per_rank"][rank]["checksum"], rank
    # Cooperative: every byte read once, by one rank, and the slices travelled between ranks.
    assert coop["bytes_read_total"] == staged_checkpoint["tensor_bytes"]
    sent = sum(x["bytes_sent"] for x in coop["per_rank"])
    assert sent == sum(x["bytes_received"] for x in coop["per_rank"]) > 0
    # Sliced: every rank read its own slices, nothing exchanged.
    assert all(x["bytes_read"] == x["bytes"] and x["bytes_sent"] == x["bytes_received"] == 0
               for x in sliced["per_rank"])


def test_gloo_across_hosts(rehearsal, staged_checkpoint, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    env = rehearsal["env"]
    worker = os.path.join(ROOT, "tests", "python", "multihost_gloo_worker.py")
    port = str(29500 + os.getpid() % 1000)
    procs = []
    for rank, host in enumerate(("h1", "h2")):
        procs.append(subprocess.Popen(
            [SCRIPT, "exec", host, sys.executable, worker, str(rank), "2", rehearsal["ips"][0],
             port, staged_checkpoint["path"], str(tmp_path / f"rank{rank}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [x["all_reduce"] for x in results] == [3, 3]
    assert [x["host_ip"] for x in results] == rehearsal["ips"]
    assert [x["hostname"] for x in results] == [f"{rehearsal['prefix']}-h{i}" for i in (1, 2)]
    for exchange in ("all", "auto"):
        got = [x[exchange] for x in results]
        assert all(x["hosts"] == 2 for x in got), got
        assert sum(x["bytes_sent"] for x in got) == sum(x["bytes_received"] for x in got) > 0
        assert got[0]["tensors"] == got[1]["tensors"] > 0
    # Every tensor exchanged: each byte read once in all; the model's choice keeps some local.
    assert all(x["all"]["bytes_read_all_ranks"] == staged_checkpoint["tensor_bytes"]
               for x in results)
    assert all(x["all"]["local_tensors"] == 0 for x in results)
    assert all(x["auto"]["local_tensors"] > 0 for x in results)
    # auto plans with the rate the probe measured over gloo (the same on both ranks, near the
    # shaped link's; exchanging all measures nothing); the fixed choice measures nothing.
    rates = [x["auto"]["measured_network_rate"] for x in results]
    assert rates[0] == rates[1] and 0 < rates[0] <= 1.5 * RATE_MBIT * 1e6 / 8, rates
    assert [x["all"]["measured_network_rate"] for x in results] == [0, 0]
    # The probe's time, which the plan counts: the slowest rank's, agreed by both.
    probe = [x["auto"]["probe_seconds"] for x in results]
    assert probe[0] == probe[1] and 0 < probe[0] < 60, probe
    assert [x["all"]["probe_seconds"] for x in results] == [0, 0]


def test_shaped_rate_is_the_configured_rate(rehearsal):
    env = rehearsal["env"]
    for src, dst in (("h1", "h2"), ("h2", "h1")):
        r = _sh("measure", "--bytes", str(6 * 1000 * 1000), src, dst, env=env)
        got = json.loads(r.stdout)
        assert got["bytes"] == 6 * 1000 * 1000
        mbit = got["bits_per_second"] / 1e6
        assert 0.8 * RATE_MBIT <= mbit <= 1.2 * RATE_MBIT, (src, dst, got)


def test_up_down_idempotent_delay_and_nothing_left(tmp_path):
    state = str(tmp_path)
    prefix = _prefix("i")
    env = dict(os.environ, MULTIHOST_DIR=state, MULTIHOST_PREFIX=prefix)
    try:
        _sh("down", env=env)  # absent: a no-op
        _sh("up", "--hosts", "3", env=env)
        first = _sh("status", env=env).stdout
        _sh("up", "--hosts", "2", "--rate", "1gbit", env=env)  # up again: re-created
        again = _sh("status", env=env).stdout
        assert "hosts=2" in again and "rate=1gbit" in again and "hosts=3" in first
        assert not any(n.endswith("-h3") for n in _leftovers(prefix, state))
        # A delay needs sch_netem: either it is there and the round trip shows it, or `up` says
        # so and leaves nothing behind.
        r = _sh("up", "--hosts", "2", "--delay", "20ms", env=env, check=False)
        if r.returncode != 0:
            assert "sch_netem" in r.stderr, r.stderr
            assert _leftovers(prefix, state) == []
        else:
            ip2 = _sh("status", env=env).stdout.split("\n")[2].split()[1]
            t0 = time.monotonic()
            _sh("exec", "h1", sys.executable, "-c",
                "import socket,sys\nfor _ in range(3):\n"
                f"    try: socket.create_connection(('{ip2}', 9), timeout=5)\n"
                "    except ConnectionRefusedError: pass", env=env)
            # Three refused connects: three round trips of 2 x 20 ms at least.
            assert time.monotonic() - t0 >= 0.12
    finally:
        _sh("down", env=env)
        _sh("down", env=env)  # twice: a no-op
    assert _leftovers(prefix, state) == []


@pytest.fixture(scope="module")
def storage_rehearsal():
    """Two hosts reading at most STORAGE_MBPS each, state on a disk (/var/tmp: /tmp may be a tmpfs,
    which no block throttle sees); torn down, and checked gone."""
    state = tempfile.mkdtemp(prefix="tf-multihost-", dir="/var/tmp")
    prefix = _prefix("s")
    env = dict(os.environ, MULTIHOST_DIR=state, MULTIHOST_PREFIX=prefix)
    try:
        r = _sh("up", "--hosts", "2", "--storage-rate", f"{STORAGE_MBPS}mbps", env=env,
                check=False)
        if r.returncode != 0:
            # Only a machine without a block throttle may refuse, saying so, and leaving nothing.
            assert "no cgroup controller to throttle reads" in r.stderr, r.stderr
            assert _leftovers(prefix, state) == []
            pytest.skip(r.stderr.strip())
        yield {"prefix": prefix, "env": env, "state": state}
    finally:
        _sh("down", env=env)
        assert _leftovers(prefix, state) == []
        shutil.rmtree(state)


def _measure_storage(env, hosts, nbytes):
    r = _sh("measure-storage", "--bytes", str(nbytes), *hosts, env=env, timeout=60)
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert [g["host"] for g in got] == list(hosts)
    assert all(g["bytes"] == nbytes for g in got), got
    return got


def test_storage_rate_one_host(storage_rehearsal):
    env, p = storage_rehearsal["env"], storage_rehearsal["prefix"]
    status = _sh("status", env=env).stdout.splitlines()
    assert f"storage_rate={STORAGE_MBPS}mbps" in status[0].split()
    for i in (1, 2):
        cg = status[i].split()[4]
        assert os.path.basename(cg) == f"tensorferry-{p}-h{i}" and os.path.isdir(cg)
    # A command in a host is in that host's cgroup.
    cgroups = _sh("exec", "h2", "cat", "/proc/self/cgroup", env=env).stdout
    assert f"/tensorferry-{p}-h2\n" in cgroups, cgroups
    (one,) = _measure_storage(env, ["h1"], 48 * 1000 * 1000)
    mbps = one["bytes_per_second"] / 1e6
    assert 0.8 * STORAGE_MBPS <= mbps <= 1.2 * STORAGE_MBPS, one


def test_storage_rate_two_hosts_at_once_each_its_own(storage_rehearsal):
    got = _measure_storage(storage_rehearsal["env"], ["h1", "h2"], 48 * 1000 * 1000)
    for g in got:
        mbps = g["bytes_per_second"] / 1e6
        assert 0.8 * STORAGE_MBPS <= mbps <= 1.2 * STORAGE_MBPS, got
    # The two reads ran at the same time (each over most of the other's): the rate is per host,
    # not shared.
    overlap = min(g["end"] for g in got) - max(g["start"] for g in got)
    assert overlap >= 0.8 * max(g["seconds"] for g in got), got


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (Open MPI) is not installed")
def test_storage_rate_mpi_ranks_are_in_their_hosts_cgroup(storage_rehearsal):
    out = _sh("mpirun", "--ranks-per-host", "2", "--", "sh", "-c",
              'echo "$OMPI_COMM_WORLD_RANK" $(cat /proc/self/cgroup)',  # one line a rank
              env=storage_rehearsal["env"], timeout=60).stdout
    p = storage_rehearsal["prefix"]
    where = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert sorted(where) == ["0", "1", "2", "3"], out
    for rank, line in where.items():
        assert f"/tensorferry-{p}-h{int(rank) // 2 + 1}" in line, out


def test_storage_rate_down_ends_processes_and_refusals_leave_nothing(tmp_path):
    state = tempfile.mkdtemp(prefix="tf-multihost-", dir="/var/tmp")
    prefix = _prefix("r")
    env = dict(os.environ, MULTIHOST_DIR=state, MULTIHOST_PREFIX=prefix)
    sleeper = None
    try:
        r = _sh("up", "--hosts", "2", "--storage-rate", "800mbit", env=env, check=False)
        if r.returncode != 0:
            assert "no cgroup controller to throttle reads" in r.stderr, r.stderr
            pytest.skip(r.stderr.strip())
        # A process that ignores SIGTERM, in h1's cgroup: `up` again (without a storage rate)
        # ends it and removes the cgroups.
        sleeper = subprocess.Popen([SCRIPT, "exec", "h1", "sh", "-c", "trap '' TERM; sleep 60"],
                                   env=env)
        cg = [g for g in (os.path.join(root, f"tensorferry-{prefix}-h1")
                          for root in _cgroup_roots()) if os.path.isdir(g)]
        assert len(cg) == 1
        deadline = time.monotonic() + 10
        while not open(os.path.join(cg[0], "cgroup.procs")).read().strip():
            assert time.monotonic() < deadline, "the process never joined the cgroup"
            time.sleep(0.05)
        _sh("up", "--hosts", "2", env=env, timeout=60)
        assert sleeper.wait(timeout=10) != 0
        assert "storage_rate=none" in _sh("status", env=env).stdout
        assert not [n for n in _leftovers(prefix, state) if "tensorferry-" in n]
        _sh("down", env=env)
        assert _leftovers(prefix, state) == []
        # Refusals, before anything is created: a unit that is not tc's, a rate of 0, a state
        # directory on a tmpfs, and no controller (every cgroup hierarchy unmounted in a private
        # mount namespace).
        for rate, want in (("50MB", "unknown unit 'mb'"), ("0mbps", "must be above 0")):
            r = _sh("up", "--hosts", "2", "--storage-rate", rate, env=env, check=False)
            assert r.returncode != 0 and want in r.stderr, r.stderr
        tmpfs = str(tmp_path / "tmpfs")
        os.mkdir(tmpfs)
        script = (f"mount -t tmpfs tf-multihost-test {tmpfs} && "
                  f"MULTIHOST_DIR={tmpfs} {SCRIPT} up --hosts 2 --storage-rate 50mbps")
        r = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode != 0, r.stderr
        assert "is on tmpfs" in r.stderr and "not on a block device" in r.stderr, r.stderr
        script = ("findmnt -rn -t cgroup,cgroup2 -o TARGET | while read -r m; do umount -l \"$m\"; "
                  f"done; {SCRIPT} up --hosts 2 --storage-rate 50mbps")
        r = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode != 0 and "no cgroup controller to throttle reads" in r.stderr, r.stderr
        assert _leftovers(prefix, state) == []
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
        _sh("down", env=env)
        shutil.rmtree(state, ignore_errors=True)
    assert _leftovers(prefix, state) == []


# --- faults across hosts (issue 17, part 3) ---------------------------------------------------


@pytest.fixture(scope="module")
def fault_rehearsal(tmp_path_factory):
    """Two hosts whose storage reads run at 4 MB/s each, with a ~50 MB checkpoint staged, so that
    a cold cooperative load lasts several seconds: time to kill a rank or cut a link mid-load."""
    if not os.path.exists(MPI_TOOL) or shutil.which("mpirun") is None:
        pytest.skip("tensorferry-mpi or mpirun is missing")
    state = tempfile.mkdtemp(prefix="tf-multihost-", dir="/var/tmp")
    prefix = _prefix("f")
    env = dict(os.environ, MULTIHOST_DIR=state, MULTIHOST_PREFIX=prefix)
    try:
        r = _sh("up", "--hosts", "2", "--storage-rate", "4mbps", env=env, check=False)
        if r.returncode != 0:
            assert "no cgroup controller to throttle reads" in r.stderr, r.stderr
            pytest.skip(r.stderr.strip())
        src = os.path.join(state, "src")
        g = subprocess.run([CLI, "gen", src, "--preset", "tiny", "--layers", "4", "--hidden",
                            "512", "--intermediate", "2048", "--vocab", "8000", "--no-sync"],
                           capture_output=True, text=True, timeout=120)
        assert g.returncode == 0, g.stderr
        path = _sh("stage", src, "ckpt", env=env).stdout.strip()
        status = _sh("status", env=env).stdout.splitlines()
        cgroups = {f"h{i}": status[i].split()[4] for i in (1, 2)}
        yield {"prefix": prefix, "env": env, "path": path, "cgroups": cgroups}
    finally:
        _sh("down", env=env)
        assert _leftovers(prefix, state) == []
        shutil.rmtree(state)


def _ranks_in(cgroup):
    """PIDs of tensorferry-mpi processes in a host's cgroup."""
    pids = []
    with open(os.path.join(cgroup, "cgroup.procs")) as f:
        for pid in f.read().split():
            try:
                with open(f"/proc/{pid}/comm") as c:
                    if c.read().strip() == "tensorferry-mpi":
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


class _Job:
    """mpirun in the background, its output (stdout and stderr) collected line by line."""

    def __init__(self, cmd, env):
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env)
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line)

    def output(self):
        return "".join(self.lines)

    def wait(self, timeout):
        """The exit status, or None if still running after `timeout` seconds."""
        try:
            rc = self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(timeout=10)
        return rc

    def kill(self):
        self.p.kill()
        self.p.wait()
        self._reader.join(timeout=10)


def _start_cooperative_load(rehearsal, *extra):
    """mpirun of three cold, O_DIRECT cooperative loads (2 ranks per host) in the background;
    returns once the first has ended, so that a fault comes in the middle of the second."""
    cmd = [SCRIPT, "mpirun", "--ranks-per-host", "2", "--", MPI_TOOL, "load", rehearsal["path"],
           "--mode", "cooperative", "--exchange", "all", "--direct", "on", "--cold", "--budget",
           "4MB", "--repeat", "3", *extra]
    job = _Job(cmd, rehearsal["env"])
    deadline = time.monotonic() + 60
    while not any(line.startswith("run 1:") for line in job.lines):
        if time.monotonic() > deadline or job.p.poll() is not None:
            job.kill()
            pytest.fail("the first load did not end: " + job.output())
        time.sleep(0.05)
    time.sleep(1.0)  # inside the second load's reads
    assert job.p.poll() is None and not any(line.startswith("run 2:") for line in job.lines), \
        "the second load ended before the fault: " + job.output()
    return job


def test_a_killed_rank_ends_every_rank_within_30s(fault_rehearsal):
    job = _start_cooperative_load(fault_rehearsal)
    victim = _ranks_in(fault_rehearsal["cgroups"]["h2"])[0]
    os.kill(victim, 9)
    killed_at = time.monotonic()
    rc = job.wait(timeout=30)
    took = time.monotonic() - killed_at
    if rc is None:
        job.kill()
        pytest.fail("the job outlived a killed rank by 30 s: " + job.output())
    out = job.output()
    assert rc != 0 and took < 30, out
    for cg in fault_rehearsal["cgroups"].values():
        assert _ranks_in(cg) == [], "a rank outlived the job"
    # The launcher names the dead rank and how it died.
    assert re.search(r"rank \d+ .*(signal 9|Killed)|(signal 9|Killed).*rank \d+", out, re.S), out


def test_a_link_down_ends_every_rank_with_the_timeout(fault_rehearsal):
    prefix = fault_rehearsal["prefix"]
    job = _start_cooperative_load(fault_rehearsal, "--timeout-ms", "6000")
    subprocess.run(["ip", "netns", "exec", f"{prefix}-h2", "ip", "link", "set", "eth0", "down"],
                   check=True)
    cut_at = time.monotonic()
    try:
        # Every rank gives up by itself: the ones that wait on the cut host time out.
        while time.monotonic() - cut_at < 30:
            if not any(_ranks_in(cg) for cg in fault_rehearsal["cgroups"].values()):
                break
            time.sleep(0.2)
        left = {h: _ranks_in(cg) for h, cg in fault_rehearsal["cgroups"].items()}
        took = time.monotonic() - cut_at
    finally:
        subprocess.run(["ip", "netns", "exec", f"{prefix}-h2", "ip", "link", "set", "eth0", "up"],
                       check=True)
    rc = job.wait(timeout=60)
    if rc is None:
        job.kill()
    out = job.output()
    assert left == {"h1": [], "h2": []}, f"ranks alive 30 s after the link went down: {left}\n{out}"
    assert took < 30
    assert rc != 0, out
    assert not any(line.startswith("run 2:") for line in job.lines), out
    # The error names the rank that gave up and the step it waited in.
    assert re.search(r"rank \d+: io_error: (cooperative load|tensorferry-mpi): rank \d+ waited "
                     r"6 s in (round \d+ of \d+|the (start|end)|repetition 2)", out), out


def _gloo_fault_job(rehearsal, tmp_path):
    """Rank 0 on h1 and rank 1 on h2 loading cooperatively over gloo again and again (see
    multihost_gloo_worker.py --fault); returns the two processes once both have completed a
    load."""
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    worker = os.path.join(ROOT, "tests", "python", "multihost_gloo_worker.py")
    status = _sh("status", env=rehearsal["env"]).stdout.split()
    subnet = dict(kv.split("=", 1) for kv in status if "=" in kv)["subnet"]
    port = str(30500 + os.getpid() % 1000)
    procs = [subprocess.Popen(
        [SCRIPT, "exec", host, sys.executable, worker, str(rank), "2",
         subnet.replace(".0/24", ".1"), port, rehearsal["path"], str(tmp_path / f"rank{rank}.json"),
         "--fault"], env=rehearsal["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for rank, host in enumerate(("h1", "h2"))]
    # A bound for a hang, not a speed: two Python processes importing torch and joining gloo
    # beside the rest of the suite have taken over 60 s on a loaded 2-vCPU VM.
    deadline = time.monotonic() + 150
    while not all((tmp_path / f"rank{r}.json.loads").exists() for r in (0, 1)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            outcomes = [(tmp_path / f"rank{r}.json") for r in (0, 1)]
            pytest.fail("the gloo loads did not start: " +
                        "\n".join(p.communicate()[0] for p in procs) + "\n" +
                        "\n".join(f"rank {r}: {o.read_text()}" for r, o in enumerate(outcomes)
                                  if o.exists()))
        time.sleep(0.1)
    time.sleep(1.0)  # inside a load
    return procs


def _gloo_outcome(procs, tmp_path, rank):
    try:
        out = procs[rank].communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"gloo rank {rank} still waits 30 s after the fault")
    with open(tmp_path / f"rank{rank}.json") as f:
        return json.load(f), out


def _pythons_in(cgroup):
    pids = []
    with open(os.path.join(cgroup, "cgroup.procs")) as f:
        for pid in f.read().split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    if b"multihost_gloo_worker.py" in c.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


def test_gloo_a_killed_rank_ends_the_other(fault_rehearsal, tmp_path):
    procs = _gloo_fault_job(fault_rehearsal, tmp_path)
    for pid in _pythons_in(fault_rehearsal["cgroups"]["h2"]):
        os.kill(pid, 9)
    killed_at = time.monotonic()
    outcome, out = _gloo_outcome(procs, tmp_path, 0)
    procs[1].communicate(timeout=30)
    assert time.monotonic() - killed_at < 30
    assert outcome["type"] == "OSError", (outcome, out)
    # In a round, or in the host all-gather or the network probe that start every load (the kill
    # may fall between).
    assert re.search(r"cooperative load: rank 0 gave up in (round|the start|the end|the network "
                     r"probe)",
                     outcome["error"]), (outcome, out)


def test_gloo_a_link_down_ends_every_rank_with_the_timeout(fault_rehearsal, tmp_path):
    prefix = fault_rehearsal["prefix"]
    procs = _gloo_fault_job(fault_rehearsal, tmp_path)
    subprocess.run(["ip", "netns", "exec", f"{prefix}-h2", "ip", "link", "set", "eth0", "down"],
                   check=True)
    cut_at = time.monotonic()
    try:
        outcomes = [_gloo_outcome(procs, tmp_path, r) for r in (0, 1)]
        took = time.monotonic() - cut_at
    finally:
        subprocess.run(["ip", "netns", "exec", f"{prefix}-h2", "ip", "link", "set", "eth0", "up"],
                       check=True)
    assert took < 30
    for rank, (outcome, out) in enumerate(outcomes):
        assert outcome["type"] == "OSError", (outcome, out)
        assert re.search(rf"cooperative load: rank {rank} gave up in (round|the start|the end|"
                         r"the network probe)",
                         outcome["error"]), outcome

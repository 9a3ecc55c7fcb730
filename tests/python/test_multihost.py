"""The multi-host rehearsal of scripts/multihost.sh (docs/distributed.md, "Multi-host rehearsal"):
hosts as network namespaces on a shaped bridge, tensorferry-mpi across them over TCP (cooperative
equals sliced), torch.distributed (gloo) across them (cooperative equals sliced byte for byte),
the configured rate measured, and nothing left behind. Needs root and `ip netns`."""
import glob
import json
import os
import re
import struct
import subprocess
import sys
import time

import pytest

from conftest import CLI, ROOT

SCRIPT = os.path.join(ROOT, "scripts", "multihost.sh")
MPI_TOOL = os.path.join(os.path.dirname(os.path.abspath(CLI)), "tensorferry-mpi")
RATE_MBIT = 100


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


def _leftovers(prefix, state_dir):
    """Everything named with `prefix` that still exists: namespaces, links, files."""
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
    for mode in ("cooperative", "sliced"):
        r = _sh("mpirun", "--ranks-per-host", "2", "--", MPI_TOOL, "load",
                staged_checkpoint["path"], "--mode", mode, "--shard-rules", "builtin", "--json",
                "--checksum", env=env, timeout=120)
        docs[mode] = json.loads(r.stdout)
        assert docs[mode]["ranks"] == 4 and docs[mode]["mode"] == mode
    coop = docs["cooperative"]["runs"][0]
    sliced = docs["sliced"]["runs"][0]
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
    assert all(x["bytes_read_all_ranks"] == staged_checkpoint["tensor_bytes"] for x in results)
    assert sum(x["bytes_sent"] for x in results) == sum(x["bytes_received"] for x in results) > 0
    assert results[0]["tensors"] == results[1]["tensors"] > 0


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

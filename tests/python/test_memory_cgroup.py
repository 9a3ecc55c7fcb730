"""Loads inside a real memory cgroup (issue 15, "Memory the container actually has"): a checkpoint
four times larger than the cgroup's limit. Without a budget, the streaming loader (the CLI, and
Loader.iter_batches) completes byte-exact under a budget sized from the limit; a whole load
(Loader.load) fails before reading with an error naming the limit and suggesting a budget;
nothing is OOM-killed. The control shows what that prevents: the same whole load with the check
off is killed by the kernel's OOM killer.

The scale: a 1 GiB checkpoint in a 256 MiB cgroup by default (TENSORFERRY_CGROUP_TEST_GIB=4 runs
the issue's 4 GB in 1 GB). Needs root and a writable memory controller (cgroup v1's
/sys/fs/cgroup/memory, or cgroup v2 with the memory controller enabled for children).
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import tensorferry
import tensorferry.numpy

GIB = int(os.environ.get("TENSORFERRY_CGROUP_TEST_GIB", "1"))
LIMIT = GIB * (256 << 20)
TENSOR = 32 << 20


def _v1_root():
    root = "/sys/fs/cgroup/memory"
    return root if os.path.exists(os.path.join(root, "memory.limit_in_bytes")) else None


def _v2_root():
    for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        controllers = os.path.join(root, "cgroup.subtree_control")
        if os.path.exists(controllers) and "memory" in open(controllers).read().split():
            return root
    return None


class Cgroup:
    """A memory cgroup of its own with a limit; processes started through run() live in it."""

    def __init__(self, limit):
        self.v1 = _v1_root()
        root = self.v1 or _v2_root()
        self.path = os.path.join(root, f"tensorferry-test-{os.getpid()}")
        os.mkdir(self.path)
        limit_file = "memory.limit_in_bytes" if self.v1 else "memory.max"
        with open(os.path.join(self.path, limit_file), "w") as f:
            f.write(str(limit))
        if not self.v1:
            with open(os.path.join(self.path, "memory.swap.max"), "w") as f:
                f.write("0")

    def oom_kills(self):
        name = "memory.oom_control" if self.v1 else "memory.events"
        with open(os.path.join(self.path, name)) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def run(self, cmd, **kwargs):
        procs = os.path.join(self.path, "cgroup.procs")
        return subprocess.run(["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd],
                              capture_output=True, text=True, timeout=600, **kwargs)

    def remove(self):
        os.rmdir(self.path)


@pytest.fixture(scope="module")
def cgroup():
    if os.geteuid() != 0:
        pytest.skip("needs root to make a memory cgroup")
    if not (_v1_root() or _v2_root()):
        pytest.skip("no writable memory cgroup controller on this machine")
    group = Cgroup(LIMIT)
    yield group
    group.remove()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """4x the limit, in two shards of 32 MiB tensors with distinct bytes; with its digest."""
    d = tmp_path_factory.mktemp("cgroup-ckpt")
    count = 4 * LIMIT // TENSOR
    digest = hashlib.sha256()
    for shard in range(2):
        tensors = {}
        for i in range(shard * count // 2, (shard + 1) * count // 2):
            t = (np.arange(TENSOR // 4, dtype=np.uint32) * 2654435761 + i).astype(np.uint32)
            tensors[f"layers.{i:03d}.weight"] = t
        tensorferry.numpy.save_file(tensors, str(d / f"model-{shard + 1:05d}-of-00002.safetensors"))
        del tensors
    names = {f"layers.{i:03d}.weight": f"model-{1 + (i >= count // 2):05d}-of-00002.safetensors"
             for i in range(count)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    for i in range(count):
        t = (np.arange(TENSOR // 4, dtype=np.uint32) * 2654435761 + i).astype(np.uint32)
        digest.update(t.tobytes())
    yield str(d), digest.hexdigest()
    shutil.rmtree(d, ignore_errors=True)  # 1 GiB: not kept on disk for the rest of the session


def _cli():
    return os.environ["TENSORFERRY_CLI"]


CHILD = r"""
import hashlib, sys
import tensorferry
path, mode = sys.argv[1], sys.argv[2]
digest = hashlib.sha256()
if mode == "stream":
    loader = tensorferry.Loader(path, engine="pread", framework="np")
    for batch in loader.iter_batches():
        tensors = batch.tensors
        del batch
        for name in sorted(tensors):
            digest.update(tensors[name].tobytes())
        del tensors
    print(digest.hexdigest(), loader.stats.memory_budget)
elif mode == "whole":
    try:
        tensorferry.Loader(path, engine="pread", framework="np").load()
    except tensorferry.BudgetExceededError as e:
        print(e)
        sys.exit(3)
    sys.exit(0)
else:  # the check off: nothing stops the process from allocating past the limit
    tensorferry.Loader(path, engine="pread", framework="np", memory_limit="off").load()
"""


def test_the_streaming_cli_completes_byte_exact_within_the_limit(cgroup, checkpoint):
    path, _ = checkpoint
    outside = subprocess.run([_cli(), "load", path, "--engine", "pread", "--memory-limit", "off",
                              "--json"], capture_output=True, text=True, check=True)
    want = json.loads(outside.stdout)["checksum"]
    kills = cgroup.oom_kills()
    got = cgroup.run([_cli(), "load", path, "--engine", "pread", "--json"])
    assert got.returncode == 0, got.stderr
    report = json.loads(got.stdout)
    assert report["checksum"] == want
    assert "memory cgroup" in report["memory_budget"], report["memory_budget"]
    assert report["batches"] > 1
    assert report["peak_rss_bytes"] < LIMIT
    assert cgroup.oom_kills() == kills


def test_iter_batches_completes_and_load_fails_naming_the_limit(cgroup, checkpoint):
    path, digest = checkpoint
    kills = cgroup.oom_kills()
    streamed = cgroup.run([sys.executable, "-c", CHILD, path, "stream"])
    assert streamed.returncode == 0, streamed.stderr
    got, note = streamed.stdout.split(" ", 1)
    assert got == digest
    assert "memory cgroup" in note, note
    whole = cgroup.run([sys.executable, "-c", CHILD, path, "whole"])
    assert whole.returncode == 3, (whole.returncode, whole.stdout, whole.stderr)
    limit_file = "memory.limit_in_bytes" if cgroup.v1 else "memory.max"
    assert "exceed the host memory limit of" in whole.stdout, whole.stdout
    assert os.path.join(cgroup.path, limit_file) in whole.stdout, whole.stdout
    assert "--budget" in whole.stdout
    assert cgroup.oom_kills() == kills


def test_without_the_check_the_kernel_kills_the_load(cgroup, checkpoint):
    path, _ = checkpoint
    kills = cgroup.oom_kills()
    off = cgroup.run([sys.executable, "-c", CHILD, path, "off"])
    assert off.returncode == -signal.SIGKILL, (off.returncode, off.stderr[-500:])
    assert cgroup.oom_kills() > kills

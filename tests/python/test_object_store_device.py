"""Object storage to a CUDA device: s3:// checkpoints through the staging ring of the device
pipeline (docs/object_storage.md, docs/gpu.md), against SeaweedFS and the fake CUDA runtime of the
C++ tests (selected per child process with TENSORFERRY_CUDA_RUNTIME). The CLI's checksum of device
tensors is computed on their copy back to the host, so equal checksums mean equal bytes."""
import json
import os
import subprocess

import pytest

from conftest import CLI, ROOT

FAKE = os.environ.get("TENSORFERRY_FAKE_CUDA") or os.path.join(
    ROOT, "build", "release", "lib", "libtensorferry_fake_cudart.so")
needs_fake = pytest.mark.skipif(not os.path.exists(FAKE),
                                reason=f"fake CUDA runtime not built ({FAKE})")


def _load(path, *flags, env=None):
    r = subprocess.run([CLI, "load", path, "--json", *flags], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def remote_tiny(seaweed, tiny_checkpoint):
    prefix = "device-tests/tiny"
    seaweed.upload_dir(seaweed.BUCKET, prefix, tiny_checkpoint)
    env = dict(os.environ, **seaweed.env(), TENSORFERRY_CUDA_RUNTIME=FAKE,
               TENSORFERRY_CUFILE_LIBRARY=FAKE)
    return seaweed.url(prefix + "/"), env


@needs_fake
@pytest.mark.parametrize("flags", [[], ["--budget", "64KB", "--device-budget", "64KB"],
                                   ["--staging-bytes", "64KiB", "--staging-slot", "16KiB"]])
def test_s3_to_device_matches_local_host_load(remote_tiny, tiny_checkpoint, flags):
    url, env = remote_tiny
    want = _load(tiny_checkpoint)
    got = _load(url, "--device", "cuda:0", *flags, env=env)
    assert got["checksum"] == want["checksum"]
    assert got["device_tensors"] == want["tensors"]
    assert got["device_bytes"] == want["bytes"]
    assert got["staged_bytes"] >= want["bytes"]  # through the staging ring: no descriptor, no GDS
    assert got["gds_bytes"] == 0
    assert got["remote_requests"] > 0 and got["remote_bytes"] == got["bytes_read"]


@needs_fake
@pytest.mark.parametrize("rank", [0, 1])
def test_s3_tensor_parallel_rank_to_device(remote_tiny, tiny_checkpoint, rank):
    url, env = remote_tiny
    tp = ["--tp-rank", str(rank), "--tp-size", "2"]
    want = _load(tiny_checkpoint, *tp)
    got = _load(url, "--device", "cuda:0", *tp, env=env)
    assert got["checksum"] == want["checksum"]
    assert got["bytes"] == want["bytes"]
    assert got["remote_bytes"] == got["bytes_read"]

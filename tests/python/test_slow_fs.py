"""Files on a slow file system (issue 15, "Filesystem-aware reads"), through a real FUSE mount:
tf_slowfs (bench/slowfs/slowfs.cc), a passthrough that waits in every request as a network share
does. tensorferry's defaults never map such files (each page fault would wait for the daemon):
the automatic engine reads them with many large reads in flight, says so in stats and in the
CLI's --explain and --json, and an explicit engine still wins. Bytes are the same either way.
An overlay whose lower layer is that mount counts as the mount's file system.

Needs /dev/fuse, root (mounting) and build/release/bin/tf_slowfs (libfuse3-dev).
"""
import contextlib
import json
import os
import struct
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch

import tensorferry
import tensorferry.numpy
import tensorferry.torch
from conftest import CLI

SLOWFS = os.path.join(os.path.dirname(CLI), "tf_slowfs")

pytestmark = pytest.mark.skipif(
    not (os.path.exists("/dev/fuse") and os.path.exists(SLOWFS) and os.geteuid() == 0
         and shutil.which("fusermount3")),
    reason="needs /dev/fuse, root, fusermount3 and tf_slowfs (libfuse3-dev)")


def _mounted(path):
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A two-file sharded checkpoint and a single file, written by tensorferry (numpy arrays)."""
    root = tmp_path_factory.mktemp("slowfs-src")
    rng = np.random.default_rng(7)
    tensors = {f"layers.{i}.w": rng.standard_normal((256, 512), dtype=np.float32)
               for i in range(6)}
    tensors["embed"] = rng.integers(0, 255, (1000, 64), dtype=np.uint8)
    # Larger than a read chunk (8 MiB) and than a FUSE request (1 MiB): several reads in flight.
    tensors["big"] = rng.integers(0, 255, (20 << 20) + 4096 + 7, dtype=np.uint8)
    tensorferry.numpy.save_file(tensors, str(root / "single.safetensors"))
    sharded = root / "sharded"
    sharded.mkdir()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[:4],
              "model-00002-of-00002.safetensors": names[4:]}
    weight_map = {}
    for file, part in halves.items():
        tensorferry.numpy.save_file({n: tensors[n] for n in part}, str(sharded / file))
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root, tensors


@contextlib.contextmanager
def _slowfs(root, mnt, *options):
    """tf_slowfs of `root` mounted at `mnt` while the block runs."""
    proc = subprocess.Popen([SLOWFS, str(root), mnt, "--latency-us=200", *options, "-f",
                             "-o", "max_threads=32"], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while not _mounted(mnt):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"tf_slowfs did not mount: {proc.stderr.read().decode()}")
        time.sleep(0.05)
    try:
        yield mnt
    finally:
        subprocess.run(["fusermount3", "-u", mnt], check=False)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def mount(source, tmp_path_factory):
    root, _ = source
    with _slowfs(root, str(tmp_path_factory.mktemp("slowfs-mnt"))) as mnt:
        yield mnt


def _same(loaded, want):
    assert sorted(loaded) == sorted(want)
    for name, t in loaded.items():
        got = t.numpy() if isinstance(t, torch.Tensor) else t
        assert got.dtype == want[name].dtype and np.array_equal(got, want[name]), name


def test_the_default_reads_files_on_fuse_and_says_why(source, mount):
    _, want = source
    with tensorferry.Loader(os.path.join(mount, "sharded"), framework="np") as loader:
        info = loader.engine_info
        assert info["filesystem"] == "fuse.tf_slowfs"
        assert info["engine"] in ("io_uring", "pread")
        assert "fuse.tf_slowfs (user space)" in info["engine_reason"]
        assert "in flight" in info["engine_reason"]
        _same(loader.load(), want)
        stats = loader.stats
        assert stats.engine == info["engine"] and stats.filesystem == "fuse.tf_slowfs"
        assert stats.engine_reason == info["engine_reason"]
    # On a local file system the same default maps the files.
    root, _ = source
    with tensorferry.Loader(str(root / "sharded"), framework="np") as loader:
        assert loader.engine_info["engine"] == "mmap"
        assert loader.engine_info["engine_reason"].startswith("local file system")
        assert loader.engine_info["filesystem"] not in ("", "fuse.tf_slowfs")


def test_safetensors_api_defaults_read_and_an_explicit_mmap_still_maps(source, mount):
    _, want = source
    path = os.path.join(mount, "single.safetensors")
    _same(tensorferry.torch.load_file(path), want)
    _same(tensorferry.torch.load_file(path, backend="mmap"), want)
    with tensorferry.Loader(path, engine="mmap", framework="np") as loader:
        info = loader.engine_info
        assert info["engine"] == "mmap"
        assert info["engine_reason"].startswith("set by the caller")
        assert "page faults there are slow" in info["engine_reason"]
        _same(loader.load(), want)
    with tensorferry.torch.safe_open(path, framework="pt") as f:
        for name in f.keys():
            assert np.array_equal(f.get_tensor(name).numpy(), want[name])
            assert np.array_equal(f.get_slice(name)[1:3].numpy(), want[name][1:3])


def test_cli_explain_and_json_report_the_choice(mount):
    path = os.path.join(mount, "sharded")
    r = subprocess.run([CLI, "load", path, "--explain"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("engine io_uring: ") or first.startswith("engine pread: "), first
    assert "file system: fuse.tf_slowfs" in first
    r = subprocess.run([CLI, "load", path, "--json", "--engine", "mmap", "--populate"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["engine"] == "mmap" and stats["filesystem"] == "fuse.tf_slowfs"
    assert stats["engine_reason"].startswith("set by the caller")


def test_an_overlay_on_the_mount_counts_as_fuse(source, mount, tmp_path):
    _, want = source
    upper, work, merged = (tmp_path / d for d in ("upper", "work", "merged"))
    for d in (upper, work, merged):
        d.mkdir()
    r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={mount},upperdir={upper},workdir={work}", str(merged)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"overlay over FUSE not mountable here: {r.stderr.strip()}")
    try:
        with tensorferry.Loader(str(merged / "sharded"), framework="np") as loader:
            info = loader.engine_info
            assert info["filesystem"].startswith("overlay(") and "fuse.tf_slowfs" in \
                info["filesystem"], info
            assert info["engine"] != "mmap", info
            _same(loader.load(), want)
    finally:
        subprocess.run(["umount", str(merged)], check=False)


def test_transformers_route_reads_instead_of_mapping(source, mount):
    """tensorferry.transformers' safe_open on the mount: a whole tensor first reads the file (no
    mapping); a part first reads only that part's bytes, each slice its own."""
    pytest.importorskip("transformers")
    import tensorferry.transformers as tft
    _, want = source
    path = os.path.join(mount, "single.safetensors")
    live = tensorferry._core.mapping_stats()["live"]
    with tft.safe_open(path, framework="pt") as f:
        for name in f.keys():
            got = f.get_slice(name)[...]
            assert np.array_equal(got.numpy(), want[name]), name
            assert tensorferry._core.mapping_stats()["live"] == live  # read, not mapped
        assert sorted(f._views) == sorted(want)
    with tft.safe_open(path, framework="pt") as f:
        assert np.array_equal(f.get_slice("layers.0.w")[2:5].numpy(), want["layers.0.w"][2:5])
        assert f._views == {}  # not mapped, nothing read ahead
        assert np.array_equal(f.get_slice("embed")[...].numpy(), want["embed"])


def test_transformers_backend_mmap_reads_from_transformers_and_maps_when_asked(source, mount):
    """backend="mmap" on the mount: passed by transformers (its platform default on Linux), the
    file is read, not mapped; passed to tensorferry.transformers.safe_open by the user's own
    code, it maps, as an explicit backend="mmap" does everywhere."""
    pytest.importorskip("transformers")
    import transformers.modeling_utils as mu
    import tensorferry.transformers as tft
    _, want = source
    path = os.path.join(mount, "single.safetensors")
    live = tensorferry._core.mapping_stats()["live"]
    with tft.loading():
        with mu.safe_open(path, framework="pt", device="cpu", backend="mmap") as f:
            assert np.array_equal(f.get_slice("embed")[...].numpy(), want["embed"])
            assert tensorferry._core.mapping_stats()["live"] == live  # read, not mapped
    with tft.safe_open(path, framework="pt", backend="mmap") as f:
        assert np.array_equal(f.get_slice("embed")[...].numpy(), want["embed"])
        assert tensorferry._core.mapping_stats()["live"] > live  # mapped


def _data_offset(path, name):
    """The file offset of tensor `name`'s first byte (its header read here, as the format says)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n + header[name]["data_offsets"][0]


def test_a_bad_sector_names_the_tensor_it_hit(source, tmp_path):
    """A real file system answering EIO for the bytes of one tensor (tf_slowfs --eio-at, as a disk
    with an unreadable sector): every engine fails the load with the OS error, the file and offset
    and the tensor the failed read held; the tensors before it still read byte-exact."""
    root, want = source
    bad = _data_offset(str(root / "single.safetensors"), "big") + (10 << 20)
    mnt = str(tmp_path / "bad")
    os.mkdir(mnt)
    with _slowfs(root, mnt, "--eio-file=single.safetensors", f"--eio-at={bad}"):
        path = os.path.join(mnt, "single.safetensors")
        for args in ([], ["--engine", "pread"], ["--engine", "io_uring"],
                     ["--engine", "mmap", "--populate"]):
            r = subprocess.run([CLI, "load", path, *args], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 1, (args, r.returncode, r.stdout, r.stderr)
            assert f"error: {path}: " in r.stderr, (args, r.stderr)
            assert "Input/output error" in r.stderr or "an I/O error" in r.stderr, \
                (args, r.stderr)
            assert '; the read held tensor "big"' in r.stderr, (args, r.stderr)
        with tensorferry.safe_open(path, framework="np") as f:
            for name in ("embed", "layers.0.w"):
                assert np.array_equal(f.get_tensor(name), want[name]), name
            with pytest.raises(OSError, match='the read held tensor "big"'):
                f.get_tensor("big")

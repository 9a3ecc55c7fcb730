"""The checkpoint owns its files (include/tensorferry/checkpoint.h): they are opened once, when
the Loader or safe_open opens the checkpoint, and a shard replaced afterwards by one of the same
size (renamed over it, or rewritten in place) is reported at the next load instead of being read,
for a single file, a directory and an index checkpoint, and in cooperative mode."""
import gc
import json
import os

import pytest
import torch
from safetensors.torch import save_file

import tensorferry
import tensorferry.torch


def _shards(directory, index):
    g = torch.Generator().manual_seed(11)
    weight_map = {}
    for s in range(3):
        name = f"model-0000{s}-of-00003.safetensors"
        tensors = {f"s{s}.t{i}": torch.randn(64, generator=g) for i in range(3)}
        save_file(tensors, os.path.join(directory, name))
        weight_map.update({k: name for k in tensors})
    if index:
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": weight_map}, f)
    return [os.path.join(directory, f"model-0000{s}-of-00003.safetensors") for s in range(3)]


def _replace_same_size(path, in_place):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[-1] ^= 0xFF
    if in_place:
        before = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(len(data) - 1)
            f.write(data[-1:])
        # A coarse file system clock may not have moved: move it.
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 2_000_000_000))
    else:
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)


@pytest.mark.parametrize("layout", ["file", "directory", "index"])
@pytest.mark.parametrize("in_place", [False, True])
def test_same_size_replacement_is_reported_at_the_next_load(tmp_path, layout, in_place):
    shards = _shards(str(tmp_path), layout == "index")
    path = shards[0] if layout == "file" else str(tmp_path)
    victim = shards[0] if layout == "file" else shards[-1]
    loader = tensorferry.Loader(path, engine="pread")
    assert len(loader.load()) == (3 if layout == "file" else 9)
    _replace_same_size(victim, in_place)
    what = "modified in place" if in_place else "replaced"
    with pytest.raises(OSError, match="file changed since the checkpoint was opened: " + what) as e:
        loader.load()
    assert victim in str(e.value)


def test_safe_open_reads_the_file_it_opened(tmp_path):
    # As with the reference (which maps the file at open), get_tensor and slices read the file
    # safe_open opened, whose header was validated, even once its path names another file.
    path = _shards(str(tmp_path), False)[0]
    want = tensorferry.torch.load_file(path)
    with tensorferry.safe_open(path, "pt") as f:
        _replace_same_size(path, in_place=False)
        assert torch.equal(f.get_tensor("s0.t2"), want["s0.t2"])
        assert torch.equal(f.get_slice("s0.t2")[60:], want["s0.t2"][60:])


def test_cooperative_mode_reads_the_checkpoint_the_loader_opened(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shards = _shards(str(ckpt), True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        loader = tensorferry.Loader(str(ckpt), tp_rank=0, tp_size=1,
                                    process_group=dist.group.WORLD)
        assert len(loader.load()) == 9
        # Were the cooperative load to open the path again, it would read the new file silently.
        _replace_same_size(shards[1], in_place=False)
        with pytest.raises(OSError, match="file changed since the checkpoint was opened"):
            loader.load()
    finally:
        dist.destroy_process_group()


def _open_fds_on(paths):
    """How many of this process's descriptors are open on `paths`."""
    wanted = {os.path.realpath(p) for p in paths}
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")) in wanted:
                count += 1
        except OSError:
            pass  # the descriptor listdir itself used, closed meanwhile
    return count


@pytest.mark.parametrize("engine", ["pread", "mmap"])
def test_close_releases_the_files_and_refuses_later_calls(tmp_path, engine):
    shards = _shards(str(tmp_path), index=True)
    assert _open_fds_on(shards) == 0
    loader = tensorferry.Loader(str(tmp_path), framework="pt", engine=engine)
    tensors = loader.load()
    reader = loader._reader
    loader.close()
    # Tensors handed out stay valid. Mapped ones hold their mappings and, with mapping leases
    # (include/tensorferry/mapping.h), a lease descriptor each until they die.
    assert torch.equal(tensors["s0.t0"], tensorferry.torch.load_file(shards[0])["s0.t0"])
    if engine == "pread":
        assert _open_fds_on(shards) == 0
    del tensors
    gc.collect()
    assert _open_fds_on(shards) == 0
    for call in (lambda: reader.names(True), lambda: reader.info("s0.t0"), reader.files,
                 lambda: reader.load(None, 1), lambda: reader.describe(None)):
        with pytest.raises(tensorferry.InvalidArgumentError, match="this Reader is closed"):
            call()
    reader.close()  # again: nothing to do


def test_files_are_held_by_the_checkpoint_until_close(tmp_path):
    shards = _shards(str(tmp_path), index=True)
    loader = tensorferry.Loader(str(tmp_path), framework="pt", engine="pread")
    loader.load()
    loader.load()
    assert _open_fds_on(shards) == len(shards)  # opened once each, whatever the loads
    loader.close()
    assert _open_fds_on(shards) == 0


def test_close_of_safe_open_releases_its_file(tmp_path):
    path = _shards(str(tmp_path), index=False)[0]
    with tensorferry.safe_open(path, framework="pt") as f:
        assert _open_fds_on([path]) == 1
        t = f.get_tensor("s0.t1")
    assert _open_fds_on([path]) == 0
    assert t.shape == (64,)


def test_a_reader_sharing_the_checkpoint_keeps_the_files_open(tmp_path):
    shards = _shards(str(tmp_path), index=False)
    base = tensorferry._core.Reader(str(tmp_path), False, {})
    other = tensorferry._core.Reader(base, {})
    base.close()
    assert _open_fds_on(shards) == len(shards)
    assert other.info("s1.t2").bytes == 64 * 4
    other.close()
    assert _open_fds_on(shards) == 0

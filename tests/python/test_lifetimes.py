"""Tensors are the caller's: they stay valid after files and loaders are closed, they are writable
private memory (writes never reach the file, torch never warns), and their memory is returned
exactly when the last of them dies."""
import gc
import os
import warnings

import numpy as np
import pytest
import safetensors.torch as ref_pt
import torch
from conftest import live_buffers, raw_bytes

import tensorferry
import tensorferry.numpy as tf_np
import tensorferry.torch as tf_pt


@pytest.fixture(autouse=True)
def no_leftover_buffers():
    """Every test starts and ends with no loaded memory referenced from Python."""
    assert live_buffers() == (0, 0)
    yield
    assert live_buffers() == (0, 0)


@pytest.fixture
def weights(tmp_path):
    g = torch.Generator().manual_seed(3)
    tensors = {
        "big": torch.randn(1024, 2048, generator=g),                  # 8 MiB: parallel load path
        "huge": torch.randn(4096, 1024, generator=g).to(torch.bfloat16),  # 8 MiB
        "small": torch.randn(3, 5, generator=g),
        "ids": torch.arange(100, dtype=torch.int64),
        "flag": torch.tensor(True),
        "empty": torch.zeros(0, 7),
    }
    path = str(tmp_path / "w.safetensors")
    ref_pt.save_file(tensors, path)
    return path, tensors


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def every_way_to_load(path):
    """(label, tensor dict) from each API, with every file and loader closed afterwards."""
    out = []
    with tensorferry.safe_open(path, "pt") as f:
        out.append(("get_tensor", {k: f.get_tensor(k) for k in f.keys()}))
        out.append(("get_tensors", f.get_tensors()))
        out.append(("get_slice", {k: f.get_slice(k)[...] for k in f.keys()}))
    for backend in (None, "pread", "mmap", "io_uring"):
        out.append((f"load_file({backend})", tf_pt.load_file(path, backend=backend)))
    with open(path, "rb") as fh:
        out.append(("load(bytes)", tf_pt.load(fh.read())))
    for engine in ("pread", "mmap"):
        loader = tensorferry.Loader(path, engine=engine)
        out.append((f"Loader({engine}).load", loader.load()))
        loader.close()
        loader = tensorferry.Loader(path, engine=engine, budget="20MB")
        out.append((f"Loader({engine}).iter_tensors", dict(loader.iter_tensors())))
        del loader
    return out


def test_tensors_outlive_files_and_loaders(weights):
    path, tensors = weights
    loaded = every_way_to_load(path)
    gc.collect()
    assert live_buffers()[0] > 0
    for label, got in loaded:
        assert set(got) == set(tensors), label
        for name, want in tensors.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, (label, name)
            assert torch.equal(got[name], want), (label, name)
    del loaded, got
    assert live_buffers() == (0, 0)


def test_tensors_are_writable_private_and_torch_does_not_warn(weights):
    path, tensors = weights
    with open(path, "rb") as f:
        before = f.read()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "The given buffer is not writable"
        for label, got in every_way_to_load(path):
            for name, t in got.items():
                if t.numel() == 0:
                    continue
                if t.dtype == torch.bool:
                    t.logical_not_()
                else:
                    t.add_(1)
                assert not torch.equal(t, tensors[name]), (label, name)
    with open(path, "rb") as f:
        assert f.read() == before, "a write to a loaded tensor reached the file"
    with tensorferry.safe_open(path, "np") as f:
        a = f.get_tensor("small")
        assert a.flags.writeable
        a[...] = 7
        assert (f.get_tensor("small") != 7).all()


def test_each_torch_tensor_has_its_own_storage(weights):
    # A batch is one buffer, but each tensor is its own DLPack capsule: torch.save of one tensor
    # saves only its bytes, and storage-sharing checks (save_file, transformers) see no sharing.
    path, _ = weights
    for got in (tf_pt.load_file(path), tensorferry.Loader(path, engine="pread").load()):
        for t in got.values():
            assert t.untyped_storage().nbytes() == t.nbytes
        assert len(tf_pt.save(got)) > 0  # no "tensors share memory"
    del got


def test_memory_is_freed_when_the_last_tensor_of_a_batch_dies(weights):
    path, tensors = weights
    loader = tensorferry.Loader(path, engine="pread")
    got = loader.load()
    loader.close()
    del loader
    buffers, nbytes = live_buffers()
    assert buffers == 1 and nbytes == sum(t.nbytes for t in tensors.values())
    keep = got.pop("small")
    del got
    assert live_buffers()[0] == 1  # one tensor keeps its whole batch
    assert torch.equal(keep, tensors["small"])
    del keep
    assert live_buffers() == (0, 0)


@pytest.mark.parametrize("engine", ["pread", "mmap"])
def test_resident_memory_returns(tmp_path, engine):
    path = str(tmp_path / "big.safetensors")
    ref_pt.save_file({f"w{i}": torch.full((1 << 20,), float(i)) for i in range(24)}, path)  # 96 MiB
    size = os.path.getsize(path)
    gc.collect()
    base = rss_bytes()
    loader = tensorferry.Loader(path, engine=engine, populate=True)
    got = loader.load()
    assert sum(float(t[0]) for t in got.values()) == sum(range(24))
    grown = rss_bytes() - base
    assert grown > 0.9 * size, (grown, size)
    loader.close()
    del loader, got
    gc.collect()
    assert rss_bytes() - base < 0.1 * size, (rss_bytes() - base, size)


def test_tensors_survive_the_file_being_deleted(weights):
    path, tensors = weights
    got = tf_pt.load_file(path)
    with tensorferry.safe_open(path, "pt") as f:
        sl = f.get_slice("big")
        os.remove(path)
        part = sl[1:3]  # the open file is still readable
    gc.collect()
    assert torch.equal(part, tensors["big"][1:3])
    for name, want in tensors.items():
        assert torch.equal(got[name], want)
    del got, part


def test_numpy_arrays_and_dlpack_hand_off(weights):
    path, tensors = weights
    np_weights = {k: v for k, v in tensors.items() if v.dtype != torch.bfloat16}
    np_path = path + ".np"
    tf_pt.save_file(np_weights, np_path)
    arrays = tf_np.load_file(np_path)
    views = {k: torch.from_dlpack(v) for k, v in arrays.items() if v.size}
    del arrays
    gc.collect()
    assert live_buffers()[0] > 0
    for k, v in views.items():
        assert raw_bytes(v) == raw_bytes(np_weights[k])
    del views, k, v
    assert live_buffers() == (0, 0)
    # An array's .base chain keeps the memory: a view outlives the array it came from.
    with tensorferry.safe_open(np_path, "np") as f:
        view = f.get_tensor("big")[::2, 5]
    gc.collect()
    np.testing.assert_array_equal(view, np_weights["big"].numpy()[::2, 5])
    del view


@pytest.mark.parametrize("framework", ["pt", "np"])
def test_what_the_caller_writes_to_loaded_tensors_never_reaches_a_later_load(tmp_path,
                                                                             framework):
    # Mapped tensors are private copy-on-write views: a second load of the same Loader or
    # safe_open handle gets the file's bytes, not the caller's edits of the first one's (which it
    # keeps), whether small or large (a large get_tensor is a load).
    import numpy as np
    import tensorferry.numpy
    path = str(tmp_path / "m.safetensors")
    tensorferry.numpy.save_file({"big": np.zeros((4096, 1024), np.float32),
                                 "small": np.ones(5, np.float32)}, path)
    with tensorferry.safe_open(path, framework) as f:
        first = f.get_tensors()
        first["big"][0, 0] = 66
        first["small"][0] = 55
        again = f.get_tensors()
        assert float(again["big"][0, 0]) == 0 and float(again["small"][0]) == 1
        big = f.get_tensor("big")
        big[1, 1] = 7
        assert float(f.get_tensor("big")[1, 1]) == 0
        assert float(first["big"][0, 0]) == 66 and float(big[1, 1]) == 7
    loader = tensorferry.Loader(path, framework=framework, engine="mmap")
    one = loader.load()
    one["big"][2, 2] = 9
    two = loader.load()
    assert float(two["big"][2, 2]) == 0 and float(one["big"][2, 2]) == 9
    loader.close()

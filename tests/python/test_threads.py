"""Several threads loading at once, and the GIL released during loads."""
import threading
import time

import pytest
import safetensors.torch as ref_pt
import torch

import tensorferry
import tensorferry.torch as tf_pt


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("threads")
    out = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        tensors = {f"w{j}": torch.randn(256, 64 * (j + 1), generator=g) for j in range(6)}
        tensors["big"] = torch.randn(2048, 1024, generator=g)  # 8 MiB: the loader's path
        path = str(d / f"f{i}.safetensors")
        ref_pt.save_file(tensors, path)
        out.append((path, tensors))
    return out


def run_threads(n, target):
    errors = []

    def wrapped(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_many_threads_many_apis(files):
    def work(i):
        path, tensors = files[i % len(files)]
        for round_ in range(3):
            kind = (i + round_) % 4
            if kind == 0:
                got = tf_pt.load_file(path)
            elif kind == 1:
                got = tensorferry.Loader(path, budget="16MB", threads=2).load()
            elif kind == 2:
                got = dict(tensorferry.Loader(path, budget="20MB").iter_tensors())
            else:
                with tensorferry.safe_open(path, "pt") as f:
                    got = {k: f.get_tensor(k) for k in f.keys()}
            assert set(got) == set(tensors)
            for name, want in tensors.items():
                assert torch.equal(got[name], want), (i, kind, name)

    run_threads(8, work)


def test_threads_sharing_one_file_handle(files):
    path, tensors = files[0]
    with tensorferry.safe_open(path, "pt") as f:
        def work(i):
            names = sorted(tensors)
            for k in range(20):
                name = names[(i + k) % len(names)]
                assert torch.equal(f.get_tensor(name), tensors[name])
                assert torch.equal(f.get_slice(name)[1:3], tensors[name][1:3])
            assert len(f.get_tensors()) == len(tensors)

        run_threads(6, work)


def test_the_gil_is_released_during_every_load(files, tmp_path):
    # Every compiled section that reads, writes or waits releases the GIL and checks, from inside,
    # that it no longer holds it (PyGILState_Check); here every API runs and none found it held.
    import tensorferry._core as core
    import tensorferry.numpy as tf_np
    path, tensors = files[0]
    sections, held = core.gil_checks()
    tf_pt.load_file(path)
    tf_pt.load_file(path, backend="pread")
    with tensorferry.safe_open(path, "pt") as f:
        f.get_tensor("w0"), f.get_tensor("big"), f.get_slice("big")[3:5], f.metadata()
    with tensorferry.Loader(path, budget="20MB") as loader:
        loader.load()
        list(loader.iter_tensors())
        loader.stream(lambda batch: None)
    tf_pt.load(tf_pt.save(tensors))
    tf_pt.save_file(tensors, str(tmp_path / "out.safetensors"))
    tf_np.load_file(str(tmp_path / "out.safetensors"))
    after, held_after = core.gil_checks()
    assert after - sections >= 15
    assert held_after == held == 0


def test_other_threads_run_python_during_a_load(tmp_path):
    # A load long enough (32 MB in 4 KB reads on one thread) for a counting thread to make
    # progress meanwhile. (The check above is the strict one; this shows the effect.)
    path = str(tmp_path / "long.safetensors")
    ref_pt.save_file({"w": torch.ones(8 << 20)}, path)
    loader = tensorferry.Loader(path, engine="pread", threads=1, chunk_size="4KB")
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(1)

    counter = threading.Thread(target=count)
    counter.start()
    during = []  # ticks counted inside each load() call
    try:
        for _ in range(3):
            before = len(ticks)
            got = loader.load()
            during.append(len(ticks) - before)
            assert float(got["w"][-1]) == 1.0
            del got
    finally:
        stop.set()
        counter.join()
    # The counting thread ran while load() was inside the C++ code (a held GIL would leave it
    # a switch interval at the call's start at most: one call with none is allowed).
    assert sum(1 for n in during if n > 0) >= 2, during

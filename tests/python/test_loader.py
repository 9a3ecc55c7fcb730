"""tensorferry.Loader: whole loads, batch iteration under a budget, selection, statistics,
progress, options and errors."""
import os
import sys
import types

import numpy as np
import pytest
import safetensors.torch as ref_pt
import torch
from conftest import live_buffers

import tensorferry
import tensorferry.torch


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Every tensor of the tiny checkpoint as the reference reads it, in file order."""
    out = {}
    for shard in sorted(os.listdir(tiny_checkpoint)):
        if shard.endswith(".safetensors"):
            out.update(ref_pt.load_file(os.path.join(tiny_checkpoint, shard)))
    return out


@pytest.fixture(scope="module")
def sizes(reference):
    return {k: v.nbytes for k, v in reference.items()}


def assert_equal_dicts(got, want):
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


@pytest.mark.parametrize("engine", ["auto", "pread", "io_uring", "mmap"])
def test_load_every_engine(tiny_checkpoint, reference, engine):
    with tensorferry.Loader(tiny_checkpoint, engine=engine, threads=2) as loader:
        assert len(loader) == len(reference)
        assert loader.total_bytes == sum(v.nbytes for v in reference.values())
        got = loader.load()
        assert_equal_dicts(got, reference)
        stats = loader.stats
        assert stats.tensors == len(reference) and stats.bytes == loader.total_bytes
        assert stats.seconds > 0 and stats.gbps > 0 and stats.peak_rss_bytes > 0
        assert stats.engine in ("pread", "io_uring", "mmap")
        if engine != "auto":
            assert stats.engine == engine
        text = str(stats)
        assert text.startswith(f"{len(reference)} tensors in {stats.batches} batches: "), text
        assert f"{tensorferry._core.format_bytes(loader.total_bytes)} in " in text, text
        assert f"with {stats.engine};" in text, text


def test_index_file_and_single_shard(tiny_checkpoint, reference):
    index = os.path.join(tiny_checkpoint, "model.safetensors.index.json")
    assert_equal_dicts(tensorferry.Loader(index).load(), reference)
    shard = sorted(p for p in os.listdir(tiny_checkpoint) if p.endswith(".safetensors"))[0]
    path = os.path.join(tiny_checkpoint, shard)
    assert_equal_dicts(tensorferry.Loader(path).load(), ref_pt.load_file(path))
    assert tensorferry.Loader(index).metadata()["total_size"] == str(sum(
        v.nbytes for v in reference.values()))


def test_iter_tensors_under_a_budget(tiny_checkpoint, reference, sizes):
    budget = 2 * max(sizes.values())
    with tensorferry.Loader(tiny_checkpoint, budget=budget) as loader:
        got = {}
        for name, tensor in loader.iter_tensors():  # the loop variable holds a tensor of the
            got[name] = tensor.clone()              # previous batch while the next is read
        assert_equal_dicts(got, reference)
        stats = loader.stats
        assert stats.batches > 2 and stats.tensors == len(reference)
        assert 0 < stats.peak_budget_bytes <= budget
    del tensor
    assert live_buffers() == (0, 0)


@pytest.mark.parametrize("share", [1.4, 1.6])
def test_a_plain_loop_under_less_than_twice_the_largest_tensor(tiny_checkpoint, reference, sizes,
                                                               share):
    """The largest tensors go alone and the others in batches of at most the budget less the
    largest, so the loop variable's batch and the next one fit together."""
    largest = max(sizes.values())
    budget = int(largest * share)
    with tensorferry.Loader(tiny_checkpoint, budget=budget) as loader:
        got = {}
        for batch in loader.iter_batches():  # holds the batch before while it asks for the next
            assert batch.bytes <= budget - largest or len(batch.tensors) == 1, batch.bytes
            got.update({n: t.clone() for n, t in batch.tensors.items()})
        assert_equal_dicts(got, reference)
        assert 0 < loader.stats.peak_budget_bytes <= budget
        del batch
        got = {}
        for name, tensor in loader.iter_tensors():
            got[name] = tensor.clone()
        assert_equal_dicts(got, reference)
    del tensor
    assert live_buffers() == (0, 0)


def test_a_plain_loop_over_two_big_tensors_one_after_the_other(tmp_path):
    """An untied lm_head beside the embedding (a single-file Llama): both go alone under 1.5x
    the largest tensor and would pass the budget together; a smaller batch comes between them,
    so a plain loop that keeps nothing needs no `del batch`."""
    g = torch.Generator().manual_seed(7)
    tensors = {"lm_head.weight": torch.randn(512, 64, generator=g),
               "model.embed_tokens.weight": torch.randn(512, 64, generator=g)}
    for layer in range(4):
        tensors[f"model.layers.{layer}.mlp.up_proj.weight"] = torch.randn(96, 64, generator=g)
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.randn(64, generator=g)
    path = str(tmp_path / "model.safetensors")
    tensorferry.torch.save_file(tensors, path)
    largest = 512 * 64 * 4
    budget = largest * 3 // 2
    with tensorferry.Loader(path, budget=budget) as loader:
        got, order = {}, []
        for batch in loader.iter_batches():  # holds the batch before while it asks for the next
            order.append(sorted(batch.tensors))
            got.update({n: t.clone() for n, t in batch.tensors.items()})
        assert_equal_dicts(got, tensors)
        assert 0 < loader.stats.peak_budget_bytes <= budget
        assert order[0] == ["lm_head.weight"]
        assert order[1] != ["model.embed_tokens.weight"]  # a smaller batch in between
        del batch
        got = {}
        for name, tensor in loader.iter_tensors():
            got[name] = tensor.clone()
        assert_equal_dicts(got, tensors)
    del tensor
    assert live_buffers() == (0, 0)


def test_keeping_every_tensor_exceeds_the_budget(tiny_checkpoint, sizes):
    budget = 2 * max(sizes.values())
    loader = tensorferry.Loader(tiny_checkpoint, budget=budget)
    kept = []
    with pytest.raises(tensorferry.BudgetExceededError, match="still held"):
        for _, tensor in loader.iter_tensors():
            kept.append(tensor)
    assert 0 < sum(t.nbytes for t in kept) <= budget
    del kept, tensor
    # The loader is usable again once the memory is dropped.
    assert len([name for name, _ in loader.iter_tensors()]) == len(sizes)
    with pytest.raises(tensorferry.BudgetExceededError, match="use Stream"):
        loader.load()  # everything at once cannot fit


def test_iter_batches_in_layer_order(tiny_checkpoint, reference):
    import tensorferry._core as core
    with tensorferry.Loader(tiny_checkpoint, budget="1GB", order="layer") as loader:
        seen = []
        for batch in loader.iter_batches():
            layers = {core.layer_of(n) for n in batch.tensors}
            assert len(layers) == 1, layers
            assert batch.bytes == sum(t.nbytes for t in batch.tensors.values())
            assert batch.count >= 3 and batch.index == len(seen)
            seen.append(layers.pop())
        assert seen[0] is None and seen[1:] == sorted(seen[1:])


def test_select(tiny_checkpoint, reference):
    names = sorted(reference)[:3]
    assert set(tensorferry.Loader(tiny_checkpoint, select=names).load()) == set(names)
    assert list(tensorferry.Loader(tiny_checkpoint, select=names[0]).load()) == [names[0]]
    by_predicate = tensorferry.Loader(tiny_checkpoint, select=lambda n: n.endswith("norm.weight"))
    assert set(by_predicate.load()) == {n for n in reference if n.endswith("norm.weight")}
    layer0 = tensorferry.Loader(tiny_checkpoint, select=tensorferry.layers(0))
    assert set(layer0.keys()) == {n for n in reference if ".layers.0." in n}
    assert_equal_dicts(layer0.load(), {n: reference[n] for n in layer0.keys()})
    assert {name for name, _ in layer0.iter_tensors()} == set(layer0.keys())
    with pytest.raises(tensorferry.SafetensorError, match="does not contain tensor nope"):
        tensorferry.Loader(tiny_checkpoint, select=["nope"])


def test_stream_callback(tiny_checkpoint, reference, sizes):
    loader = tensorferry.Loader(tiny_checkpoint, budget=2 * max(sizes.values()))
    batches = []
    loader.stream(lambda b: batches.append((b.index, b.count, sorted(b.tensors))))
    assert [i for i, _, _ in batches] == list(range(batches[0][1]))
    assert sorted(n for _, _, names in batches for n in names) == sorted(reference)

    calls = []

    def fail(batch):
        calls.append(batch.index)
        raise ValueError("consumer failed")

    with pytest.raises(ValueError, match="consumer failed"):
        loader.stream(fail)
    assert calls == [0]
    with pytest.raises(tensorferry.InvalidArgumentError, match="busy"):
        loader.stream(lambda b: loader.load())  # re-entering its own loader
    engines = []  # what the loader reads with may be asked from its own callback
    loader.stream(lambda b: engines.append(loader.engine_info["engine"]))
    assert engines and all(e == engines[0] for e in engines)
    # A callback that raised cancelled that stream; the next one starts afresh, as does one
    # after an iteration left early (its close cancels its reads).
    again = []
    loader.stream(lambda b: again.append(b.index))
    assert again == list(range(batches[0][1]))
    for _ in loader.iter_batches():
        break
    after_break = []
    loader.stream(lambda b: after_break.append(sorted(b.tensors)))
    assert sorted(n for names in after_break for n in names) == sorted(reference)


def test_busy_and_close_during_iteration(tiny_checkpoint, reference, sizes):
    loader = tensorferry.Loader(tiny_checkpoint, budget=2 * max(sizes.values()))
    it = loader.iter_tensors()
    next(it)
    with pytest.raises(tensorferry.InvalidArgumentError, match="busy"):
        loader.load()
    it.close()  # abandoning the iteration stops the loader's stream: usable again
    assert sorted(name for name, _ in loader.iter_tensors()) == sorted(reference)
    it = loader.iter_tensors()
    name, tensor = next(it)
    loader.close()  # closing the loader stops its iterations: the next step raises, never a quiet end
    with pytest.raises(tensorferry.InvalidArgumentError, match="Loader was closed"):
        next(it)
    with pytest.raises(tensorferry.SafetensorError, match="closed"):
        loader.load()
    assert torch.equal(tensor, reference[name])  # handed out: still valid
    del tensor, it


def test_budget_and_size_arguments(tiny_checkpoint):
    for budget, want in ((None, 0), (0, 0), (12345, 12345), ("256MB", 256_000_000),
                         ("1GiB", 1 << 30), ("1.5 KB", 1500)):
        assert tensorferry.Loader(tiny_checkpoint, budget=budget).options["budget"] == want
    assert tensorferry.parse_size("8MiB") == 8 << 20
    for bad in ("lots", -1, 1.5, True):
        with pytest.raises(tensorferry.InvalidArgumentError):
            tensorferry.Loader(tiny_checkpoint, budget=bad)
    for bad in ({"threads": -1}, {"threads": 2.5}, {"queue_depth": True}):
        with pytest.raises(tensorferry.InvalidArgumentError):
            tensorferry.Loader(tiny_checkpoint, **bad)
    with pytest.raises(tensorferry.InvalidArgumentError, match="engine"):
        tensorferry.Loader(tiny_checkpoint, engine="warp")
    with pytest.raises(tensorferry.InvalidArgumentError, match="order"):
        tensorferry.Loader(tiny_checkpoint, order="random")
    with pytest.raises(tensorferry.SafetensorError, match="device"):
        tensorferry.Loader(tiny_checkpoint, device="nowhere")
    options = tensorferry.Loader(tiny_checkpoint, threads=3, chunk_size="1MB", direct="off",
                                 queue_depth=4, populate=True, engine="pread").options
    assert (options["threads"], options["chunk_size"], options["direct"], options["queue_depth"],
            options["populate"], options["engine"]) == (3, 1_000_000, "off", 4, True, "pread")


def test_environment_seeds_the_defaults(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("TENSORFERRY_BUDGET", "64MB")
    monkeypatch.setenv("TENSORFERRY_THREADS", "3")
    monkeypatch.setenv("TENSORFERRY_ENGINE", "pread")
    options = tensorferry.Loader(tiny_checkpoint).options
    assert (options["budget"], options["threads"], options["engine"]) == (64_000_000, 3, "pread")
    assert tensorferry.Loader(tiny_checkpoint, budget=0, threads=1).options["budget"] == 0
    monkeypatch.setenv("TENSORFERRY_BUDGET", "plenty")
    with pytest.raises(tensorferry.InvalidArgumentError, match="TENSORFERRY_BUDGET"):
        tensorferry.Loader(tiny_checkpoint)


def test_progress_callable_and_tqdm(tiny_checkpoint, sizes, monkeypatch):
    total = sum(sizes.values())
    seen = []
    loader = tensorferry.Loader(tiny_checkpoint, budget=2 * max(sizes.values()),
                                progress=lambda done, all_: seen.append((done, all_)))
    for _ in loader.iter_tensors():
        pass
    assert len(seen) == loader.stats.batches and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)

    # progress=True uses tqdm when it is installed: a stand-in module records the calls.
    bars = []

    class FakeTqdm:
        def __init__(self, total, unit, unit_scale, desc):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    fake = types.ModuleType("tqdm.auto")
    fake.tqdm = FakeTqdm
    monkeypatch.setitem(sys.modules, "tqdm", types.ModuleType("tqdm"))
    monkeypatch.setitem(sys.modules, "tqdm.auto", fake)
    loaded = tensorferry.Loader(tiny_checkpoint, progress=True).load()
    assert len(loaded) == len(sizes)
    assert len(bars) == 1 and bars[0].total == total and bars[0].n == total and bars[0].closed
    # With a bar, load() reads file by file, but the selection must fit whole first, as without:
    # the same error before any read.
    for progress in (False, True):
        loader = tensorferry.Loader(tiny_checkpoint, memory_limit=total // 2, engine="pread",
                                    progress=progress)
        with pytest.raises(tensorferry.BudgetExceededError, match="every tensor at once"):
            loader.load()
        assert loader.stats.bytes_read == 0, progress


def test_numpy_framework(tmp_path):
    path = str(tmp_path / "f.safetensors")
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, dtype=np.int64)}
    import tensorferry.numpy as tf_np
    tf_np.save_file(arrays, path)
    got = tensorferry.Loader(path, framework="np").load()
    for k, v in arrays.items():
        assert type(got[k]) is np.ndarray and got[k].dtype.type is v.dtype.type
        np.testing.assert_array_equal(got[k], v)
    assert {k for k, _ in tensorferry.Loader(path, framework="np").iter_tensors()} == set(arrays)
    with pytest.raises(tensorferry.SafetensorError, match="device"):
        tensorferry.Loader(path, framework="np", device="cuda")


@pytest.mark.parametrize("metadata", [None, {}, {"note": "x"}])
def test_metadata_is_answered_during_an_iteration_and_from_a_stream_callback(tmp_path, metadata):
    # A file without metadata, or with an empty table, is read again to tell the two apart: that
    # read took the loader's lock, so metadata() raised "busy" in a loop or callback.
    path = str(tmp_path / "m.safetensors")
    ref_pt.save_file({"a": torch.ones(100000), "b": torch.ones(100000)}, path, metadata=metadata)
    want = None if metadata is None else metadata
    with safe_open_reference(path) as f:
        assert f.metadata() == want
    loader = tensorferry.Loader(path, budget="1MB")
    seen = []
    for _name, _t in loader.iter_tensors():
        seen.append(loader.metadata())
    assert seen == [want, want]
    calls = []
    loader.stream(lambda batch: calls.append(loader.metadata()))
    assert calls and all(m == want for m in calls)


def safe_open_reference(path):
    import safetensors
    return safetensors.safe_open(path, "pt")


def test_settings_only_a_copying_engine_uses_ask_for_one(tiny_checkpoint, monkeypatch):
    # Without a budget the Loader maps local files (mmap with populate); an explicit setting
    # only the copying engines use (direct, chunk_size, queue_depth, drop_cache, memory_limit)
    # was silently ignored that way. TENSORFERRY_BUDGET=0 (unbounded) is no budget.
    monkeypatch.delenv("TENSORFERRY_ENGINE", raising=False)
    monkeypatch.delenv("TENSORFERRY_BUDGET", raising=False)
    with tensorferry.Loader(tiny_checkpoint) as loader:
        assert loader.engine_info["engine"] == "mmap"
    for given in ({"direct": "on"}, {"chunk_size": "1MiB"}, {"queue_depth": 8},
                  {"drop_cache": True}, {"memory_limit": "1GB"}):
        with tensorferry.Loader(tiny_checkpoint, **given) as loader:
            assert loader.engine_info["engine"] != "mmap", given
            assert len(loader.load()) == len(loader.keys())
    # Values that turn them off keep the default (memory_limit="off" left a copying engine
    # without its guard).
    for given in ({"direct": "off"}, {"drop_cache": False}, {"memory_limit": "off"}):
        with tensorferry.Loader(tiny_checkpoint, **given) as loader:
            assert loader.engine_info["engine"] == "mmap", given
    for unbounded in ("0", "0MB"):
        monkeypatch.setenv("TENSORFERRY_BUDGET", unbounded)
        with tensorferry.Loader(tiny_checkpoint) as loader:
            assert loader.engine_info["engine"] == "mmap", unbounded

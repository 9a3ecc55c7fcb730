"""tensorferry._torch_file: torch.save checkpoints (the files torch.save writes, zip and legacy)
read tensor by tensor without running their pickles, compared with torch.load; corrupt storages
and refused globals fail before a wrong byte or a call."""
import collections
import os

import pytest

torch = pytest.importorskip("torch")

import tensorferry  # noqa: E402
from tensorferry import _core, _torch_file  # noqa: E402


def _state():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 8, generator=g)
    return collections.OrderedDict([
        ("f32", torch.randn(5, 7, generator=g)),
        ("bf16", torch.randn(4, 3, generator=g).to(torch.bfloat16)),
        ("f16", torch.randn(9, generator=g).to(torch.float16)),
        ("i64", torch.arange(-5, 5, dtype=torch.int64)),
        ("bool", torch.tensor([True, False, True])),
        ("u8", torch.arange(0, 250, 7, dtype=torch.uint8)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 3)),
        ("base", base),
        ("transposed", base.t()),      # a strided view of base's storage
        ("rows", base[2:4]),           # a part of it
        ("nested", {"w": torch.ones(2, 2), "list": [torch.full((3,), 7.0)]}),
        ("step", 12),                  # not a tensor: skipped
    ])


def _expected(state, prefix=""):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_expected(v, f"{prefix}{k}."))
        elif isinstance(v, list):
            out.update(_expected({str(i): x for i, x in enumerate(v)}, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_tensors_are_torch_loads_byte_for_byte(tmp_path, legacy):
    state = _state()
    path = str(tmp_path / "w.pt")
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    expected = _expected(state)
    with _torch_file.TorchFile(path) as f:
        names = [e[0] for e in f.entries]
        got = dict(f.tensors())
    assert names == list(expected)
    assert list(got) == list(expected)
    for name, want in expected.items():
        t = got[name]
        assert t.dtype == want.dtype and t.shape == want.shape, name
        assert t.is_contiguous() and t.device.type == "cpu"
        assert torch.equal(t, want), name
    # Each tensor owns its memory: the transpose is not a view of base.
    got["base"].zero_()
    assert torch.equal(got["transposed"], state["base"].t())


def test_keep_selects_and_entries_describe(tmp_path):
    path = str(tmp_path / "w.bin")
    torch.save(_state(), path)
    with _torch_file.TorchFile(path) as f:
        entry = dict((e[0], e[1:]) for e in f.entries)
        assert entry["bf16"] == ("bfloat16", (4, 3), 24)
        assert entry["scalar"] == ("float32", (), 4)
        got = [n for n, _ in f.tensors(keep=lambda n: n.startswith("nested."))]
    assert got == ["nested.w", "nested.list.0"]


def _flip(path, needle, at=1):
    data = bytearray(open(path, "rb").read())
    i = data.find(needle)
    assert i >= 0 and data.find(needle, i + 1) < 0
    data[i + at] ^= 0x40
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("which", ["whole", "part"])
def test_a_flipped_storage_byte_fails_the_tensor_that_reads_it(tmp_path, which):
    # "whole": a tensor reading its whole storage in order (the read checks the CRC);
    # "part": a view of rows 2-3 of a storage whose flipped byte lies in row 0 (the CRC is
    # checked by reading the storage once more whole before the view is given out).
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8) + 1000
    state = {"other": torch.ones(3), "x": base} if which == "whole" else \
        {"other": torch.ones(3), "x": base[2:4]}
    path = str(tmp_path / "w.pt")
    torch.save(state, path)
    _flip(path, base.numpy().tobytes()[:32])
    with _torch_file.TorchFile(path) as f:
        it = f.tensors()
        assert next(it)[0] == "other"
        with pytest.raises(tensorferry.SafetensorError) as e:
            next(it)
    msg = str(e.value)
    assert e.value.code == "zip_bad_entry"
    assert "CRC" in msg and path in msg and '(reading tensor "x")' in msg


def test_a_pickle_calling_os_system_is_refused_at_open(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = str(tmp_path / "evil.bin")
    torch.save({"w": torch.ones(2), "x": Evil()}, path)
    with pytest.raises(tensorferry.SafetensorError) as e:
        _torch_file.TorchFile(path)
    assert "system" in str(e.value) and path in str(e.value)
    assert not marker.exists()


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError):
        _torch_file.TorchFile(str(tmp_path / "missing.bin"))
    path = str(tmp_path / "w.pt")
    torch.save({"a": torch.ones(4)}, path)
    raw = _core.TorchFile(path)
    with pytest.raises(tensorferry.InvalidArgumentError, match="holds 16 bytes; the buffer 8"):
        raw.read(0, bytearray(8))
    with pytest.raises(tensorferry.InvalidArgumentError, match="tensor index 1 out of range"):
        raw.read(1, bytearray(16))
    with pytest.raises(BufferError):
        raw.read(0, b"x" * 16)  # not writable
    out = bytearray(16)
    raw.read(0, out)
    assert bytes(out) == torch.ones(4).numpy().tobytes()
    raw.close()
    with pytest.raises(ValueError, match="closed"):
        raw.tensors


def test_close_while_another_thread_reads_ends_after_that_read(tmp_path):
    """close() from another thread during a read (the GIL is released while it reads): the read
    still completes with the right bytes (it holds the checkpoint), later calls say closed."""
    import threading
    big = torch.arange(24 << 20, dtype=torch.int32)  # 96 MiB: two read steps of 64 MiB
    path = str(tmp_path / "big.pt")
    torch.save({"big": big}, path)
    f = _core.TorchFile(path)
    out = torch.full_like(big, -1)
    errors = []

    def read():
        try:
            f.read(0, out.numpy())
        except Exception as e:  # noqa: BLE001 - the test reads it
            errors.append(e)
    reader = threading.Thread(target=read)
    reader.start()
    while out[0].item() == -1 and reader.is_alive():  # the read has begun (bytes landing)
        pass
    f.close()
    reader.join()
    assert errors == [] and torch.equal(out, big)
    with pytest.raises(ValueError, match="is closed"):
        f.read(0, out.numpy())

"""Per-tensor checksums from Python (docs/integrity.md): save_file records them, checksums=False
gives the reference's bytes, loads check them (verify=, TENSORFERRY_VERIFY), and a corrupt tensor
is an error naming the tensor and chunk, never a tensor handed out."""
import json
import os
import subprocess

import pytest
import torch
from safetensors import safe_open as ref_safe_open
from safetensors.torch import save_file as ref_save_file

import tensorferry
import tensorferry.numpy
import tensorferry.torch

KEY = "tensorferry.checksums"


def tensors():
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(300, 100, generator=g), "b": torch.arange(10, dtype=torch.int64)}


def corrupt(path, name):
    with ref_safe_open(path, framework="pt") as f:
        keys = list(f.keys())
    with open(path, "rb") as f:
        data = bytearray(f.read())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    begin = header[name]["data_offsets"][0]
    data[8 + n + begin + 7] ^= 0x20
    with open(path, "wb") as f:
        f.write(data)
    return keys


def test_save_file_records_checksums_readable_by_the_reference(tmp_path):
    path = str(tmp_path / "m.safetensors")
    tensorferry.torch.save_file(tensors(), path, metadata={"format": "pt"})
    with ref_safe_open(path, framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt"
        record = json.loads(meta[KEY])
        assert record["algorithm"] == "xxh3-64-chunked"
        assert sorted(record["tensors"]) == ["a", "b"]
        assert torch.equal(f.get_tensor("a"), tensors()["a"])
    # checksums=False: the reference's bytes exactly.
    ours, ref = str(tmp_path / "plain.safetensors"), str(tmp_path / "ref.safetensors")
    tensorferry.torch.save_file(tensors(), ours, metadata={"format": "pt"}, checksums=False)
    ref_save_file(tensors(), ref, metadata={"format": "pt"})
    assert open(ours, "rb").read() == open(ref, "rb").read()
    np_path = str(tmp_path / "np.safetensors")
    tensorferry.numpy.save_file({"x": tensors()["b"].numpy()}, np_path)
    with ref_safe_open(np_path, framework="np") as f:
        assert KEY in f.metadata()


@pytest.mark.parametrize("flavour", ["torch", "numpy"])
def test_a_file_saved_without_metadata_is_read_as_pytorchs_by_accelerate(tmp_path, flavour):
    # The reference writes no metadata table for metadata=None, which accelerate (and
    # transformers 4) read as format "pt"; a table holding only the checksums record would be
    # refused there ("does not contain the valid metadata"), so "format": "pt" goes beside it.
    from accelerate.utils.modeling import load_state_dict
    path = str(tmp_path / "m.safetensors")
    if flavour == "torch":
        tensorferry.torch.save_file(tensors(), path)
    else:
        tensorferry.numpy.save_file({k: v.numpy() for k, v in tensors().items()}, path)
    with ref_safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and sorted(meta) == ["format", KEY], meta
    got = load_state_dict(path)
    assert sorted(got) == ["a", "b"] and torch.equal(got["a"], tensors()["a"])
    # Metadata given is written as given (no "format" added), and without checksums None stays.
    tensorferry.torch.save_file(tensors(), path, metadata={"note": "x"})
    with ref_safe_open(path, framework="pt") as f:
        assert sorted(f.metadata()) == ["note", KEY]
    tensorferry.torch.save_file(tensors(), path, checksums=False)
    with ref_safe_open(path, framework="pt") as f:
        assert f.metadata() is None


def test_loads_verify_and_report(tmp_path):
    path = str(tmp_path / "m.safetensors")
    tensorferry.torch.save_file(tensors(), path)
    with tensorferry.Loader(path, verify="on") as loader:
        got = loader.load()
        stats = loader.stats
    assert torch.equal(got["a"], tensors()["a"])
    assert stats.verified_tensors == 2
    assert stats.verified_bytes == 300 * 100 * 4 + 10 * 8
    got = tensorferry.torch.load_file(path, verify="on")
    assert torch.equal(got["b"], tensors()["b"])


@pytest.mark.parametrize("engine", ["pread", "io_uring"])
def test_load_into_checks_host_destinations(tmp_path, engine):
    # Loader.load_into (and so load_checkpoint_and_dispatch) checks whole host destinations as
    # their bytes land; a corrupt tensor is the same error as a load's.
    path = str(tmp_path / "m.safetensors")
    tensorferry.torch.save_file(tensors(), path)
    out = {k: torch.empty_like(v) for k, v in tensors().items()}
    with tensorferry.Loader(path, engine=engine) as loader:
        loader.load_into(out)
        stats = loader.stats
    assert all(torch.equal(out[k], v) for k, v in tensors().items())
    assert stats.verified_tensors == 2
    assert stats.verified_bytes == 300 * 100 * 4 + 10 * 8
    corrupt(path, "a")
    with pytest.raises(tensorferry.SafetensorError) as e:
        with tensorferry.Loader(path, engine=engine) as loader:
            loader.load_into(out)
    assert e.value.code == "checksum_mismatch"
    assert 'tensor "a": checksum mismatch in chunk 0 of 1' in str(e.value)
    with tensorferry.Loader(path, engine=engine, verify="off") as loader:
        loader.load_into(out)
        assert loader.stats.verified_tensors == 0


@pytest.mark.parametrize("engine", ["mmap", "pread", "io_uring"])
def test_tensor_parallel_slices_check_the_chunks_they_hold_whole(tmp_path, engine):
    # 12,000,000 bytes in 4 MiB checksum chunks, split in two along dim 0: rank 0 holds chunk 0
    # whole, rank 1 chunk 2 (the short last one); chunk 1 is cut between them. The halves are
    # checked over those chunks (verify_partial_tensors); a flipped byte in chunk 2 fails rank 1.
    path = str(tmp_path / "m.safetensors")
    a = torch.randn(3000, 1000, generator=torch.Generator().manual_seed(5))
    tensorferry.torch.save_file({"a": a, "b": torch.arange(10)}, path)
    populate = True if engine == "mmap" else None

    def load(rank):
        with tensorferry.Loader(path, engine=engine, populate=populate, tp_rank=rank, tp_size=2,
                                shard_rules={"a": 0}) as loader:
            got = loader.load()
            return got, loader.stats

    for rank in (0, 1):
        got, stats = load(rank)
        assert torch.equal(got["a"], a[1500 * rank:1500 * (rank + 1)])
        assert stats.verify_partial_tensors == 1
        assert stats.verified_tensors == 1  # b, replicated
        assert stats.verified_bytes == 80 + (4 << 20 if rank == 0 else 12_000_000 - (8 << 20))
    with open(path, "rb") as f:
        data = bytearray(f.read())
    n = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8:8 + n])["a"]["data_offsets"][0]
    data[8 + n + begin + 10_000_000] ^= 0x20
    with open(path, "wb") as f:
        f.write(data)
    load(0)
    with pytest.raises(tensorferry.SafetensorError) as e:
        load(1)
    assert e.value.code == "checksum_mismatch"
    assert 'tensor "a": checksum mismatch in chunk 2 of 3' in str(e.value)


@pytest.mark.parametrize("engine", ["mmap", "pread", "io_uring"])
def test_corrupt_tensor_is_an_error_and_never_delivered(tmp_path, engine):
    path = str(tmp_path / "m.safetensors")
    tensorferry.torch.save_file(tensors(), path)
    corrupt(path, "a")
    # (mmap: populated; a lazy mapping is checked only with verify="on")
    populate = True if engine == "mmap" else None
    with pytest.raises(tensorferry.SafetensorError) as e:
        with tensorferry.Loader(path, engine=engine, populate=populate) as loader:
            loader.load()
    assert e.value.code == "checksum_mismatch"
    assert 'tensor "a": checksum mismatch in chunk 0 of 1' in str(e.value)
    with pytest.raises(tensorferry.SafetensorError):
        tensorferry.torch.load_file(path)  # the default (auto) checks too
    with tensorferry.Loader(path, engine=engine, verify="off") as loader:
        assert set(loader.load()) == {"a", "b"}


def test_verify_on_needs_checksums_and_the_environment_sets_the_default(tmp_path):
    path = str(tmp_path / "ref.safetensors")
    ref_save_file(tensors(), path)
    with pytest.raises(tensorferry.SafetensorError, match="has no checksums"):
        tensorferry.torch.load_file(path, verify="on")
    with pytest.raises(tensorferry.InvalidArgumentError, match="verify"):
        tensorferry.Loader(path, verify="sometimes")
    ours = str(tmp_path / "ours.safetensors")
    tensorferry.torch.save_file(tensors(), ours)
    corrupt(ours, "b")
    env = dict(os.environ, TENSORFERRY_VERIFY="off")
    code = ("import tensorferry.torch, sys; "
            f"t = tensorferry.torch.load_file({ours!r}); print(sorted(t))")
    out = subprocess.run([os.sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "['a', 'b']"


def test_a_record_copied_with_the_metadata_of_another_file(tmp_path):
    """safetensors.save_file(new tensors, metadata=f.metadata()) copies tensorferry's record,
    which then describes other tensors: a record of other tensors is left aside under
    verify=auto, and the file loads as the safetensors package loads it (it was refused);
    verify=on refuses it, naming the record. A copy over tensors of the same names (and chunk
    counts) cannot be told from damage: refused, the message saying that a copied record is one
    cause. A record that is not one (not JSON) is damage: refused."""
    ours = str(tmp_path / "ours.safetensors")
    tensorferry.torch.save_file(tensors(), ours)
    with tensorferry.safe_open(ours, "pt") as f:
        metadata = f.metadata()
    assert KEY in metadata
    cases = {
        "other_tensors": ({"a": torch.arange(10.)}, metadata),
        "renamed": ({"a": torch.ones(7), "c": torch.ones(3, dtype=torch.int64)}, metadata),
    }
    for case, (values, meta) in cases.items():
        path = str(tmp_path / f"{case}.safetensors")
        ref_save_file(values, path, metadata=meta)
        got = tensorferry.torch.load_file(path)
        assert sorted(got) == sorted(values), case
        for name, want in values.items():
            assert torch.equal(got[name], want), (case, name)
        with tensorferry.safe_open(path, "pt") as f:
            assert torch.equal(f.get_tensor("a"), values["a"]), case
        with pytest.raises(tensorferry.SafetensorError, match="checksum|record|JSON"):
            tensorferry.torch.load_file(path, verify="on")
    same = str(tmp_path / "same_layout.safetensors")
    ref_save_file({n: t + 1 for n, t in tensors().items()}, same, metadata=metadata)
    with pytest.raises(tensorferry.SafetensorError,
                       match="checksum mismatch.*a tool that copies a file's metadata copies"):
        tensorferry.torch.load_file(same)
    garbage = str(tmp_path / "not_json.safetensors")
    ref_save_file({"a": torch.ones(7)}, garbage, metadata={KEY: "garbage"})
    with pytest.raises(tensorferry.SafetensorError, match="not valid JSON"):
        tensorferry.torch.load_file(garbage)


def test_convert_keeps_its_checksums_over_a_value_of_that_name(tmp_path):
    cli = os.environ.get("TENSORFERRY_CLI", "build/release/bin/tensorferry")
    src, dst = tmp_path / "pytorch_model.bin", tmp_path / "model.safetensors"
    torch.save({"w": torch.ones(4, 4), KEY: 5, "epoch": 3}, src)
    r = subprocess.run([cli, "convert", "--json", "--no-sync", "--verify", str(src), str(dst)],
                       capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert KEY in {s["name"] for s in doc["skipped"]}
    with ref_safe_open(str(dst), framework="pt") as f:
        meta = f.metadata()
    assert meta["epoch"] == "3"
    assert sorted(json.loads(meta[KEY])["tensors"]) == ["w"]
    r = subprocess.run([cli, "verify", str(dst)], capture_output=True, text=True)
    assert r.returncode == 0 and "1 embedded" in r.stdout, (r.stdout, r.stderr)


def flip(path, name, at):
    """Flips one bit of byte `at` of tensor `name` in the file."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    n = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8:8 + n])[name]["data_offsets"][0]
    data[8 + n + begin + at] ^= 0x20
    with open(path, "wb") as f:
        f.write(data)


def test_safe_open_checks_small_tensors_and_the_blocks_slices_read(tmp_path):
    # safe_open's reads outside loads: a small tensor read with one pread, and the block of rows
    # get_slice reads. "a" is 12,000,000 bytes in three 4 MiB checksum chunks; a bit flipped in
    # chunk 2 fails every read whose block holds that chunk whole, and "b" (80 bytes) fails get_tensor.
    path = str(tmp_path / "m.safetensors")
    a = torch.randn(3000, 1000, generator=torch.Generator().manual_seed(5))
    b = torch.arange(10)
    tensorferry.torch.save_file({"a": a, "b": b}, path)
    flip(path, "a", 10_000_000)
    flip(path, "b", 3)
    with tensorferry.safe_open(path, framework="pt") as f:
        with pytest.raises(tensorferry.SafetensorError) as e:
            f.get_tensor("b")
        assert e.value.code == "checksum_mismatch"
        assert 'tensor "b": checksum mismatch in chunk 0 of 1' in str(e.value)
        s = f.get_slice("a")
        assert torch.equal(s[:1500], a[:1500])  # rows [0, 1500): chunk 0 whole, chunk 1 cut
        for index in (slice(1500, None), (slice(None), slice(0, 10))):
            with pytest.raises(tensorferry.SafetensorError) as e:
                s[index]
            assert e.value.code == "checksum_mismatch"
            assert 'tensor "a": checksum mismatch in chunk 2 of 3 (tensor bytes [8388608, ' \
                "12000000)" in str(e.value)
        # Rows [2400, 2600) hold no whole chunk: read unchecked (docs/integrity.md).
        got = s[2400:2600]
        assert not torch.equal(got, a[2400:2600])
    code = ("import tensorferry, sys\n"
            f"with tensorferry.safe_open({path!r}, framework='pt') as f:\n"
            "    print(f.get_tensor('b').tolist(), tuple(f.get_slice('a')[1500:].shape))")
    env = dict(os.environ, TENSORFERRY_VERIFY="off")
    out = subprocess.run([os.sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[536870912, 1, 2, 3, 4, 5, 6, 7, 8, 9] (1500, 1000)"

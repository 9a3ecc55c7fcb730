"""`tensorferry convert`: PyTorch checkpoints written by the real torch.save, converted by the CLI
(path in $TENSORFERRY_CLI, set by CTest) and compared byte for byte with the tensors that produced
them; malicious pickles refused with nothing run (a canary file that the payload would create
never appears).
"""
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import pytest
import torch
from safetensors.torch import load_file, save_model, load_model

CLI = os.environ.get("TENSORFERRY_CLI") or os.path.join(
    os.path.dirname(__file__), "..", "..", "build", "release", "bin", "tensorferry")

ST_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",
}


def run_cli(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


def convert(src, dst, *extra):
    r = run_cli("convert", "--json", "--no-sync", src, dst, *extra)
    assert r.returncode in (0, 1), (r.returncode, r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert doc["ok"] == (r.returncode == 0), doc
    return doc


def read_safetensors(path):
    """{name: (dtype, shape, bytes)} and the metadata, parsed by hand (any dtype)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
           for k, v in header.items()}
    # convert records per-tensor checksums (docs/integrity.md): one per tensor of the file (the
    # reference's files have none).
    if "tensorferry.checksums" in meta:
        checksums = json.loads(meta.pop("tensorferry.checksums"))
        assert sorted(checksums["tensors"]) == sorted(out)
    return out, meta


def read_output(dst):
    """All tensors and the metadata of a converted file or sharded directory."""
    if os.path.isdir(dst):
        with open(os.path.join(dst, "model.safetensors.index.json")) as f:
            index = json.load(f)
        tensors, meta = {}, {}
        for file in sorted(set(index["weight_map"].values())):
            t, m = read_safetensors(os.path.join(dst, file))
            tensors.update(t)
            meta.update(m)
        return tensors, meta
    return read_safetensors(dst)


def tbytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype, shape, gen):
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def assert_same(expected, out_tensors, meta):
    """Every expected tensor is in the output (or an alias of one) with its dtype, shape, bytes."""
    for name, t in expected.items():
        stored = name if name in out_tensors else meta.get(name)
        assert stored in out_tensors, (name, sorted(out_tensors))
        dtype, shape, data = out_tensors[stored]
        assert dtype == ST_DTYPE[t.dtype], name
        assert shape == list(t.shape), name
        assert data == tbytes(t), name


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


@pytest.mark.parametrize("legacy", [False, True])
def test_every_dtype_byte_for_byte(tmp_path, gen, legacy):
    sd = {f"t.{str(d).split('.')[-1]}": random_tensor(d, (3, 5), gen) for d in ST_DTYPE}
    sd["scalar"] = torch.tensor(2.5)
    sd["empty"] = torch.zeros(0, 4)
    src = tmp_path / "pytorch_model.bin"
    torch.save(sd, src, _use_new_zipfile_serialization=not legacy)
    doc = convert(src, tmp_path / "model.safetensors", "--verify")
    assert doc["ok"], doc
    assert doc["tensors"] == len(sd)
    assert doc["verify"]["tensors"] == len(sd)
    tensors, meta = read_safetensors(tmp_path / "model.safetensors")
    assert meta == {"format": "pt"}
    assert_same(sd, tensors, meta)
    # The reference reads it back with the same values (it has no F8_E8M0 in its torch table).
    known = {k: v for k, v in sd.items() if v.dtype != torch.float8_e8m0fnu}
    torch.save(known, src, _use_new_zipfile_serialization=not legacy)
    assert convert(src, tmp_path / "known.safetensors")["ok"]
    loaded = load_file(tmp_path / "known.safetensors")
    assert sorted(loaded) == sorted(known)
    for name, t in loaded.items():
        assert t.dtype == known[name].dtype and tbytes(t) == tbytes(known[name]), name


def test_views_are_materialized(tmp_path, gen):
    base = random_tensor(torch.float32, (6, 8), gen)
    img = random_tensor(torch.bfloat16, (2, 3, 4, 5), gen).to(memory_format=torch.channels_last)
    sd = {
        "transposed": base.t(),
        "sliced": base[2:5, 1:7],
        "strided": base[::2, ::3],
        "expanded": torch.arange(4, dtype=torch.int64).expand(3, 4),
        "column": base[:, 3],
        "channels_last": img,
        "offset_row": base[4],
    }
    assert not sd["transposed"].is_contiguous() and sd["expanded"].stride() == (0, 1)
    src = tmp_path / "views.pt"
    torch.save(sd, src)
    doc = convert(src, tmp_path / "views.safetensors", "--verify")
    assert doc["ok"], doc
    tensors, meta = read_safetensors(tmp_path / "views.safetensors")
    assert_same(sd, tensors, meta)
    assert tensors["expanded"][2] == tbytes(torch.arange(4).repeat(3))


def test_shared_storage_aliases_like_save_model(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.body = torch.nn.Linear(4, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            self.lm_head.weight = self.embed.weight

    torch.manual_seed(0)
    model = Tied()
    save_model(model, tmp_path / "reference.safetensors")
    _, ref_meta = read_safetensors(tmp_path / "reference.safetensors")
    assert ref_meta == {"lm_head.weight": "embed.weight"}

    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    doc = convert(tmp_path / "pytorch_model.bin", tmp_path / "ours.safetensors", "--verify")
    assert doc["ok"], doc
    assert doc["aliases"] == [{"name": "lm_head.weight", "of": "embed.weight"}]
    tensors, meta = read_safetensors(tmp_path / "ours.safetensors")
    assert "lm_head.weight" not in tensors
    assert {k: v for k, v in meta.items() if k != "format"} == ref_meta
    assert meta["format"] == "pt"
    # safetensors' own loader restores the tied model from our file.
    fresh = Tied()
    load_model(fresh, tmp_path / "ours.safetensors")
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name


def test_views_of_one_storage(tmp_path, gen):
    base = random_tensor(torch.float16, (4, 6), gen)
    sd = {
        "full": base,
        "same_view": base[:],  # identical view: an alias
        "top": base[:2],       # these two do not overlap each other...
        "bottom": base[2:],    # ...but both overlap "full": written as copies
        "other": random_tensor(torch.float16, (3,), gen),
    }
    torch.save(sd, tmp_path / "m.pt")
    doc = convert(tmp_path / "m.pt", tmp_path / "m.safetensors", "--verify")
    assert doc["ok"], doc
    assert doc["aliases"] == [{"name": "same_view", "of": "full"}]
    assert sorted(c["name"] for c in doc["copied_views"]) == ["bottom", "full", "top"]
    tensors, meta = read_safetensors(tmp_path / "m.safetensors")
    assert sorted(tensors) == ["bottom", "full", "other", "top"]
    assert_same(sd, tensors, meta)

    halves = {"a": base[:2], "b": base[2:]}  # only non-overlapping views: two tensors
    torch.save(halves, tmp_path / "h.pt")
    doc = convert(tmp_path / "h.pt", tmp_path / "h.safetensors")
    assert doc["ok"] and doc["aliases"] == [] and doc["copied_views"] == []
    tensors, meta = read_safetensors(tmp_path / "h.safetensors")
    assert_same(halves, tensors, meta)


def test_nested_state_dict_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 5,
            "best": 0.125, "name": "run-1", "done": False, "note": None}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    doc = convert(tmp_path / "ckpt.pt", tmp_path / "ckpt.safetensors", "--verify")
    assert doc["ok"], doc
    tensors, meta = read_safetensors(tmp_path / "ckpt.safetensors")
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, state in opt.state_dict()["state"].items():
        for k, v in state.items():
            expected[f"optimizer.state.{pid}.{k}"] = v
    assert sorted(tensors) == sorted(expected)
    assert_same(expected, tensors, meta)
    assert meta["epoch"] == "5"
    assert meta["best"] == "0.125"
    assert meta["name"] == "run-1"
    assert meta["done"] == "False"
    assert meta["note"] == "None"
    assert meta["optimizer.param_groups.0.lr"] == str(opt.param_groups[0]["lr"])
    assert meta["optimizer.param_groups.0.betas"] == str(opt.param_groups[0]["betas"])
    assert meta["optimizer.param_groups.0.params"] == "[0, 1, 2, 3]"

    doc = convert(tmp_path / "ckpt.pt", tmp_path / "bare.safetensors", "--skip-values")
    assert doc["ok"] and doc["values"] == []
    assert {s["name"] for s in doc["skipped"]} >= {"epoch", "best", "name"}
    _, meta = read_safetensors(tmp_path / "bare.safetensors")
    assert meta == {"format": "pt"}


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_sets_bytes_and_bytearrays_as_values(tmp_path, protocol):
    # torch.save's default protocol 2 pickles a set as __builtin__.set([...]), b'' as
    # __builtin__.bytes() and a bytearray as __builtin__.bytearray(_codecs.encode(...)); 4 has
    # opcodes for sets and bytes, and builtins.bytearray(b'...'); 5 an opcode for bytearrays.
    values = {"tags": {3}, "frozen": frozenset([7]), "none": set(), "nofrozen": frozenset(),
              "empty": b"", "raw": b"\x00ab\xff", "buf": bytearray(b"x\xfey"), "nobuf": bytearray(),
              "nested": [{5}, (b"", bytearray(b"z"))]}
    torch.save({"w": torch.arange(4.0), **values}, tmp_path / "ckpt.pt", pickle_protocol=protocol)
    doc = convert(tmp_path / "ckpt.pt", tmp_path / "ckpt.safetensors", "--verify")
    assert doc["ok"], doc
    tensors, meta = read_safetensors(tmp_path / "ckpt.safetensors")
    assert sorted(tensors) == ["w"]
    for name, value in values.items():
        assert meta[name] == str(value), name


def test_sharded_bin_with_index(tmp_path, gen):
    src = tmp_path / "src"
    src.mkdir()
    shards = [{f"layers.{i}.w": random_tensor(torch.bfloat16, (16, 8), gen) for i in range(3)},
              {f"layers.{i}.w": random_tensor(torch.bfloat16, (16, 8), gen) for i in range(3, 5)}]
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        name = f"pytorch_model-0000{n}-of-00002.bin"
        torch.save(shard, src / name, _use_new_zipfile_serialization=(n == 1))
        weight_map.update({k: name for k in shard})
    with open(src / "pytorch_model.bin.index.json", "w") as f:
        json.dump({"metadata": {"total_size": 5 * 256}, "weight_map": weight_map}, f)
    doc = convert(src, tmp_path / "out", "--verify")
    assert doc["ok"], doc
    assert doc["sharded"]
    assert os.path.basename(doc["outputs"][-1]) == "model.safetensors.index.json"
    tensors, meta = read_output(tmp_path / "out")
    expected = {k: v for s in shards for k, v in s.items()}
    assert sorted(tensors) == sorted(expected)
    assert_same(expected, tensors, meta)

    # An index naming a tensor its file lacks is refused.
    weight_map["ghost"] = "pytorch_model-00001-of-00002.bin"
    with open(src / "pytorch_model.bin.index.json", "w") as f:
        json.dump({"weight_map": weight_map}, f)
    doc = convert(src / "pytorch_model.bin.index.json", tmp_path / "out2")
    assert not doc["ok"] and doc["error"]["code"] == "index_missing_tensor"


def test_sharded_bin_in_a_hub_cache_snapshot(tmp_path, gen):
    # The Hugging Face hub cache: snapshots/<rev>/ holds symlinks to ../../blobs/<sha>, the index
    # included. Converting the snapshot (or its index) must not be refused as a path escape.
    repo = tmp_path / "models--org--name"
    blobs = repo / "blobs"
    snapshot = repo / "snapshots" / "5e1f00d"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    shards = [{f"layers.{i}.w": random_tensor(torch.float16, (8, 4), gen) for i in range(2)},
              {f"layers.{i}.w": random_tensor(torch.float16, (8, 4), gen) for i in range(2, 4)}]
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        name = f"pytorch_model-0000{n}-of-00002.bin"
        torch.save(shard, blobs / f"sha{n}")
        (snapshot / name).symlink_to(f"../../blobs/sha{n}")
        weight_map.update({k: name for k in shard})
    with open(blobs / "sha0", "w") as f:
        json.dump({"metadata": {"total_size": 4 * 64}, "weight_map": weight_map}, f)
    (snapshot / "pytorch_model.bin.index.json").symlink_to("../../blobs/sha0")
    expected = {k: v for s in shards for k, v in s.items()}
    for n, src in enumerate([snapshot, snapshot / "pytorch_model.bin.index.json"]):
        doc = convert(src, tmp_path / f"out{n}", "--verify")
        assert doc["ok"], doc
        tensors, meta = read_output(tmp_path / f"out{n}")
        assert sorted(tensors) == sorted(expected)
        assert_same(expected, tensors, meta)

    # A shard that resolves outside the repository is still refused.
    outside = tmp_path / "outside.bin"
    torch.save(shards[1], outside)
    (snapshot / "pytorch_model-00002-of-00002.bin").unlink()
    (snapshot / "pytorch_model-00002-of-00002.bin").symlink_to(outside)
    doc = convert(snapshot, tmp_path / "out_escape")
    assert not doc["ok"] and doc["error"]["code"] == "index_path_escape", doc


def test_max_shard_size(tmp_path, gen):
    sd = {f"w{i}": random_tensor(torch.float32, (64, 64), gen) for i in range(6)}
    torch.save(sd, tmp_path / "m.pt")
    doc = convert(tmp_path / "m.pt", tmp_path / "out", "--max-shard-size", "40KB", "--verify")
    assert doc["ok"], doc
    assert len(doc["outputs"]) == 4  # six tensors of 16 KiB, two per shard, and the index
    tensors, meta = read_output(tmp_path / "out")
    assert_same(sd, tensors, meta)


@pytest.mark.parametrize("views", ["whole", "first_half", "halves"])
def test_corrupted_storage_bytes_fail_the_crc(tmp_path, views):
    """A flipped byte in a storage fails the conversion on its CRC-32 and writes nothing, also
    where no tensor reads the storage whole in order (a view of its first half; its two halves,
    read in the output's order), whose entry is read once more whole before the output is put in
    place."""
    src = tmp_path / "m.pt"
    x = torch.arange(600_000, dtype=torch.float32)  # 2.4 MB: the re-read crosses its 1 MiB reads
    tensors = {"whole": {"w": x}, "first_half": {"w": x[:300_000]},
               "halves": {"b_first": x[:300_000], "a_second": x[300_000:]}}[views]
    torch.save(tensors, src)
    with zipfile.ZipFile(src) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(src.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    data_at = info.header_offset + 30 + name_len + extra_len
    raw[data_at + 100] ^= 0x01
    src.write_bytes(bytes(raw))
    doc = convert(src, tmp_path / "m.safetensors")
    assert doc["error"]["code"] == "zip_bad_entry", doc
    assert "CRC" in doc["error"]["message"] and "/data/0" in doc["error"]["message"]
    assert not os.path.exists(tmp_path / "m.safetensors")


def test_unsupported_dtype_is_refused(tmp_path):
    torch.save({"c": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "c.pt")
    doc = convert(tmp_path / "c.pt", tmp_path / "c.safetensors")
    assert doc["error"]["code"] == "torch_unsupported_dtype"
    assert "complex128" in doc["error"]["message"]
    assert not os.path.exists(tmp_path / "c.safetensors")


def test_text_output_and_exit_codes(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    r = run_cli("convert", tmp_path / "m.pt", tmp_path / "m.safetensors", "--verify")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: 1 tensor, 8 B written to 1 file")
    assert "verified: 1 tensor" in r.stdout
    r = run_cli("convert", tmp_path / "missing.pt", tmp_path / "x.safetensors")
    assert r.returncode == 1 and r.stderr.startswith("error: ")
    r = run_cli("convert", tmp_path / "m.pt", tmp_path / "x", "--max-shard-size", "lots")
    assert r.returncode == 2


# --- malicious pickles ---------------------------------------------------------------------------

def torch_like_zip(path, pkl, storages=None):
    """A zip laid out like torch.save's, around an arbitrary pickle."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        for key, data in (storages or {}).items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", "3\n")


def payloads(canary):
    """(name, pickle bytes, expected text in the refusal) for each attack. The first is checked to
    create `canary` when Python unpickles it; the others run code just as well (or try to)."""
    cmd = f"touch {canary}"
    py = f"open({str(canary)!r}, 'w').close()"

    class Reduce:
        def __init__(self, fn, args):
            self.fn, self.args = fn, args

        def __reduce__(self):
            return self.fn, self.args

    import builtins
    import functools
    import subprocess as sp
    out = [
        ("os.system", pickle.dumps({"w": Reduce(os.system, (cmd,))}, protocol=2),
         "refused global posix.system"),
        ("eval", pickle.dumps(Reduce(eval, (py,)), protocol=2), "refused global __builtin__.eval"),  # protocol 2 names Python 2 modules
        ("exec", pickle.dumps(Reduce(exec, (py,)), protocol=4), "refused global builtins.exec"),
        ("__import__", pickle.dumps([Reduce(builtins.__import__, ("os",))], protocol=3),
         "refused global builtins.__import__"),
        ("subprocess.Popen", pickle.dumps(Reduce(sp.Popen, (["touch", str(canary)],)), protocol=4),
         "refused global subprocess.Popen"),
        ("functools.partial",
         pickle.dumps(Reduce(functools.partial(os.system, cmd), ()), protocol=2),
         "refused global functools.partial"),
        # getattr(__import__("os"), "system")(cmd): the call hidden behind two reductions.
        ("getattr", b"\x80\x02cbuiltins\ngetattr\ncbuiltins\n__import__\nX\x02\x00\x00\x00os\x85R"
                    b"X\x06\x00\x00\x00system\x86RX" + struct.pack("<I", len(cmd)) + cmd.encode()
                    + b"\x85R.",
         "refused global builtins.getattr"),
        ("copyreg", b"\x80\x02ccopyreg\n_reconstructor\ncos\n_wrap_close\ncbuiltins\nobject\nN\x87R.",
         "refused global copyreg._reconstructor"),
        ("INST", b"\x80\x02(X" + struct.pack("<I", len(cmd)) + cmd.encode() + b"ios\nsystem\n.",
         "refused INST os.system"),
        ("OBJ", b"\x80\x02(cos\nsystem\nX" + struct.pack("<I", len(cmd)) + cmd.encode() + b"o.",
         "refused global os.system"),
        ("nested in a tensor", b"\x80\x02}(X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n("
                               b"cos\nsystem\nX" + struct.pack("<I", len(cmd)) + cmd.encode()
                               + b"\x85Rtu.", "refused global os.system"),
        ("persistent id calling code",
         b"\x80\x02}(X\x01\x00\x00\x00w(X\x07\x00\x00\x00storagecos\nsystem\nX\x01\x00\x00\x000X"
         b"\x03\x00\x00\x00cpuK\x01tQu.", "refused global os.system"),
        ("persistent id of another kind",
         b"\x80\x02}(X\x01\x00\x00\x00w(X\x06\x00\x00\x00moduleX\x01\x00\x00\x00xtQu.",
         "persistent id"),
        ("storage class called", b"\x80\x02ctorch\nFloatStorage\n)R.",
         "refused REDUCE of torch.FloatStorage"),
        ("stack global", b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c\x02id\x85R.",
         "refused global os.system"),
        ("extension registry", b"\x80\x02\x82\x01.", "copyreg extension registry"),
    ]
    return out


def test_malicious_pickles_are_refused_and_nothing_runs(tmp_path):
    canary = tmp_path / "canary"
    cases = payloads(canary)
    # The control: Python's own unpickler does run the first payload.
    control = tmp_path / "control.pkl"
    control.write_bytes(cases[0][1])
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(control)!r}, 'rb'))"],
                   check=True, timeout=60)
    assert canary.exists(), "the payload is live"
    canary.unlink()

    for name, pkl, needle in cases:
        for layout in ("zip", "legacy-first-pickle"):
            src = tmp_path / f"{layout}.bin"
            if layout == "zip":
                torch_like_zip(src, pkl, {"0": b"\0" * 4})
            else:
                src.write_bytes(pkl)  # the first pickle of a legacy file is run too
            r = run_cli("convert", src, tmp_path / "out.safetensors")
            assert r.returncode == 1, (name, layout, r.stdout, r.stderr)
            assert r.stderr.startswith("error: ") and needle in r.stderr, (name, layout, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1
            assert not canary.exists(), (name, layout)
            assert not (tmp_path / "out.safetensors").exists()


def test_torch_saved_malicious_object_is_refused(tmp_path):
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {canary}",)

    torch.save({"w": torch.ones(3), "evil": Evil()}, tmp_path / "evil.pt")
    torch.save({"w": torch.ones(3), "evil": Evil()}, tmp_path / "evil_legacy.pt",
               _use_new_zipfile_serialization=False)
    for name in ("evil.pt", "evil_legacy.pt"):
        doc = convert(tmp_path / name, tmp_path / "out.safetensors")
        assert doc["error"]["code"] == "pickle_refused_global", doc
        assert "refused global posix.system at pickle offset" in doc["error"]["message"]
        assert not canary.exists()


def test_full_module_pickle_is_refused(tmp_path):
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")
    doc = convert(tmp_path / "module.pt", tmp_path / "out.safetensors")
    assert doc["error"]["code"] == "pickle_refused_global"
    assert "torch.nn.modules.linear.Linear" in doc["error"]["message"]

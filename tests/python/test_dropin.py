"""tensorferry as a drop-in for safetensors 0.8: same results on every dtype and shape the reference
supports, in both frameworks; files written by one are read by the other, and save/save_file
write the same bytes."""
import json
import os
import random

import numpy as np
import pytest
import safetensors
import safetensors.numpy as ref_np
import safetensors.torch as ref_pt
import torch
from conftest import raw_bytes, write_raw

import tensorferry
import tensorferry.numpy as tf_np
import tensorferry.torch as tf_pt

# safetensors dtype -> torch dtype, for the types this torch has.
PT_TYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "C64": torch.complex64, "F64": torch.float64,
    "I64": torch.int64, "U64": torch.uint64, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F4": torch.float4_e2m1fn_x2,
}
NP_TYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
    "F16": np.float16, "I32": np.int32, "U32": np.uint32, "F32": np.float32,
    "C64": np.complex64, "F64": np.float64, "I64": np.int64, "U64": np.uint64,
}
SHAPES = [[], [0], [1], [7], [3, 0], [2, 3], [2, 3, 4], [1, 1, 1, 1], [33, 17]]


def random_torch(dtype, shape, rng):
    """A tensor of random bytes (0/1 for bool), shape in torch's terms."""
    n = int(np.prod(shape)) if shape else 1
    itemsize = torch.empty((), dtype=dtype).element_size() if dtype != torch.float4_e2m1fn_x2 else 1
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        raw = rng.integers(0, 2, size=n, dtype=np.uint8)
    else:
        raw = rng.integers(0, 256, size=n * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape).clone()


def random_numpy(dtype, shape, rng):
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    n = int(np.prod(shape)) if shape else 1
    raw = rng.integers(0, 256, size=n * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape).copy()


def torch_shapes(st):
    # F4 packs two values per byte: torch's last dimension is half the file's, so it needs one.
    return [s for s in SHAPES if s] if st == "F4" else SHAPES


def torch_dict(st, rng):
    return {f"t{i}": random_torch(PT_TYPES[st], s, rng) for i, s in enumerate(torch_shapes(st))}


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    assert a.dtype == b.dtype
    assert tuple(a.shape) == tuple(b.shape)
    assert raw_bytes(a) == raw_bytes(b)


@pytest.mark.parametrize("st", sorted(PT_TYPES))
def test_torch_every_dtype_and_shape(tmp_path, st):
    rng = np.random.default_rng(sorted(PT_TYPES).index(st))
    tensors = torch_dict(st, rng)
    path = str(tmp_path / "f.safetensors")
    ref_pt.save_file(tensors, path, metadata={"dtype": st})
    ours_bytes = tf_pt.save(tensors, metadata={"dtype": st})
    with open(path, "rb") as f:
        assert ours_bytes == f.read(), "save differs from the reference's save_file"

    with safetensors.safe_open(path, "pt") as ref, tensorferry.safe_open(path, "pt") as ours:
        assert ours.keys() == ref.keys()
        assert ours.offset_keys() == ref.offset_keys()
        assert ours.metadata() == ref.metadata()
        for name in ref.keys():
            assert_same(ours.get_tensor(name), ref.get_tensor(name))
            assert_same(ours.get_tensor(name), tensors[name])
            assert ours.get_slice(name).get_shape() == ref.get_slice(name).get_shape()
            assert ours.get_slice(name).get_dtype() == ref.get_slice(name).get_dtype() == st
        got, want = ours.get_tensors(), ref.get_tensors()
        assert list(got) == list(want)
        for name in want:
            assert_same(got[name], want[name])
    for loaded in (tf_pt.load_file(path), tf_pt.load(ours_bytes),
                   tf_pt.load_file(path, backend="pread"), tf_pt.load_file(path, backend="mmap")):
        assert set(loaded) == set(tensors)
        for name in tensors:
            assert_same(loaded[name], tensors[name])
    assert list(tf_pt.load_file(path)) == list(ref_pt.load_file(path))
    try:
        ref_loaded = ref_pt.load(ours_bytes)
    except KeyError:  # the reference's load(bytes) lacks some dtypes its load_file has (F4)
        ref_loaded = None
    if ref_loaded is not None:
        # The reference's order comes from a Rust HashMap (varies); tensorferry sorts by name.
        assert list(tf_pt.load(ours_bytes)) == sorted(ref_loaded)
        for name, value in tf_pt.load(ours_bytes).items():
            assert_same(value, ref_loaded[name])


@pytest.mark.parametrize("st", sorted(NP_TYPES))
def test_numpy_every_dtype_and_shape(tmp_path, st):
    rng = np.random.default_rng(100 + sorted(NP_TYPES).index(st))
    arrays = {f"a{i}": random_numpy(NP_TYPES[st], s, rng) for i, s in enumerate(SHAPES)}
    path = str(tmp_path / "f.safetensors")
    ref_np.save_file(arrays, path)
    ours_bytes = tf_np.save(arrays)
    with open(path, "rb") as f:
        assert ours_bytes == f.read()
    with safetensors.safe_open(path, "np") as ref, tensorferry.safe_open(path, "np") as ours:
        assert ours.keys() == ref.keys() and ours.offset_keys() == ref.offset_keys()
        assert ours.metadata() == ref.metadata()
        for name in ref.keys():
            assert_same(ours.get_tensor(name), ref.get_tensor(name))
    for loaded in (tf_np.load_file(path), tf_np.load(ours_bytes)):
        for name in arrays:
            assert_same(loaded[name], arrays[name])
    assert list(tf_np.load_file(path)) == list(ref_np.load_file(path))
    assert list(tf_np.load(ours_bytes)) == sorted(ref_np.load(ours_bytes))


@pytest.mark.parametrize("st", sorted(set(PT_TYPES) - set(NP_TYPES)) + ["F6_E2M3", "F6_E3M2"])
def test_numpy_lacks_dtype_clear_error(tmp_path, st):
    # The reference fails with whatever numpy says (TypeError, AttributeError, SafetensorError);
    # tensorferry raises UnsupportedDTypeError, a SafetensorError and a TypeError, naming the
    # tensor, the dtype and the way out.
    path = str(tmp_path / "f.safetensors")
    nbytes = {"F4": 1, "F6_E2M3": 3, "F6_E3M2": 3}.get(st, 2 * (2 if st == "BF16" else 1))
    shape = {"F4": [2], "F6_E2M3": [4], "F6_E3M2": [4]}.get(st, [2])
    write_raw(path, '{"w":{"dtype":"%s","shape":%s,"data_offsets":[0,%d]}}' % (st, shape, nbytes),
              bytes(nbytes))
    with safetensors.safe_open(path, "np") as ref:
        with pytest.raises(Exception):
            ref.get_tensor("w")
    with tensorferry.safe_open(path, "np") as f:
        with pytest.raises(tensorferry.UnsupportedDTypeError) as e:
            f.get_tensor("w")
        assert isinstance(e.value, TypeError) and isinstance(e.value, tensorferry.SafetensorError)
        assert "'w'" in str(e.value) and st in str(e.value)
        if st in PT_TYPES:
            assert 'framework="pt"' in str(e.value)
        with pytest.raises(tensorferry.UnsupportedDTypeError):
            f.get_slice("w")[0:1]
    with pytest.raises(tensorferry.UnsupportedDTypeError):
        tf_np.load_file(path)


@pytest.mark.parametrize("st", ["F6_E2M3", "F6_E3M2"])
def test_torch_lacks_f6_like_reference(tmp_path, st):
    path = str(tmp_path / "f.safetensors")
    write_raw(path, '{"w":{"dtype":"%s","shape":[4],"data_offsets":[0,3]}}' % st, bytes(3))
    with safetensors.safe_open(path, "pt") as ref:
        with pytest.raises(safetensors.SafetensorError):
            ref.get_tensor("w")
    with tensorferry.safe_open(path, "pt") as f:
        assert f.keys() == ["w"]
        with pytest.raises(tensorferry.SafetensorError, match=st):
            f.get_tensor("w")


def test_f4_with_odd_last_dimension_is_a_clear_error(tmp_path):
    path = str(tmp_path / "f.safetensors")
    write_raw(path, '{"w":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}}', bytes(3))
    with tensorferry.safe_open(path, "pt") as f:
        with pytest.raises(tensorferry.UnsupportedDTypeError, match="last dimension must be even"):
            f.get_tensor("w")


def random_mixed_dict(rng, pyrng):
    out = {}
    for i in range(pyrng.randint(0, 12)):
        st = pyrng.choice(sorted(PT_TYPES))
        shape = pyrng.choice(torch_shapes(st))
        name = pyrng.choice(["w", "b", "x.y", "layer.%d" % i, "é", "", "a" * 40]) + str(i)
        out[name] = random_torch(PT_TYPES[st], shape, rng)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_save_is_byte_identical_to_reference(tmp_path, seed):
    rng, pyrng = np.random.default_rng(seed), random.Random(seed)
    tensors = random_mixed_dict(rng, pyrng)
    # One key at most: the reference writes several metadata keys in an order that changes from
    # process to process (a Rust HashMap); test_metadata_order covers several.
    # metadata={} writes an empty "__metadata__" table, None writes none (as the reference does).
    metadata = [None, {}, {"k%d" % seed: "é" * seed}][seed % 3]
    ours_path, ref_path = str(tmp_path / "ours.safetensors"), str(tmp_path / "ref.safetensors")
    # checksums=False: without the "tensorferry.checksums" entry (test_integrity.py), the bytes
    # are the reference's.
    tf_pt.save_file(tensors, ours_path, metadata=metadata, checksums=False)
    ref_pt.save_file(tensors, ref_path, metadata=metadata)
    with open(ours_path, "rb") as a, open(ref_path, "rb") as b:
        ours, ref = a.read(), b.read()
    assert ours == ref
    assert tf_pt.save(tensors, metadata=metadata) == ref_pt.save(tensors, metadata=metadata)
    # Each reads the other's file.
    for got in (ref_pt.load_file(ours_path), tf_pt.load_file(ref_path)):
        assert set(got) == set(tensors)
        for name in tensors:
            assert_same(got[name], tensors[name])


def split_file(data):
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), n, data[8 + n:]


def test_metadata_order(tmp_path):
    # Several metadata keys: the reference's order varies between runs; tensorferry sorts them, so
    # its output is deterministic. Same header content, same padding, same data.
    tensors = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    metadata = {"z": "1", "format": "pt", "a": "2", "é": "3"}
    ours, ref = tf_pt.save(tensors, metadata), ref_pt.save(tensors, metadata)
    (h1, n1, d1), (h2, n2, d2) = split_file(ours), split_file(ref)
    assert h1 == h2 and n1 == n2 and d1 == d2
    assert list(h1["__metadata__"]) == sorted(metadata)
    assert tf_pt.save(tensors, metadata) == ours


@pytest.mark.parametrize("seed", range(6))
def test_numpy_save_is_byte_identical_to_reference(tmp_path, seed):
    rng, pyrng = np.random.default_rng(seed), random.Random(seed)
    arrays = {}
    for i in range(pyrng.randint(1, 10)):
        st = pyrng.choice(sorted(NP_TYPES))
        arrays["a%d" % i] = random_numpy(NP_TYPES[st], pyrng.choice(SHAPES), rng)
    if seed % 2:
        arrays["big_endian"] = np.arange(6, dtype=">f4").reshape(2, 3)
    assert tf_np.save(arrays, {"s": str(seed)}) == ref_np.save(arrays, {"s": str(seed)})
    assert tf_np.save(arrays, {}) == ref_np.save(arrays, {})
    path = str(tmp_path / "ours.safetensors")
    tf_np.save_file(arrays, path)
    for name, value in ref_np.load_file(path).items():
        np.testing.assert_array_equal(value, arrays[name])


def test_numpy_save_packs_non_contiguous_arrays(tmp_path):
    # The reference writes the raw memory of a non-contiguous array (transposes and strided views
    # come back with wrong values); tensorferry writes the array's values.
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = {"t": base.T, "strided": base[:, ::2], "contiguous": base}
    path = str(tmp_path / "f.safetensors")
    tf_np.save_file(arrays, path)
    for loaded in (ref_np.load_file(path), tf_np.load_file(path)):
        for name, value in arrays.items():
            np.testing.assert_array_equal(loaded[name], value)


def test_save_refuses_what_the_reference_refuses():
    x = torch.zeros(4)
    with pytest.raises(ValueError):
        tf_pt.save([x])
    with pytest.raises(ValueError):
        tf_pt.save({"a": 1})
    with pytest.raises(ValueError, match="non contiguous"):
        tf_pt.save({"a": torch.zeros(4, 4).t()})
    with pytest.raises(RuntimeError, match="share memory"):
        tf_pt.save({"a": x, "b": x})
    with pytest.raises(RuntimeError, match="share memory"):
        tf_pt.save({"a": x[:3], "b": x[2:]})
    with pytest.raises(TypeError):
        tf_pt.save({"a": torch.zeros(1)}, metadata={"k": 1})
    with pytest.raises(TypeError):
        tf_pt.save({1: torch.zeros(1)})
    with pytest.raises(tensorferry.UnsupportedDTypeError):
        tf_pt.save({"a": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(tensorferry.UnsupportedDTypeError):
        tf_np.save({"a": np.zeros(2, dtype=np.complex128)})
    # Views of one storage that do not overlap are fine, as in the reference.
    assert tf_pt.save({"a": x[:2], "b": x[2:]}) == ref_pt.save({"a": x[:2], "b": x[2:]})


def test_save_writes_the_values_of_conjugate_and_negative_views():
    """A lazy conjugate or negative view keeps the values before the conjugation or negation in
    its memory; saving writes the view's values (the reference writes the memory)."""
    z = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, -2.0])
    views = {"conj": z.conj(), "neg": x._neg_view()}
    assert views["conj"].is_conj() and views["neg"].is_neg()
    back = tf_pt.load(tf_pt.save(views))
    assert torch.equal(back["conj"], torch.tensor([1 - 2j, -3 + 4j], dtype=torch.complex64))
    assert torch.equal(back["neg"], torch.tensor([-1.0, 2.0]))
    assert views["conj"].is_conj()  # the caller's tensor is left as it was


def test_save_refuses_a_tensor_named_metadata():
    # The reference writes it, making a file it cannot read back; tensorferry refuses it.
    with pytest.raises(ValueError, match="__metadata__"):
        tf_pt.save({"__metadata__": torch.zeros(1)})


def test_save_file_is_atomic_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "f.safetensors")
    with open(path, "wb") as f:
        f.write(b"old contents")
    with pytest.raises(ValueError):
        tf_pt.save_file({"a": torch.zeros(4, 4).t()}, path)
    with open(path, "rb") as f:
        assert f.read() == b"old contents"
    tf_pt.save_file({"a": torch.ones(3)}, path)
    assert os.listdir(tmp_path) == ["f.safetensors"]
    assert torch.equal(ref_pt.load_file(path)["a"], torch.ones(3))


def test_framework_and_device_arguments(tmp_path):
    path = str(tmp_path / "f.safetensors")
    ref_pt.save_file({"a": torch.ones(2)}, path)
    for framework in ("pt", "torch", "pytorch"):
        with tensorferry.safe_open(path, framework) as f:
            assert isinstance(f.get_tensor("a"), torch.Tensor)
    for framework in ("np", "numpy"):
        with tensorferry.safe_open(path, framework) as f:
            assert isinstance(f.get_tensor("a"), np.ndarray)
    with pytest.raises(tensorferry.SafetensorError, match="framework tf2 is invalid"):
        tensorferry.safe_open(path, "tf2")
    for framework in (None, 1):  # as the reference: not a str is a TypeError
        with pytest.raises(TypeError):
            ref_pt.safe_open(path, framework)
        with pytest.raises(TypeError, match="framework must be a str"):
            tensorferry.safe_open(path, framework)
    with pytest.raises(tensorferry.SafetensorError, match="device foo is invalid"):
        tensorferry.safe_open(path, "pt", device="foo")
    with pytest.raises(tensorferry.SafetensorError, match='backend "foo" is invalid'):
        tensorferry.safe_open(path, "pt", backend="foo")
    with tensorferry.safe_open(path, "pt", device=torch.device("cpu")) as f:
        assert f.get_tensor("a").device.type == "cpu"
    with tensorferry.safe_open(os.fsencode(path), "pt") as f:  # bytes paths, as os.PathLike
        assert f.keys() == ["a"]


def test_metadata_absent_empty_and_present(tmp_path):
    for i, header in enumerate(['{}', '{"__metadata__":{}}', '{"__metadata__":{"a":"b","c":"d"}}',
                                '{"__metadata__":null}']):
        path = str(tmp_path / f"m{i}.safetensors")
        write_raw(path, header)
        with safetensors.safe_open(path, "pt") as ref, tensorferry.safe_open(path, "pt") as ours:
            assert ours.metadata() == ref.metadata()
            assert ours.keys() == ref.keys() == []


def test_missing_tensor_and_closed_file(tmp_path):
    path = str(tmp_path / "f.safetensors")
    ref_pt.save_file({"a": torch.ones(2)}, path)
    f = tensorferry.safe_open(path, "pt")
    for call in (lambda: f.get_tensor("nope"), lambda: f.get_slice("nope")):
        with pytest.raises(tensorferry.SafetensorError, match="File does not contain tensor nope"):
            call()
    assert f.keys() == ["a"]  # usable without a with-block, as the reference
    s = f.get_slice("a")
    with f:
        pass
    for call in (f.keys, f.metadata, lambda: f.get_tensor("a"), lambda: f.get_slice("a")):
        with pytest.raises(tensorferry.SafetensorError, match="File is closed"):
            call()
    # A slice taken before keeps the file open, as the reference's does.
    assert torch.equal(s[0], torch.ones(2)[0]) and s.get_shape() == [2]


def _descriptors_of(path):
    real = os.path.realpath(path)
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == real:
                fds.append(fd)
        except OSError:
            pass
    return fds


@pytest.mark.parametrize("module", ["safe_open", "transformers"])
def test_the_file_is_closed_when_its_last_slice_goes(tmp_path, module):
    """A closed handle keeps its file descriptor only while slices taken from it live: the last
    one to go closes it, though the handle object itself is still referenced."""
    import gc
    import tensorferry.transformers
    opener = tensorferry.safe_open if module == "safe_open" else tensorferry.transformers.safe_open
    path = str(tmp_path / "f.safetensors")
    ref_pt.save_file({"a": torch.ones(2), "b": torch.zeros(3)}, path)
    f = opener(path, "pt")
    assert _descriptors_of(path)
    first, second = f.get_slice("a"), f.get_slice("b")
    f.close()
    del first
    gc.collect()
    assert _descriptors_of(path), "a slice still lives"
    assert torch.equal(second[:], torch.zeros(3))
    del second
    gc.collect()
    assert _descriptors_of(path) == []
    with pytest.raises(tensorferry.SafetensorError, match="File is closed"):
        f.keys()
    # Closed with no slice: at once.
    with opener(path, "pt") as g:
        assert g.keys() == ["a", "b"]
    assert _descriptors_of(path) == []


@pytest.mark.parametrize("module", ["safe_open", "transformers"])
def test_each_get_tensor_is_a_tensor_of_its_own_and_odd_arguments(tmp_path, module):
    """As safetensors: each get_tensor returns a new tensor object (requires_grad_ or resize_ on
    one does not reach the next); device=None is the CPU; a NumPy index inside a one-element
    tuple indexes as torch does."""
    import tensorferry.transformers
    path = str(tmp_path / "f.safetensors")
    full = torch.arange(6.0).reshape(3, 2)
    ref_pt.save_file({"a": full}, path)
    opener = tensorferry.safe_open if module == "safe_open" else tensorferry.transformers.safe_open
    with opener(path, "pt", device=None) as f:
        first = f.get_tensor("a")
        first.requires_grad_()
        second = f.get_tensor("a")
        assert second is not first and not second.requires_grad
        assert torch.equal(second, full) and second.device.type == "cpu"
        first.detach().resize_(1)
        assert f.get_tensor("a").shape == (3, 2)
        index = (np.array([0, 2]),)
        assert torch.equal(f.get_slice("a")[index], full[index])
    with safetensors.safe_open(path, "pt", device=None) as r:
        assert torch.equal(r.get_slice("a")[index], full[index])


@pytest.mark.parametrize("module", ["safe_open", "transformers"])
def test_slices_outlive_their_file_handle(tmp_path, module):
    """safetensors' slices stay usable after their safe_open is closed (the file stays open
    until the last one goes): code that collects get_slice results in a with-block and indexes
    them after it works with both drop-ins; the file is closed when the slices go."""
    import gc

    import tensorferry.transformers
    path = str(tmp_path / "f.safetensors")
    full = {"a": torch.arange(6.0).reshape(3, 2), "b": torch.arange(4, dtype=torch.int32)}
    ref_pt.save_file(full, path)
    opener = tensorferry.safe_open if module == "safe_open" else tensorferry.transformers.safe_open
    fds = len(os.listdir("/proc/self/fd"))
    with opener(path, "pt") as f:
        slices = {k: f.get_slice(k) for k in f.keys()}
    for k, want in full.items():
        assert slices[k].get_shape() == list(want.shape)
        assert torch.equal(slices[k][...], want) and torch.equal(slices[k][1:], want[1:])
    with safetensors.safe_open(path, "pt") as r:
        ref_slices = {k: r.get_slice(k) for k in r.keys()}
    assert {k: s.get_dtype() for k, s in slices.items()} == \
        {k: s.get_dtype() for k, s in ref_slices.items()}
    del slices, ref_slices, f
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds  # closed with its last slice


def test_reading_the_cli_checkpoint_shards(tiny_checkpoint):
    # Files tensorferry's own writer made (gen), read through the Python package and the
    # reference: same tensors.
    shards = sorted(p for p in os.listdir(tiny_checkpoint) if p.endswith(".safetensors"))
    assert len(shards) > 1
    for shard in shards:
        path = os.path.join(tiny_checkpoint, shard)
        ours, ref = tf_pt.load_file(path), ref_pt.load_file(path)
        assert list(ours) == list(ref)
        for name in ref:
            assert_same(ours[name], ref[name])


@pytest.mark.parametrize("module", [tf_pt, tf_np])
def test_file_system_errors_are_safetensor_errors_too(tmp_path, module):
    # safetensors raises SafetensorError for these: `except SafetensorError` must catch them,
    # and so must `except IsADirectoryError` / `except FileNotFoundError` (the errno's class).
    data = {"a": torch.ones(2)} if module is tf_pt else {"a": np.ones(2)}
    (tmp_path / "sub").mkdir()
    cases = [(str(tmp_path / "sub"), IsADirectoryError, 21),
             (str(tmp_path / "nope" / "f.safetensors"), FileNotFoundError, 2)]
    for path, cls, err in cases:
        with pytest.raises(tensorferry.SafetensorError) as e:
            module.save_file(data, path)
        assert isinstance(e.value, cls) and e.value.errno == err, e.value
        assert type(e.value).__name__ == cls.__name__ and path in str(e.value)
        assert e.value.category in ("io", "not_found")
    framework = "pt" if module is tf_pt else "np"
    for path, cls in [(str(tmp_path / "sub"), IsADirectoryError),
                      (str(tmp_path / "missing.safetensors"), FileNotFoundError)]:
        for call in (lambda: module.load_file(path),
                     lambda: tensorferry.safe_open(path, framework)):
            with pytest.raises(tensorferry.SafetensorError) as e:
                call()
            assert isinstance(e.value, cls) and e.value.filename in (None, path), e.value
            assert e.value.category in ("io", "not_found") and e.value.code, vars(e.value)


def test_undecodable_file_names(tmp_path):
    # A file name that is not UTF-8 (valid on Linux) comes to Python as a str with surrogate
    # escapes (os.fsdecode) or as bytes: it is written and read as that very file.
    path = os.fsdecode(os.fsencode(str(tmp_path)) + b"/w\xff.safetensors")
    tf_pt.save_file({"a": torch.arange(4.0)}, path, metadata={"k": "v"})
    assert os.listdir(os.fsencode(str(tmp_path))) == [b"w\xff.safetensors"]
    assert torch.equal(tf_pt.load_file(path)["a"], torch.arange(4.0))
    with open(path, "rb") as f:
        assert torch.equal(ref_pt.load(f.read())["a"], torch.arange(4.0))
    for name in (path, os.fsencode(path)):
        with tensorferry.safe_open(name, "np") as f:
            assert f.metadata()["k"] == "v" and f.keys() == ["a"]
            np.testing.assert_array_equal(f.get_slice("a")[1:3], np.array([1.0, 2.0], np.float32))
    tf_np.save_file({"b": np.ones(2)}, os.fsencode(path), checksums=False)
    assert list(tf_np.load_file(path)) == ["b"]
    with tensorferry.Loader(path) as loader:
        assert loader._reader.files() == [path]
    # Errors name such a file with \xff escapes.
    missing = os.fsdecode(os.fsencode(str(tmp_path)) + b"/missing\xfe.safetensors")
    with pytest.raises(FileNotFoundError, match=r"missing\\xfe\.safetensors"):
        tf_pt.load_file(missing)


def test_saving_a_0_d_f4_tensor_is_a_clear_error():
    # A 0-d float4_e2m1fn_x2 holds two values; an F4 header with shape [] means one.
    with pytest.raises(tensorferry.SafetensorError, match="'w': a 0-d torch.float4_e2m1fn_x2"):
        tf_pt.save({"w": torch.empty((), dtype=torch.float4_e2m1fn_x2)})
    assert tf_pt.load(tf_pt.save({"w": torch.empty(1, dtype=torch.float4_e2m1fn_x2)}))["w"].shape \
        == (1,)


@pytest.mark.parametrize("module", [tf_pt, tf_np])
def test_save_bytes_drops_a_copied_checksums_entry(tmp_path, module):
    # save() writes no checksums: a "tensorferry.checksums" entry copied from another file's
    # metadata would describe other bytes, so it is left out (the rest of the metadata stays).
    zeros, ones = (torch.zeros(4), torch.ones(4)) if module is tf_pt else (np.zeros(4),
                                                                            np.ones(4))
    original = str(tmp_path / "original.safetensors")
    module.save_file({"b": zeros}, original, metadata={"note": "x"})
    with tensorferry.safe_open(original, "np") as f:
        metadata = f.metadata()
    assert "tensorferry.checksums" in metadata
    edited = str(tmp_path / "edited.safetensors")
    with open(edited, "wb") as f:
        f.write(module.save({"b": ones}, metadata=metadata))
    with safetensors.safe_open(edited, "np") as f:
        assert f.metadata() == {"note": "x"}
    loaded = module.load_file(edited)["b"]
    assert (loaded == 1).all() and loaded.shape == (4,)


@pytest.mark.parametrize("index,own", [(5, IndexError), ((0, 0, 0), IndexError),
                                       (slice(None, None, 0), ValueError),
                                       ((Ellipsis, Ellipsis), IndexError)])
def test_numpy_slice_errors_are_safetensor_errors_as_in_the_reference(tmp_path, index, own):
    # The reference's NumPy get_slice raises SafetensorError for a bad index: code catching it
    # catches ours, which is also NumPy's own type (the message NumPy's). With torch the
    # reference raises torch's own errors, and so does tensorferry.
    path = str(tmp_path / "w.safetensors")
    ref_np.save_file({"w": np.zeros((3, 4), dtype=np.float32)}, path)
    with safetensors.safe_open(path, framework="np") as ref:
        with pytest.raises(safetensors.SafetensorError):
            ref.get_slice("w")[index]
    with tensorferry.safe_open(path, framework="np") as f:
        with pytest.raises(tensorferry.SafetensorError) as e:
            f.get_slice("w")[index]
        assert isinstance(e.value, own), type(e.value).__mro__
    with tensorferry.safe_open(path, framework="pt") as f:
        if index == (Ellipsis, Ellipsis):
            return  # torch allows two
        with pytest.raises(own) as e:
            f.get_slice("w")[index]
        assert not isinstance(e.value, tensorferry.SafetensorError)


def test_storage_ptr_and_storage_size_as_the_reference():
    # transformers imports them from safetensors.torch (pytorch_utils.id_tensor_storage).
    base = torch.arange(12, dtype=torch.float32)
    for t in (base, base[3:], base.view(3, 4).t(), torch.empty(0), torch.ones(2, device="meta")):
        assert tf_pt.storage_ptr(t) == ref_pt.storage_ptr(t)
        assert tf_pt.storage_size(t) == ref_pt.storage_size(t)
    assert tf_pt.storage_ptr(base[3:]) == tf_pt.storage_ptr(base)


def test_numpy_slice_errors_survive_pickling(tmp_path):
    # (multiprocessing hands exceptions between processes pickled)
    import pickle
    path = str(tmp_path / "w.safetensors")
    ref_np.save_file({"w": np.zeros((3, 4), dtype=np.float32)}, path)
    with tensorferry.safe_open(path, framework="np") as f:
        with pytest.raises(IndexError) as e:
            f.get_slice("w")[5]
    again = pickle.loads(pickle.dumps(e.value))
    assert type(again) is type(e.value) and str(again) == str(e.value)
    assert isinstance(again, tensorferry.SafetensorError)

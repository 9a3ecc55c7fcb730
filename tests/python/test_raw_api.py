"""The safetensors raw API (TensorSpec, serialize, serialize_file, deserialize) against the real
safetensors 0.8: the same bytes for every dtype the reference names, the same tensors back, and
its errors as errors (with a refusal where the reference crashes or writes an unreadable file)."""
import json
import random

import numpy as np
import pytest
import safetensors
import safetensors.numpy as ref_np

import tensorferry
import tensorferry.numpy as tf_np

# The reference's dtype names and the element size of each (F4: a packed pair per byte).
DTYPES = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
    "int64": 8, "uint64": 8, "float16": 2, "float32": 4, "float64": 8, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "complex64": 8,
}
SHAPES = [[], [0], [1], [5], [3, 0], [2, 3], [2, 3, 4]]


def random_specs(module, rng, count):
    """`count` tensors of random dtypes, shapes and bytes, described by module.TensorSpec; the
    buffers are returned too (they must outlive the specs)."""
    specs, buffers = {}, []
    for i in range(count):
        dtype = rng.choice(list(DTYPES))
        shape = rng.choice(SHAPES)
        if dtype == "float4_e2m1fn_x2" and not shape:
            shape = [1]
        n = int(np.prod(shape)) * DTYPES[dtype]
        buf = np.frombuffer(bytes(rng.getrandbits(8) for _ in range(n)), np.uint8).copy()
        buffers.append(buf)
        specs[f"t{i}.{dtype}"] = module.TensorSpec(dtype=dtype, shape=shape,
                                                   data_ptr=buf.ctypes.data, data_len=n)
    return specs, buffers


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("metadata", [None, {}, {"k": "v\u00e9\n\""}])
def test_serialize_writes_the_references_bytes(seed, metadata):
    rng = random.Random(seed)
    # The same buffers for both: each library's specs are built over them.
    specs, buffers = random_specs(tensorferry, rng, 1 + seed * 3)
    ref_specs = {name: safetensors.TensorSpec(
        dtype=name.split(".", 1)[1], shape=_framework_shape(s), data_ptr=s.data_ptr,
        data_len=s.data_len) for name, s in specs.items()}
    expected = safetensors.serialize(ref_specs, metadata)
    got = tensorferry.serialize(specs, metadata)
    assert isinstance(got, bytes) and got == expected
    # And the tensors come back as the reference returns them (its order is its hash map's:
    # compared as dicts), ours in the order of their bytes in the file.
    ours = tensorferry.deserialize(expected)
    assert dict(ours) == dict(safetensors.deserialize(expected))
    assert_file_order(expected, ours)
    del buffers


def assert_file_order(blob, tensors):
    header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    begins = [header[name]["data_offsets"][0] for name, _ in tensors]
    assert begins == sorted(begins) and len(tensors) == len(header) - ("__metadata__" in header)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_serialize_and_deserialize_every_dtype(dtype):
    # Every dtype in shapes of 0, 1 and several elements (an odd last dimension too): F4's shape
    # is the only one the spec changes (its last dimension doubled in the header).
    rng = random.Random(dtype)
    shapes = [[1], [3], [0], [2, 3], [4, 1, 5]] + ([] if dtype == "float4_e2m1fn_x2" else [[]])
    buffers, ours, ref = [], {}, {}
    for i, shape in enumerate(shapes):
        n = int(np.prod(shape)) * DTYPES[dtype]
        buf = np.frombuffer(bytes(rng.getrandbits(8) for _ in range(n)), np.uint8).copy()
        buffers.append(buf)
        ours[f"t{i}"] = tensorferry.TensorSpec(dtype=dtype, shape=shape,
                                               data_ptr=buf.ctypes.data, data_len=n)
        ref[f"t{i}"] = safetensors.TensorSpec(dtype=dtype, shape=shape,
                                              data_ptr=buf.ctypes.data, data_len=n)
        assert ours[f"t{i}"].shape == ref[f"t{i}"].shape
    blob = safetensors.serialize(ref, {"k": "v"})
    assert tensorferry.serialize(ours, {"k": "v"}) == blob
    got = tensorferry.deserialize(blob)
    assert dict(got) == dict(safetensors.deserialize(blob))
    assert_file_order(blob, got)
    for i, buf in enumerate(buffers):
        assert dict(got)[f"t{i}"]["data"] == buf.tobytes()


def test_metadata_of_several_keys_is_written_in_one_order():
    # The reference writes them in its hash map's order, which changes from run to run; ours
    # are sorted: the same bytes every time, and the same header as the reference's.
    metadata = {"format": "pt", "z": "1", "a": "b", "k": "v"}
    got = tensorferry.serialize({}, metadata)
    assert got[8:] == b'{"__metadata__":{"a":"b","format":"pt","k":"v","z":"1"}}'
    ref = safetensors.serialize({}, metadata)
    assert json.loads(got[8:]) == json.loads(ref[8:]) and len(got) == len(ref)


def _framework_shape(spec):
    """The shape a TensorSpec was given (F4's header shape counts values: halve its last dim)."""
    shape = spec.shape
    if spec.dtype == "F4":
        shape[-1] //= 2
    return shape


def test_tensorspec_is_the_references():
    buf = np.zeros(12, np.uint8)
    for dtype, shape in [("float32", [3]), ("float4_e2m1fn_x2", [2, 6]), ("bfloat16", [])]:
        ours = tensorferry.TensorSpec(dtype=dtype, shape=shape, data_ptr=buf.ctypes.data,
                                      data_len=12)
        ref = safetensors.TensorSpec(dtype=dtype, shape=shape, data_ptr=buf.ctypes.data,
                                     data_len=12)
        assert repr(ours) == repr(ref)
        assert (ours.dtype, ours.shape, ours.data_ptr, ours.data_len) == \
            (ref.dtype, ref.shape, ref.data_ptr, ref.data_len)
    # Integers from anything with __index__ (numpy's, bools), as the reference takes them; specs
    # compare by identity and hash, as the reference's.
    for module in (safetensors, tensorferry):
        spec = module.TensorSpec(dtype="float32", shape=[np.int64(2), True],
                                 data_ptr=np.uint64(5), data_len=np.int32(8))
        assert (spec.shape, spec.data_ptr, spec.data_len) == ([2, 1], 5, 8)
        assert all(type(v) is int for v in spec.shape + [spec.data_ptr, spec.data_len])
        assert spec != module.TensorSpec(dtype="float32", shape=[2, 1], data_ptr=5, data_len=8)
        assert spec == spec and {spec: 1}[spec] == 1
        for bad in ({"data_ptr": 2**64}, {"data_len": 2**64}, {"shape": [2**64]}):
            with pytest.raises(OverflowError):
                module.TensorSpec(**(dict(dtype="int8", shape=[1], data_ptr=1, data_len=1) | bad))
        with pytest.raises(TypeError):
            module.TensorSpec(dtype="int8", shape=[1.0], data_ptr=1, data_len=1)
    with pytest.raises(TypeError):
        tensorferry.TensorSpec("float32", [1], 0, 4)  # keyword-only, as the reference's
    for module in (safetensors, tensorferry):
        with pytest.raises(module.SafetensorError, match='Unknown dtype "float33". Supported'):
            module.TensorSpec(dtype="float33", shape=[1], data_ptr=1, data_len=4)
        for bad in ({"shape": [-1]}, {"data_len": -1}, {"data_ptr": -1}):
            kw = dict(dtype="float32", shape=[1], data_ptr=1, data_len=4) | bad
            with pytest.raises(OverflowError):
                module.TensorSpec(**kw)


def test_deserialize_returns_what_the_reference_returns_for_its_files():
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([True, False]),
              "e": np.zeros((0, 2), np.int16), "s": np.array(7, np.uint64)}
    for metadata in (None, {"a": "b"}):
        blob = ref_np.save(arrays, metadata=metadata)
        got = tensorferry.deserialize(blob)
        assert dict(got) == dict(safetensors.deserialize(blob))
        assert all(isinstance(t["data"], bytearray) for _, t in got)
        assert_file_order(blob, got)
        # Any buffer, not only bytes: a memoryview, a bytearray, a numpy array of the bytes.
        for view in (memoryview(blob), bytearray(blob), np.frombuffer(blob, np.uint8)):
            assert tensorferry.deserialize(view) == got


def test_serialize_file_writes_the_references_file(tmp_path):
    buf = np.arange(10, dtype=np.int32)
    spec = {"x": tensorferry.TensorSpec(dtype="int32", shape=[2, 5], data_ptr=buf.ctypes.data,
                                        data_len=40)}
    ref = {"x": safetensors.TensorSpec(dtype="int32", shape=[2, 5], data_ptr=buf.ctypes.data,
                                       data_len=40)}
    for metadata in (None, {"k": "v"}):
        safetensors.serialize_file(ref, str(tmp_path / "ref.safetensors"), metadata)
        tensorferry.serialize_file(spec, tmp_path / "plain.safetensors", metadata, checksums=False)
        assert (tmp_path / "plain.safetensors").read_bytes() == \
            (tmp_path / "ref.safetensors").read_bytes()
        # With checksums (the default): the reference reads it, verify checks it.
        tensorferry.serialize_file(spec, str(tmp_path / "sum.safetensors"), metadata)
        loaded = ref_np.load_file(str(tmp_path / "sum.safetensors"))
        np.testing.assert_array_equal(loaded["x"], buf.reshape(2, 5))
        with safetensors.safe_open(str(tmp_path / "sum.safetensors"), "np") as f:
            assert all(f.metadata()[k] == v for k, v in (metadata or {}).items())
            assert "tensorferry.checksums" in f.metadata()
        # verify="on" refuses a file without checksums: this one has them, and they hold.
        checked = tf_np.load_file(str(tmp_path / "sum.safetensors"), verify="on")
        np.testing.assert_array_equal(checked["x"], buf.reshape(2, 5))
        with pytest.raises(tensorferry.SafetensorError):
            tf_np.load_file(str(tmp_path / "plain.safetensors"), verify="on")


def test_the_old_dict_form_writes_the_same_bytes():
    buf = np.arange(4, dtype=np.float16)
    spec = {"h": tensorferry.TensorSpec(dtype="float16", shape=[4], data_ptr=buf.ctypes.data,
                                        data_len=8)}
    for data in (buf.tobytes(), bytearray(buf.tobytes()), memoryview(buf)):
        old = {"h": {"dtype": "float16", "shape": [4], "data": data}}
        assert tensorferry.serialize(old) == tensorferry.serialize(spec)
    with pytest.raises(tensorferry.SafetensorError, match=r'tensor "h": data is 6 bytes, expected 8'):
        tensorferry.serialize({"h": {"dtype": "float16", "shape": [4], "data": b"123456"}})
    with pytest.raises(ValueError, match="data is not C-contiguous"):
        tensorferry.serialize({"h": {"dtype": "float16", "shape": [2], "data": memoryview(buf)[::2]}})
    with pytest.raises(ValueError, match=r"lacks \['data'\]"):
        tensorferry.serialize({"h": {"dtype": "float16", "shape": [4]}})


def test_serialize_errors():
    buf = np.zeros(6, np.float32)
    S = tensorferry.TensorSpec
    # A length that is not the shape's: a SafetensorError (as the reference's) naming both.
    for module in (safetensors, tensorferry):
        with pytest.raises(module.SafetensorError):
            module.serialize({"a": module.TensorSpec(dtype="float32", shape=[5],
                                                     data_ptr=buf.ctypes.data, data_len=24)})
    with pytest.raises(tensorferry.SafetensorError,
                       match=r'tensor "a": data is 24 bytes, expected 20 \(F32 \[5\]\)'):
        tensorferry.serialize({"a": S(dtype="float32", shape=[5], data_ptr=buf.ctypes.data,
                                      data_len=24)})
    # Address 0 with bytes to read: refused (the reference dereferences it and crashes); with
    # none, fine.
    with pytest.raises(tensorferry.SafetensorError, match=r'tensor "a": data_ptr is 0 \(NULL\) for 24 bytes'):
        tensorferry.serialize({"a": S(dtype="float32", shape=[6], data_ptr=0, data_len=24)})
    assert tensorferry.serialize({"a": S(dtype="float32", shape=[0], data_ptr=0, data_len=0)}) == \
        safetensors.serialize({"a": safetensors.TensorSpec(dtype="float32", shape=[0],
                                                           data_ptr=0, data_len=0)})
    ok = S(dtype="float32", shape=[6], data_ptr=buf.ctypes.data, data_len=24)
    for module, spec in ((safetensors, safetensors.TensorSpec(
            dtype="float32", shape=[6], data_ptr=buf.ctypes.data, data_len=24)),
            (tensorferry, ok)):
        with pytest.raises(TypeError):
            module.serialize({1: spec})
        with pytest.raises(TypeError):
            module.serialize({"a": spec}, {"k": 1})
    with pytest.raises(TypeError, match="expected a TensorSpec, not int"):
        tensorferry.serialize({"a": 5})
    # A tensor named as the header's metadata: the reference writes a file no reader takes.
    with pytest.raises(tensorferry.InvalidArgumentError, match="reserved"):
        tensorferry.serialize({"__metadata__": ok})


def blob_of(header, data):
    text = json.dumps(header, separators=(",", ":")).encode()
    return len(text).to_bytes(8, "little") + text + data


F32_2 = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize("blob,what", [
    (b"\x00" * 7, "header length"),
    (b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "runs past the end"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "must be an object"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00{x", "not valid JSON"),
    (blob_of(F32_2, b"\x00" * 4), r'tensor "a": ends at data offset 8 .* truncated by 4 bytes'),
    (blob_of(F32_2, b"\x00" * 12), r'4 bytes after the last tensor \("a"'),
    (blob_of({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\x00" * 8),
     r'tensor "a": F32 \[3\] takes 12 bytes but data_offsets \[0, 8\] span 8'),
    (blob_of({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\x00" * 12),
     r'tensor "a": starts at data offset 4 .* a hole of 4 bytes'),
    (blob_of({"a": {"dtype": "X32", "shape": [2], "data_offsets": [0, 8]}}, b"\x00" * 8),
     r'tensor "a": unknown dtype "X32"'),
])
def test_deserialize_refuses_malformed_bytes(blob, what):
    with pytest.raises(safetensors.SafetensorError):
        safetensors.deserialize(blob)
    with pytest.raises(tensorferry.SafetensorError, match=what):
        tensorferry.deserialize(blob)


def test_deserialize_of_an_empty_file_and_a_non_buffer():
    blob = safetensors.serialize({})
    assert tensorferry.deserialize(blob) == safetensors.deserialize(blob) == []
    with pytest.raises(TypeError):
        tensorferry.deserialize("not bytes")
    # No tensors and an empty metadata table: the reference writes '{},"__metadata__":{}}' (not
    # JSON; its deserialize refuses it); ours is the header that means it.
    ours = tensorferry.serialize({}, {})
    assert ours[8:].rstrip(b" ") == b'{"__metadata__":{}}' and len(ours) % 8 == 0
    assert tensorferry.deserialize(ours) == safetensors.deserialize(ours) == []

"""The safetensors package's raw API: TensorSpec, serialize, serialize_file and deserialize, over
tensorferry's writer and strict parser (docs/python.md, "Raw bytes")."""
import operator
import os
from typing import Dict, List, Optional, Tuple, Union

from . import _core
from ._core import SafetensorError, InvalidArgumentError
from ._frameworks import metadata_to_write

# The dtype names TensorSpec takes (the reference's), and the safetensors dtype of each.
_DTYPES = {
    "bool": "BOOL", "int8": "I8", "uint8": "U8", "int16": "I16", "uint16": "U16", "int32": "I32",
    "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "float32": "F32",
    "float64": "F64", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4", "complex64": "C64",
}


def _st_dtype(dtype):
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str, not {type(dtype).__name__}")
    st = _DTYPES.get(dtype)
    if st is None:
        raise SafetensorError(f'Unknown dtype "{dtype}". Supported dtypes: {", ".join(_DTYPES)}')
    return st


def _unsigned(value, what):
    """`value` as a Python int in [0, 2**64), as the reference converts it: anything with
    __index__ (numpy integers and bools included), never a float."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: '{type(value).__name__}' object cannot be interpreted as an "
                        "integer") from None
    if value < 0:
        raise OverflowError(f"{what}: can't convert negative int to unsigned")
    if value >= 1 << 64:
        raise OverflowError(f"{what}: int too big to convert")
    return value


def _header_shape(st, shape, what):
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"{what}: shape must be a sequence of ints, not {type(shape).__name__}")
    dims = [_unsigned(d, "shape dimension") for d in shape]
    if st == "F4":
        # The framework's storage shape counts packed pairs of 4-bit values; the header counts
        # values.
        if not dims:
            raise InvalidArgumentError(
                f"{what}: a 0-d float4_e2m1fn_x2 tensor holds two 4-bit values, which an F4 header "
                "cannot describe (its shape counts values): give shape [1] instead")
        dims[-1] *= 2
        if dims[-1] >= 1 << 64:
            raise OverflowError(f"{what}: shape dimension: int too big to convert")
    return dims


class TensorSpec:
    """Describes one tensor for serialize / serialize_file: its dtype (a name such as "float32",
    "bfloat16" or "float4_e2m1fn_x2"), its shape and the address and length of its bytes
    (C order, little-endian). As in the reference, `shape` of a float4_e2m1fn_x2 tensor is the
    framework's (packed pairs) and is stored doubled along its last dimension.

    The memory at `data_ptr` is the caller's: it must stay valid and unchanged during every
    serialize or serialize_file call given this spec (an address of 0 with a length is refused;
    any other address is trusted). As the reference's, specs compare by identity and are
    hashable; integers are taken from anything with __index__ (numpy scalars too)."""

    __slots__ = ("_dtype", "_shape", "_data_ptr", "_data_len")

    def __init__(self, *, dtype: str, shape, data_ptr: int, data_len: int):
        self._dtype = _st_dtype(dtype)
        self._shape = _header_shape(self._dtype, shape, "TensorSpec")
        self._data_ptr = _unsigned(data_ptr, "data_ptr")
        self._data_len = _unsigned(data_len, "data_len")

    dtype = property(lambda self: self._dtype, doc="The safetensors dtype (\"F32\", ...).")
    shape = property(lambda self: list(self._shape), doc="The header's shape.")
    data_ptr = property(lambda self: self._data_ptr, doc="The address of the bytes.")
    data_len = property(lambda self: self._data_len, doc="The number of bytes.")

    def __repr__(self):
        return (f"TensorSpec(dtype={self._dtype!r}, shape={self._shape!r}, "
                f"data_ptr={self._data_ptr}, data_len={self._data_len})")


def _entries(tensor_dict):
    if not isinstance(tensor_dict, dict):
        raise TypeError(f"tensor_dict must be a dict of str to TensorSpec, not "
                        f"{type(tensor_dict).__name__}")
    entries = []
    for name, spec in tensor_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, not {type(name).__name__}")
        if isinstance(spec, TensorSpec):
            entries.append((name, spec.dtype, spec.shape, spec.data_ptr, spec.data_len))
        elif isinstance(spec, dict):
            # The form safetensors before 0.7 took: {"dtype": "float32", "shape": [...],
            # "data": bytes-like}. The bytes are held while they are written.
            missing = {"dtype", "shape", "data"} - set(spec)
            if missing:
                raise ValueError(f"tensor {name!r}: the dict lacks {sorted(missing)}")
            st = _st_dtype(spec["dtype"])
            data = memoryview(spec["data"])
            if not data.c_contiguous:
                raise ValueError(f"tensor {name!r}: data is not C-contiguous")
            entries.append((name, st, _header_shape(st, spec["shape"], f"tensor {name!r}"),
                            spec["data"], data.nbytes))
        else:
            raise TypeError(f"tensor {name!r}: expected a TensorSpec, not {type(spec).__name__}")
    return entries


def _metadata(metadata):
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of str to str, not {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str: {k!r}: {v!r}")
    return metadata


def serialize(tensor_dict: Dict[str, TensorSpec], metadata: Optional[Dict[str, str]] = None
              ) -> bytes:
    """The bytes of a safetensors file of `tensor_dict` (name to TensorSpec; or, as safetensors
    before 0.7 took, to {"dtype", "shape", "data"} dicts), byte-identical to
    safetensors.serialize. A data length that is not the shape's is an InvalidArgumentError (a
    SafetensorError and ValueError)."""
    return _core.serialize(_entries(tensor_dict), _metadata(metadata))


def serialize_file(tensor_dict: Dict[str, TensorSpec], filename: Union[str, os.PathLike],
                   metadata: Optional[Dict[str, str]] = None, *, checksums: bool = True) -> None:
    """Writes serialize's bytes to `filename` atomically (a temporary file, fsynced, renamed over
    it), plus, as save_file, the per-tensor checksums record (and {"format": "pt"} when
    `metadata` is None; docs/integrity.md); checksums=False writes the reference's bytes."""
    _core.serialize_file(_entries(tensor_dict), metadata_to_write(_metadata(metadata), checksums),
                         os.fspath(filename), checksums)


def deserialize(data) -> List[Tuple[str, Dict[str, object]]]:
    """The tensors of a whole safetensors file held in `data` (bytes, bytearray or any buffer), as
    safetensors.deserialize returns them: [(name, {"shape": [...], "dtype": "F32", "data":
    bytearray}), ...] in the order of their bytes in the file. The header is checked as every
    load checks it (a malformed one is a SafetensorError naming the byte offset)."""
    return [(name, {"shape": shape, "dtype": dtype, "data": raw})
            for name, dtype, shape, raw in _core.deserialize_raw(data)]

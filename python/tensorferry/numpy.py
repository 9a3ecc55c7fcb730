"""tensorferry.numpy: drop-in for safetensors.numpy (load_file, save_file, load, save)."""
import os
import sys
from typing import Dict, Optional, Union

import numpy as np

from . import _core, _frameworks
from ._frameworks import UnsupportedDTypeError
from ._safe_open import safe_open

__all__ = ["load_file", "save_file", "load", "save"]

_ST_NAMES = {np.dtype(attr): st for st, attr in _frameworks._NUMPY_NAMES.items()}


def load_file(filename: Union[str, os.PathLike], *, backend: Optional[str] = None,
              tp_rank: Optional[int] = None, tp_size: Optional[int] = None, shard_rules=None,
              storage_options=None, verify: Optional[str] = None) -> Dict[str, np.ndarray]:
    """Loads every tensor of a safetensors file as numpy arrays, a dict in file order. A dtype
    numpy lacks (BF16, float8, ...) raises UnsupportedDTypeError (a SafetensorError and a
    TypeError) naming the tensor, before anything is read. With tp_rank and tp_size, each array
    is the shard that rank holds under `shard_rules` (tensorferry.Loader's). `verify` ("auto",
    "on", "off") checks per-tensor checksums (docs/integrity.md)."""
    if tp_rank is not None or tp_size is not None or shard_rules is not None \
            or verify is not None:
        from ._loader import Loader
        with Loader(filename, engine=backend, framework="np", tp_rank=tp_rank, tp_size=tp_size,
                    shard_rules=shard_rules, storage_options=storage_options,
                    verify=verify) as loader:
            return loader.load()
    with safe_open(filename, framework="np", backend=backend,
                   storage_options=storage_options) as f:
        return f.get_tensors()


def load(data: bytes) -> Dict[str, np.ndarray]:
    """Loads the tensors of a safetensors file held in `data` (bytes or any buffer), sorted by
    name. The data is copied once; the arrays share that copy."""
    return _frameworks.get("np").deserialize(data)


def _entries(tensor_dict, metadata):
    if not isinstance(tensor_dict, dict):
        raise ValueError(f"Expected a dict of [str, np.ndarray] but received {type(tensor_dict)}")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict of str to str, not {type(metadata).__name__}")
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"metadata must map str to str: {k!r}: {v!r}")
    keep = []
    entries = []
    for name, array in tensor_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, not {type(name).__name__}")
        if not isinstance(array, np.ndarray):
            raise ValueError(f"Key `{name}` is invalid, expected np.ndarray but received "
                             f"{type(array)}")
        native = array.dtype.newbyteorder("=") if array.dtype.byteorder not in ("=", "|") \
            else array.dtype
        st = _ST_NAMES.get(np.dtype(native))
        if st is None:
            raise UnsupportedDTypeError(
                f'tensor {name!r}: Unknown dtype "{array.dtype.name}". Supported dtypes: '
                + ", ".join(d.name for d in _ST_NAMES))
        # Little-endian, C order, as the format stores it. The reference writes the raw memory of
        # non-contiguous arrays (wrong values); here they are packed first.
        little = array.astype(array.dtype.newbyteorder("<"), copy=False) \
            if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and
                                                 sys.byteorder == "big") else array
        packed = little if little.flags.c_contiguous else little.copy(order="C")
        keep.append(packed)
        entries.append((name, st, list(packed.shape), packed.ctypes.data if packed.size else 0,
                        packed.nbytes))
    return entries, keep


def save(tensor_dict: Dict[str, np.ndarray], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """The safetensors bytes of `tensor_dict` (byte-identical to safetensors.numpy.save)."""
    entries, keep = _entries(tensor_dict, metadata)
    out = _core.serialize(entries, metadata)
    del keep
    return out


def save_file(tensor_dict: Dict[str, np.ndarray], filename: Union[str, os.PathLike],
              metadata: Optional[Dict[str, str]] = None, *, checksums: bool = True) -> None:
    """Writes `tensor_dict` to `filename`, atomically: a temporary file is written, fsynced and
    renamed over `filename`. The bytes are safetensors.numpy.save_file's plus one metadata entry,
    "tensorferry.checksums" (per-tensor checksums, docs/integrity.md), and, when `metadata` is
    None, {"format": "pt"} (what loaders take a file without metadata for: accelerate refuses a
    metadata table without "format"); checksums=False leaves both out: then byte-identical to
    the reference."""
    entries, keep = _entries(tensor_dict, metadata)
    _core.serialize_file(entries, _frameworks.metadata_to_write(metadata, checksums),
                         os.fspath(filename), checksums)
    del keep

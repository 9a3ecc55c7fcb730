"""tensorferry.torch: drop-in for safetensors.torch (load_file, save_file, load, save, and
load_model/save_model)."""
import os
from typing import Dict, List, Optional, Tuple, Union

import torch

from . import _core, _frameworks
from ._frameworks import UnsupportedDTypeError
from ._safe_open import safe_open, default_load_options, open_file
from ._dispatch import load_checkpoint_and_dispatch

__all__ = ["load_file", "save_file", "load", "save", "load_model", "save_model",
           "load_checkpoint_and_dispatch", "storage_ptr", "storage_size"]

_ST_NAMES = {}
for _st, _attr in _frameworks._TORCH_NAMES.items():
    _dtype = getattr(torch, _attr, None)
    if _dtype is not None:
        _ST_NAMES[_dtype] = _st


def load_file(filename: Union[str, os.PathLike], device: Union[str, int] = "cpu", *,
              backend: Optional[str] = None, tp_rank: Optional[int] = None,
              tp_size: Optional[int] = None, shard_rules=None,
              storage_options=None, verify: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Loads every tensor of a safetensors file, as a dict in file order.

    On the CPU the default is tensorferry's fastest measured path (docs/python.md); `backend`
    ("mmap", "pread"; also "io_uring", "auto") chooses one explicitly. With tp_rank and tp_size,
    each tensor is the shard that rank holds under `shard_rules` (tensorferry.Loader's).
    `verify` ("auto", "on", "off"; default TENSORFERRY_VERIFY, else auto) checks per-tensor
    checksums (docs/integrity.md).
    """
    if tp_rank is not None or tp_size is not None or shard_rules is not None \
            or verify is not None:
        from ._loader import Loader
        with Loader(filename, device=device, engine=backend, tp_rank=tp_rank, tp_size=tp_size,
                    shard_rules=shard_rules, storage_options=storage_options,
                    verify=verify) as loader:
            return loader.load()
    with safe_open(filename, framework="pt", device=device, backend=backend,
                   storage_options=storage_options) as f:
        return f.get_tensors()


def load(data: bytes) -> Dict[str, torch.Tensor]:
    """Loads the tensors of a safetensors file held in `data` (bytes or any buffer), sorted by
    name. The data is copied once; the tensors share that copy."""
    return _frameworks.get("pt").deserialize(data)


def _check(tensors):
    if not isinstance(tensors, dict):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    sparse = []
    for k, v in tensors.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"Key `{k}` is invalid, expected torch.Tensor but received {type(v)}")
        if v.layout != torch.strided:
            sparse.append(k)
    if sparse:
        raise ValueError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not "
            "support. You can make it a dense tensor before saving with `.to_dense()` but be aware "
            "this might make a much larger file than needed.")
    overlapping = _overlapping_groups(tensors)
    if overlapping:
        raise RuntimeError(
            f"Some tensors share memory, this will lead to duplicate memory on disk and potential "
            f"differences when loading them again: {overlapping}. A potential way to correctly "
            f"save your model is to use `save_model`.")


def _overlapping_groups(tensors):
    """Groups of names (sets) whose bytes overlap in memory (same storage)."""
    by_storage = {}
    for name, t in tensors.items():
        if t.device.type == "meta" or t.numel() == 0:
            continue
        try:
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr(), storage.nbytes())
        except (RuntimeError, NotImplementedError):
            continue
        if key[1] == 0:
            continue
        start = t.data_ptr()
        last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
        end = start + (last + 1) * t.element_size()
        by_storage.setdefault(key, []).append((start, end, name))
    groups = []
    for areas in by_storage.values():
        if len(areas) < 2:
            continue
        areas.sort()
        current, current_end = {areas[0][2]}, areas[0][1]
        for start, end, name in areas[1:]:
            if start < current_end:
                current.add(name)
                current_end = max(current_end, end)
            else:
                if len(current) > 1:
                    groups.append(current)
                current, current_end = {name}, end
        if len(current) > 1:
            groups.append(current)
    return groups


def _entries(tensors, metadata):
    _check(tensors)
    _check_metadata(metadata)
    keep = []
    entries = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, not {type(name).__name__}")
        if isinstance(t, torch.Tensor) and (t.is_conj() or t.is_neg()):
            # A lazy conjugate or negative view: its memory holds the values before the
            # conjugation or negation (saving that memory would write them unchanged).
            t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            raise ValueError(
                f"You are trying to save a non contiguous tensor: `{name}` which is not allowed. "
                "It either means you are trying to save tensors which are reference of each other "
                "in which case it's recommended to save only the full tensors, and reslice at load "
                "time, or simply call `.contiguous()` on your tensor to pack it before saving.")
        st = _ST_NAMES.get(t.dtype)
        if st is None:
            raise UnsupportedDTypeError(
                f"tensor {name!r}: {t.dtype} has no safetensors dtype (supported: "
                f"{', '.join(str(d) for d in _ST_NAMES)})")
        if t.device.type != "cpu":
            t = t.to("cpu")
        shape = list(t.shape)
        if st == "F4":
            if not shape:
                raise _core.InvalidArgumentError(
                    f"tensor {name!r}: a 0-d {t.dtype} tensor holds two 4-bit values, which an F4 "
                    f"header cannot describe (its shape counts values: [] is one): save "
                    f"t.reshape(1) (F4 shape [2]) instead")
            shape[-1] *= 2  # the file counts 4-bit values; torch counts packed pairs
        keep.append(t)
        entries.append((name, st, shape, t.data_ptr() if t.numel() else 0,
                        t.numel() * t.element_size()))
    return entries, keep


def _check_metadata(metadata):
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of str to str, not {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str: {k!r}: {v!r}")


def save(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """The safetensors bytes of `tensors` (byte-identical to safetensors.torch.save)."""
    entries, keep = _entries(tensors, metadata)
    out = _core.serialize(entries, metadata)
    del keep
    return out


def save_file(tensors: Dict[str, torch.Tensor], filename: Union[str, os.PathLike],
              metadata: Optional[Dict[str, str]] = None, *, checksums: bool = True) -> None:
    """Writes `tensors` to `filename`, atomically: a temporary file is written, fsynced and
    renamed over `filename`. The bytes are safetensors.torch.save_file's plus one metadata entry,
    "tensorferry.checksums" (per-tensor checksums, docs/integrity.md; every safetensors reader
    reads the file), and, when `metadata` is None, {"format": "pt"} (what loaders take a file
    without metadata for: accelerate refuses a metadata table without "format");
    checksums=False leaves both out: then byte-identical to the reference."""
    entries, keep = _entries(tensors, metadata)
    _core.serialize_file(entries, _frameworks.metadata_to_write(metadata, checksums),
                         os.fspath(filename), checksums)
    del keep


def storage_ptr(tensor: torch.Tensor) -> int:
    """The address of the storage `tensor` views (0 for one without: meta, or freed), as
    safetensors.torch.storage_ptr: what tied parameters share (transformers imports it)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - e.g. a tensor subclass without storage
        try:
            return tensor.storage().data_ptr()
        except NotImplementedError:
            return 0


def storage_size(tensor: torch.Tensor) -> int:
    """The size in bytes of the storage `tensor` views, as safetensors.torch.storage_size."""
    try:
        return tensor.untyped_storage().nbytes()
    except AttributeError:
        try:
            return tensor.storage().size() * tensor.element_size()
        except NotImplementedError:
            return tensor.nelement() * tensor.element_size()


def _shared_names(state_dict):
    """Groups of names sharing storage (tied weights), as in safetensors' save_model."""
    groups = {}
    for name, t in state_dict.items():
        if t.device.type == "meta" or t.numel() == 0:
            continue
        ptr = storage_ptr(t)
        if ptr == 0:
            continue
        groups.setdefault((t.device, ptr, storage_size(t)), set()).add(name)
    return [g for g in groups.values() if len(g) > 1]


def _is_complete(t):
    return t.data_ptr() == storage_ptr(t) and t.numel() * t.element_size() == storage_size(t)


def _names_to_drop(state_dict, preferred=()):
    """For each group of shared tensors, the names to drop, keeping one that covers the storage."""
    preferred = set(preferred)
    drop = {}
    for group in _shared_names(state_dict):
        complete = sorted(n for n in group if _is_complete(state_dict[n]))
        if not complete:
            raise RuntimeError(
                f"Error while trying to find names to remove to save state dict, but found no "
                f"suitable name to keep for saving amongst: {group}. None is covering the entire "
                f"storage. Refusing to save/load the model since you could be storing much more "
                f"memory than needed.")
        keep = next((n for n in complete if n in preferred), complete[0])
        drop[keep] = sorted(n for n in group if n != keep)
    return drop


def save_model(model: torch.nn.Module, filename: Union[str, os.PathLike],
               metadata: Optional[Dict[str, str]] = None, force_contiguous: bool = True, *,
               checksums: bool = True):
    """Saves model.state_dict() with tied (shared) tensors written once; the dropped names are
    recorded in the metadata as name -> kept name (as safetensors.torch.save_model does)."""
    state_dict = model.state_dict()
    for kept, dropped in _names_to_drop(state_dict).items():
        for name in dropped:
            if metadata is None:
                metadata = {}
            metadata.setdefault(name, kept)
            del state_dict[name]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    save_file(state_dict, filename, metadata=metadata, checksums=checksums)


def load_model(model: torch.nn.Module, filename: Union[str, os.PathLike], strict: bool = True,
               device: Union[str, int] = "cpu", *, backend: Optional[str] = None
               ) -> Tuple[List[str], List[str]]:
    """Loads a file written by save_model into `model`; returns (missing, unexpected) names."""
    state_dict = load_file(filename, device=device, backend=backend)
    dropped = _names_to_drop(model.state_dict(), preferred=state_dict.keys())
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing)
    for names in dropped.values():
        for name in names:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(error)
    return missing, unexpected

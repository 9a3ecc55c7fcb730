"""What tensorferry needs to know about each framework: dtypes, devices, array construction.

The compiled core exports bytes as framework arrays through DLPack. Element types DLPack and the
framework agree on are exported with their own type; the others (float8, float4) are exported as
uint8 and viewed here as the framework's type, without a copy.
"""
import math
import operator

from . import _core
from ._core import SafetensorError, UnsupportedError

NUMPY, TORCH = 0, 1  # framework codes of the compiled core


class UnsupportedDTypeError(UnsupportedError, TypeError):
    """The tensor's dtype has no equivalent in the framework asked for (e.g. BF16 in NumPy)."""

    __module__ = "tensorferry"


# safetensors dtype -> torch attribute name. Types an older torch lacks are skipped at lookup.
_TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    # Two 4-bit values per byte: the torch shape's last dimension is half the file's.
    "F4": "float4_e2m1fn_x2",
}

# safetensors dtype -> numpy name: torch's, less the types numpy lacks (bfloat16, float8, float4).
_NUMPY_NAMES = {k: v for k, v in _TORCH_NAMES.items()
                if k != "BF16" and not k.startswith(("F8_", "F4"))}

_BYTES_PER_FRAMEWORK_ELEMENT = {"F4": 1}  # packed pairs


def metadata_to_write(metadata, checksums):
    """The metadata save_file writes: `metadata` as given, except that a file saved without any
    (None) but with its checksums record gets {"format": "pt"} beside the record. Loaders read a
    file without metadata as PyTorch's format and refuse a metadata table without "format"
    (accelerate's load_checkpoint_in_model, transformers 4's from_pretrained): with only the
    record, a file the reference would have written without metadata would be refused there."""
    if metadata is None and checksums:
        return {"format": "pt"}
    return metadata


def prod(shape):
    return math.prod(shape) if shape else 1


class SliceIndexError(SafetensorError, IndexError):
    """A bad get_slice index (NumPy): NumPy's IndexError, and a SafetensorError as the
    reference raises."""


class SliceValueError(SafetensorError, ValueError):
    """A bad get_slice index (NumPy): NumPy's ValueError, and a SafetensorError."""


class SliceTypeError(SafetensorError, TypeError):
    """A bad get_slice index (NumPy): NumPy's TypeError, and a SafetensorError."""


_AS_SAFETENSOR_ERRORS = {IndexError: SliceIndexError, ValueError: SliceValueError,
                         TypeError: SliceTypeError}


def as_safetensor_error(error):
    """`error` (an IndexError, ValueError or TypeError of an index, or a subclass) as the
    Slice*Error of its kind, which is also a SafetensorError: where the reference raises
    SafetensorError for it, an `except SafetensorError` written for the reference catches it,
    and so does one for the framework's own type. Its message is the framework's."""
    for base, both in _AS_SAFETENSOR_ERRORS.items():
        if isinstance(error, base):
            return both(*error.args)
    return error


class _Framework:
    code = None
    name = None
    # Whether the reference raises SafetensorError for a bad get_slice index (numpy) rather
    # than the framework's own error (torch).
    slice_errors_are_safetensor_errors = False

    def __init__(self):
        self._dtypes = {}
        self._raw = {}

    def dtype(self, st_dtype, tensor=None):
        """The framework dtype for a safetensors dtype name, or UnsupportedDTypeError."""
        try:
            return self._dtypes[st_dtype]
        except KeyError:
            pass
        dtype = self._lookup(st_dtype)
        if dtype is None:
            raise UnsupportedDTypeError(self._unsupported_message(st_dtype, tensor))
        self._dtypes[st_dtype] = dtype
        return dtype

    def is_raw(self, st_dtype):
        raw = self._raw.get(st_dtype)
        if raw is None:
            raw = self._raw[st_dtype] = not _core.exports_natively(st_dtype, self.code)
        return raw

    def shape(self, st_dtype, st_shape, tensor=None):
        """The framework shape of a tensor whose header says `st_shape`."""
        if st_dtype == "F4":
            if not st_shape or st_shape[-1] % 2:
                raise UnsupportedDTypeError(
                    f"tensor {tensor!r}: F4 with shape {list(st_shape)} cannot be a "
                    f"{self.name} float4_e2m1fn_x2 tensor (the last dimension must be even)")
            return list(st_shape[:-1]) + [st_shape[-1] // 2]
        return list(st_shape)

    def file_shape(self, st_dtype, shape):
        """The header's shape for a framework shape (the inverse of shape())."""
        if st_dtype == "F4":
            return list(shape[:-1]) + [shape[-1] * 2]
        return list(shape)

    def check(self, reader, names=None):
        """Raises UnsupportedDTypeError when a tensor among `names` (all when None) has a dtype
        this framework lacks, before anything is read."""
        for st_dtype, odd in reader.dtypes(names).items():
            try:
                self.dtype(st_dtype)
            except UnsupportedDTypeError:
                candidates = names if names is not None else reader.names(True)
                example = next(n for n in candidates if reader.info(n).dtype == st_dtype)
                self.dtype(st_dtype, example)  # raises, naming the tensor
            if odd:
                self.shape(st_dtype, reader.info(odd[0]).shape, odd[0])

    def finish_all(self, triples, device):
        """(name, tensor) pairs from the core's (name, dtype, array) triples. `device` None:
        tensors stay where the core put them (a per-tensor placement)."""
        finish = self.finish
        if device is None:
            return [(name, finish(array, st_dtype)) for name, st_dtype, array in triples]
        to_device = self.to_device
        return [(name, to_device(finish(array, st_dtype), device))
                for name, st_dtype, array in triples]

    def deserialize(self, data):
        """{name: tensor} of a whole safetensors file held in `data` (any buffer), sorted by
        name: copied once into one block all tensors share (_core.deserialize)."""
        out = {}
        for name, st_dtype, st_shape, array in _core.deserialize(data, self.code):
            self.dtype(st_dtype, name)
            self.shape(st_dtype, st_shape, name)
            out[name] = self.finish(array, st_dtype)
        return out

    def core_device(self, device):
        """The device string the core loads to ("cuda:N"), or None for the host path."""
        return None

    def finish(self, array, st_dtype):
        """The array exported by the core, as the right framework dtype (no copy)."""
        if self.is_raw(st_dtype):
            return array.view(self.dtype(st_dtype))
        return array

    def _unsupported_message(self, st_dtype, tensor):
        what = f"tensor {tensor!r} has dtype {st_dtype}" if tensor is not None else f"dtype {st_dtype}"
        return f"{what}, which {self.name} does not support"


class _Torch(_Framework):
    code = TORCH
    name = "torch"
    negative_steps = False  # torch slices need step > 0

    def __init__(self):
        super().__init__()
        import torch
        self.torch = torch

    def _lookup(self, st_dtype):
        attr = _TORCH_NAMES.get(st_dtype)
        return getattr(self.torch, attr, None) if attr else None

    def _unsupported_message(self, st_dtype, tensor):
        msg = super()._unsupported_message(st_dtype, tensor)
        if st_dtype in _TORCH_NAMES:
            return f"{msg} (torch.{_TORCH_NAMES[st_dtype]} needs a newer torch)"
        return f"{msg}: torch has no {st_dtype} type"

    def probe(self, shape):
        """A tensor of `shape` that holds no memory: indexing it checks an index exactly as
        indexing the real tensor would, and gives the result's shape."""
        return self.torch.empty((), dtype=self.torch.uint8).expand(shape)

    def empty(self, shape, st_dtype):
        return self.torch.empty(shape, dtype=self.dtype(st_dtype))

    def empty_for(self, outputs, device):
        """{name: uninitialised tensor on `device`} for the core's Output descriptions (a
        Reader's or Loader's describe()), in their order: destinations for load_into, allocated
        by torch (its caching allocator on a GPU), at torch's shape of each (shape(): an F4
        header counts 4-bit values, float4_e2m1fn_x2 packed pairs). UnsupportedDTypeError naming
        the tensor."""
        torch = self.torch
        return {o.name: torch.empty(tuple(self.shape(o.dtype, o.shape, o.name)),
                                    dtype=self.dtype(o.dtype, o.name), device=device)
                for o in outputs}

    def st_dtype(self, dtype):
        """The safetensors dtype name of a torch dtype, or None when none has it."""
        for st_dtype, attr in _TORCH_NAMES.items():
            if getattr(self.torch, attr, None) == dtype:
                return st_dtype
        return None

    def own(self, result, base):
        """`result` (base[index]) as a contiguous tensor that does not keep more than its own
        bytes alive."""
        if result.is_contiguous() and result.untyped_storage().nbytes() == result.nbytes:
            return result
        if base is not None and result.data_ptr() == base.data_ptr() and \
                result.shape == base.shape and result.is_contiguous():
            return result
        return result.clone(memory_format=self.torch.contiguous_format)

    def device(self, device):
        torch = self.torch
        if device is None:  # as safetensors: the CPU
            device = "cpu"
        if not isinstance(device, torch.device):
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError, ValueError):
                raise SafetensorError(f"device {device} is invalid") from None
        if device.type == "cuda" and device.index is None:
            # "cuda": torch's current device (0 when CUDA is not initialized or absent).
            index = 0
            try:
                if torch.cuda.is_available():
                    index = torch.cuda.current_device()
            except Exception:  # noqa: BLE001 - any CUDA trouble is reported by the load itself
                pass
            device = torch.device("cuda", index)
        return device

    def core_device(self, device):
        if device is not None and device.type == "cuda":
            return f"cuda:{device.index}"
        return None

    def to_device(self, tensor, device):
        if device.type == "cpu" or tensor.device == device:
            return tensor
        return tensor.to(device)

    def after_queued_work(self, tensors):
        """Waits for the work queued on the current stream of each CUDA device among `tensors`
        before tensorferry writes into them on its own streams: a block torch's caching
        allocator handed out may still be read or written by kernels queued on that stream (as
        torch's own copy_ would be ordered after them)."""
        torch = self.torch
        for device in {t.device for t in tensors if t.device.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()


class _Numpy(_Framework):
    code = NUMPY
    name = "numpy"
    negative_steps = True
    slice_errors_are_safetensor_errors = True

    def __init__(self):
        super().__init__()
        import numpy
        self.np = numpy

    def _lookup(self, st_dtype):
        attr = _NUMPY_NAMES.get(st_dtype)
        return self.np.dtype(attr) if attr else None

    def _unsupported_message(self, st_dtype, tensor):
        msg = super()._unsupported_message(st_dtype, tensor)
        torch_name = _TORCH_NAMES.get(st_dtype)
        if torch_name:
            return f"{msg}: open the file with framework=\"pt\" (torch.{torch_name})"
        return f"{msg}: no framework tensorferry supports has an {st_dtype} type"

    def finish(self, array, st_dtype):
        want = self.dtype(st_dtype)
        # The buffer protocol describes 64-bit integers as C long long ('q'), which NumPy maps to
        # np.longlong, not np.int64 (same bits, another scalar type): view as the canonical type.
        if array.dtype.type is not want.type:
            return array.view(want)
        return array

    def probe(self, shape):
        np = self.np
        return np.broadcast_to(np.empty((), dtype=np.uint8), shape)

    def empty(self, shape, st_dtype):
        return self.np.empty(shape, dtype=self.dtype(st_dtype))

    def own(self, result, base):
        np = self.np
        if not isinstance(result, np.ndarray):  # a NumPy scalar: already its own
            return result
        if result.flags.c_contiguous and base is not None and result.shape == base.shape and \
                result.__array_interface__["data"][0] == base.__array_interface__["data"][0]:
            return result
        if result.base is None:
            return result
        return result.copy()

    def device(self, device):
        if device not in ("cpu", None):
            raise SafetensorError(f"device {device} is invalid: numpy arrays live on the cpu")
        return "cpu"

    def to_device(self, array, device):
        return array


_FRAMEWORKS = {}


def get(framework):
    """The framework adapter for "pt"/"torch"/"pytorch" or "np"/"numpy"."""
    if not isinstance(framework, str):  # as safetensors: a TypeError, not a SafetensorError
        raise TypeError(f"framework must be a str such as \"pt\" or \"np\", not "
                        f"{type(framework).__name__}")
    key = {"pt": "pt", "torch": "pt", "pytorch": "pt", "np": "np", "numpy": "np"}.get(framework)
    if key is None:
        if framework in ("tf", "tensorflow", "flax", "jax", "mlx", "paddle", "paddlepaddle"):
            raise SafetensorError(
                f"framework {framework} is not supported by tensorferry (use \"pt\" or \"np\")")
        raise SafetensorError(f"framework {framework} is invalid")
    adapter = _FRAMEWORKS.get(key)
    if adapter is None:
        adapter = _FRAMEWORKS[key] = _Torch() if key == "pt" else _Numpy()
    return adapter


def index_int(value):
    return operator.index(value)

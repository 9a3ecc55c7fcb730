"""tensorferry.transformers: transformers' from_pretrained reading its safetensors files through
tensorferry, with the user's call unchanged (docs/models.md).

    import tensorferry.transformers
    with tensorferry.transformers.loading():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)

    tensorferry.transformers.enable()    # or for the whole process (disable() undoes it)

What changes: transformers opens each checkpoint file with `safetensors.safe_open` and asks for
every tensor through `get_slice(name)[...]` from its loading threads. Routed here, each file is
mapped once by tensorferry's mmap engine (copy-on-write: a write into a parameter copies that page,
the file is never modified; a file rewritten or truncated under the mapping is guarded as
docs/runtime_settings.md says), and every request is answered with a view of the mapping. When
the first request for a file asks for a whole tensor (a plain from_pretrained), the whole file is
read into memory then, in parallel and in large requests (the mmap engine's populate), so the
parameters are resident when from_pretrained returns; when it asks for a part (a tensor-parallel
plan), nothing is read ahead and each slice copies only the bytes it selects. A file on a
network or FUSE file system (NFS, SMB, Lustre, sshfs, s3fs, ...), where each page fault of a
mapping waits for a round trip, is not mapped: a whole-tensor first request reads the whole file
with many large reads in flight (the io_uring engine), a part first reads each slice's bytes.

What does not change: everything transformers does after reading (key renaming, weight
conversions such as fused MoE experts, quantizers, dtype and device handling, tied weights,
missing-key initialisation) runs as it does without tensorferry: only the reads are replaced.
Paths transformers takes without safe_open are unchanged: `disable_mmap=True` (whole files read
into bytes), pickled .bin checkpoints.

Thread-safety: enable/disable/loading may be called from any thread; the patch is process-wide
(as transformers' own module attributes are), and nested loading() blocks keep it until the
outermost one ends.
"""
import importlib
import sys
import threading
from contextlib import contextmanager

from . import _core
from ._frameworks import UnsupportedDTypeError
from ._loader import Loader
from ._safe_open import _Slice, is_url
from ._safe_open import safe_open as _safe_open

__all__ = ["enable", "disable", "enabled", "loading", "safe_open"]

# Modules of transformers whose safetensors reads are routed: the loading path
# (modeling_utils: from_pretrained and load_state_dict) and accelerate's integration (device maps).
# Other transformers modules that imported safe_open are patched too when already imported.
_LOADING_MODULES = ("transformers.modeling_utils", "transformers.integrations.accelerate")

_lock = threading.Lock()
_depth = 0
_patched = []  # (module, attribute, original)


class safe_open(_safe_open):
    """tensorferry's drop-in safe_open (same arguments and results), answering whole-tensor
    requests from one copy-on-write mapping of the file (see the module's docstring). Files that
    cannot be mapped here (URLs, a CUDA device, backend="pread") behave as tensorferry.safe_open.
    """

    def __init__(self, filename, framework, device="cpu", *, backend=None, storage_options=None):
        super().__init__(filename, framework, device, backend=backend,
                         storage_options=storage_options)
        self._filename = filename
        self._backend = backend
        self._map_lock = threading.Lock()
        self._views = None  # name -> view of the mapping; {} when the file cannot be mapped
        self._mappable = (self._fw.name == "torch" and str(self._device) == "cpu"
                          and backend in (None, "mmap") and not is_url(filename))

    def close(self):
        super().close()
        self._views = None

    def _view(self, name, whole=True):
        """The mapped view of tensor `name`, or None when this file is read the default way.
        `whole`: the caller wants all of it (decides, on the file's first request, whether the
        whole file is read into memory at once)."""
        if not self._mappable:
            return None
        self._open_reader()  # "File is closed" after close()
        views = self._views
        if views is None:
            with self._map_lock:
                if self._views is None:
                    try:
                        # backend="mmap" maps whatever the file system; else the mapping
                        # is for local file systems (Loader's prefer_mmap).
                        engine = "mmap" if self._backend == "mmap" else "auto"
                        with Loader(self._filename, engine=engine, prefer_mmap=True,
                                    populate=whole) as loader:
                            if whole or loader.engine_info["engine"] == "mmap":
                                self._views = loader.load()
                            else:  # a part first, files not mapped: each slice reads its bytes
                                self._views = {}
                    except UnsupportedDTypeError:
                        self._views = {}  # per tensor, each with its own error if it has one
                views = self._views
        return views.get(name)

    def get_tensor(self, name):
        view = self._view(name)
        return super().get_tensor(name) if view is None else view

    def get_slice(self, name):
        reader = self._open_reader()
        reader.info(name)  # SafetensorError for a missing name, as the reference
        return _MappedSlice(self, name)


class _MappedSlice(_Slice):
    def __getitem__(self, index):
        whole = index is Ellipsis or (isinstance(index, slice) and index == slice(None)) or \
            (isinstance(index, tuple) and index == (Ellipsis,))
        view = self._owner._view(self._name, whole)
        if view is None:
            return super().__getitem__(index)
        # The framework's own result; a part of the tensor is copied (only its bytes are read).
        return self._owner._fw.own(view[index], view)


def _original_safe_open():
    import safetensors
    return safetensors.safe_open


def enable():
    """Routes transformers' safetensors reads through tensorferry until disable() (idempotent
    while enabled). ImportError when transformers is not installed."""
    global _depth
    with _lock:
        if _depth == 0:
            _apply()
        _depth += 1


def disable():
    """Undoes enable(): transformers reads with safetensors again."""
    global _depth
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0:
            _restore()


def enabled():
    """Whether transformers' reads go through tensorferry now."""
    return _depth > 0


@contextmanager
def loading():
    """Within the block, transformers' from_pretrained (and everything else in transformers that
    opens safetensors files) reads through tensorferry."""
    enable()
    try:
        yield
    finally:
        disable()


def _apply():
    original = _original_safe_open()
    for name in _LOADING_MODULES:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "transformers" or name.startswith("transformers.")):
            continue
        if getattr(module, "safe_open", None) is original:
            _patched.append((module, "safe_open", original))
            module.safe_open = safe_open
    missing = [n for n in _LOADING_MODULES
               if getattr(sys.modules[n], "safe_open", None) is not safe_open]
    if missing:
        _restore()
        raise _core.InvalidArgumentError(
            f"tensorferry.transformers: {', '.join(missing)} no longer reads through "
            f"safetensors.safe_open; this transformers version is not supported (tested with "
            f"the version pinned in requirements.txt)")


def _restore():
    while _patched:
        module, attr, original = _patched.pop()
        if getattr(module, attr, None) is safe_open:
            setattr(module, attr, original)

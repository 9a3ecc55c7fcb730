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

With a device map that puts every parameter on one CUDA device (`device_map="cuda"`,
`"cuda:1"`, `"auto"` on a model that fits one GPU), the checkpoint is read straight onto that
device: the first time from_pretrained opens one of its safetensors files (on the calling thread,
after transformers' allocator warm-up), a background thread allocates every tensor of every
checkpoint file on that device (`torch.empty`, from the memory the warm-up reserved) and reads the
checkpoint into them through tensorferry's pinned staging ring (`Loader.load_into`, one Loader for
the index's shards, checksums checked; a Loader per file when the index disagrees with the shards,
whose own tensors transformers reads), while transformers goes on with its keys (renaming,
conversion plans); a file's first request waits for the read (and raises what it raised), and
from_pretrained does not return before it ended. Transformers then finds each parameter on its
device and its `.to(device)`
copies nothing, instead of a pageable host-to-device copy of each parameter from the mapping, and
host memory holds none of the model (measured on an H200: 1.43x plain transformers, 74 MiB of
host memory against the model's 3972; docs/benchmarks.md, "Sixth GPU session"). Each tensor is
handed out once (a second request reads the file again). `to_device` (of loading() and enable())
chooses: None (the default) takes this route when the checkpoint, in its files' dtypes, fits the
device's free memory (what the driver has free plus what torch's allocator holds unused) with room
to spare (twice its largest tensor and 256 MiB, for dtype conversions); True takes it whenever the
map allows; False never. When the device memory cannot be allocated after all, or a dtype has no
torch equivalent, the files are mapped as above. Device maps that split the model (several devices,
"cpu", "disk"), quantized models and tensor-parallel device meshes keep the mapping.

Models in object storage: inside loading() (or after enable()), from_pretrained (and AutoTokenizer,
AutoConfig: everything that finds files through transformers.utils.hub.cached_files) takes an
s3://bucket/prefix or http(s):// URL. Its safetensors files are named by their URLs and streamed
(parameters in host memory: one Loader over the index reads the whole checkpoint in the
background from the first open, as the device route does; a device map onto one GPU: the device
route); every other file (config.json, the index, tokenizer files) is read whole with one GET into
a folder of this process's (removed at exit). `storage_options` of loading()/enable() are the
object-storage settings (docs/object_storage.md); revisions other than "main" are an error, and
weights in other formats (.bin, ...) are not read from a bucket. A URL where none of config.json,
the weights and tokenizer_config.json is (a mistyped one) is an OSError naming it.

Models named by an hf://OWNER/NAME[@REVISION] path: read from the local hub cache's snapshot when
it holds the checkpoint (as transformers reads a local folder), else streamed from the hub
(HF_ENDPOINT; HF_TOKEN) as the URL of its resolve/<commit> prefix, above (include/tensorferry/
hub.h); a subfolder= is where the checkpoint is looked for. Which one is decided once per load
(the revision transformers resolves once per from_pretrained, AutoTokenizer.from_pretrained, ...
carries the decision: _HubLoad), so everything one from_pretrained reads comes from one commit,
and the next load decides again. Where tensorferry finds no safetensors checkpoint (a
configuration's or tokenizer's repository or folder), transformers' own lookup reads the
repository (at that load's commit when it read one already).

What does not change: everything transformers does after reading (key renaming, weight
conversions such as fused MoE experts, quantizers, dtype and device handling, tied weights,
missing-key initialisation) runs as it does without tensorferry: only the reads are replaced.
Paths transformers takes without safe_open are unchanged: `disable_mmap=True` (whole files read
into bytes), pickled .bin checkpoints.

Thread-safety: enable/disable/loading may be called from any thread; the patch is process-wide
(as transformers' own module attributes are), and nested loading() blocks keep it until the
outermost one ends.
"""
import atexit
import contextvars
import functools
import hashlib
import importlib
import json
import os
import posixpath
import re
import shutil
import sys
import tempfile
import threading
from contextlib import contextmanager

from . import _core, _frameworks
from ._frameworks import UnsupportedDTypeError
from ._loader import Loader
from ._safe_open import (_Slice, hub_id_path, hub_revision_length, hub_root, is_hub_id,
                         is_hub_path, is_url, storage_load_options)
from ._safe_open import safe_open as _safe_open

__all__ = ["enable", "disable", "enabled", "loading", "safe_open"]

# Modules of transformers whose safetensors reads are routed: the loading path
# (modeling_utils: from_pretrained and load_state_dict) and accelerate's integration (device maps).
# Other transformers modules that imported safe_open are patched too when already imported.
_LOADING_MODULES = ("transformers.modeling_utils", "transformers.integrations.accelerate")

_lock = threading.Lock()
_depth = 0  # enable()s and loading() blocks in force: the patches stay while any is
# The settings of each enable() in force, innermost last, and of the innermost loading() block of
# this thread (context), which come first there: blocks in two threads do not see each other's.
# Each is a _Settings.
_enabled = []
_block = contextvars.ContextVar("tensorferry_transformers_loading", default=None)
_patched = []  # (module or class, attribute, original, replacement)


class _Settings:
    def __init__(self, to_device, storage, hub):
        self.to_device = to_device  # None, True, False
        self.storage = storage      # checked storage options, or None
        self.hub = hub              # "stream" or "download"


def _settings():
    """The settings in force on this thread: its innermost loading() block, else the innermost
    enable(), else None."""
    block = _block.get()
    if block is not None:
        return block
    enabled = _enabled[-1:]  # one read of the list: another thread may change it
    return enabled[0] if enabled else None

# The _DeviceRead of the from_pretrained call running on this thread (transformers opens the files
# on it; its loading threads materialize the tensors later), and (populate) whether the files it
# maps are read whole at their first request: not when its device map offloads to disk (the
# memory-constrained case: a mapping faulted in as tensors are used, as transformers' own,
# reads nothing of the offloaded weights it never asks for).
_target = threading.local()


def _direct_device(load_config):
    """The one CUDA device `load_config`'s device map puts every parameter on, or None: no map,
    several devices, "cpu", "disk" or "meta" entries, a quantizer, a device mesh."""
    device_map = getattr(load_config, "device_map", None)
    if not device_map or getattr(load_config, "hf_quantizer", None) is not None or \
            getattr(load_config, "device_mesh", None) is not None:
        return None
    import torch
    devices = set()
    for value in device_map.values():
        try:
            device = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
        except (RuntimeError, TypeError, ValueError):
            return None  # "disk" and anything else torch does not know
        if device.type != "cuda":
            return None
        if device.index is None:  # "cuda": the current device, as .to("cuda") takes it
            try:
                device = torch.device("cuda", torch.cuda.current_device())
            except (AssertionError, RuntimeError):  # a torch without CUDA
                return None
        devices.add(device)
    return devices.pop() if len(devices) == 1 else None


def _device_room(device):
    """Bytes that tensors on `device` can have now: the driver's free memory plus what torch's
    caching allocator holds unused (transformers' warm-up reserves the model's size there); None
    when not a CUDA device."""
    if device.type != "cuda":
        return None
    import torch
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class _DeviceRead:
    """The checkpoint files of one from_pretrained call, read onto `device` in the background from
    the moment the first of them is opened: each file's tensors (name -> tensor on the device) are
    handed to the safe_open of that file, once, when it is first asked for a tensor (waiting for
    the read, which overlaps transformers' own work on its keys meanwhile)."""

    def __init__(self, device, files, check_room=False, storage_options=None):
        self.device = device
        self.check_room = check_room  # to_device=None: only when the checkpoint fits the device
        self.storage_options = storage_options  # for URLs
        self.given = [os.fspath(f) for f in files]  # as transformers names them (links kept)
        self.files = [_file_key(f) for f in self.given]
        self._lock = threading.Lock()
        self._thread = None
        self._done = threading.Event()
        self._tensors = None  # realpath -> {name: tensor}; {} when the files are mapped instead
        self._error = None  # what the read raised (a damaged file, ...): raised to every taker

    def take(self, filename):
        """A _Pending for the tensors of `filename` on the device (the read starts with the first
        call), or None when it is not one of the call's files."""
        key = _file_key(filename)
        if key not in self.files:
            return None
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tensorferry-to-device",
                                                daemon=True)
                self._thread.start()
        return _Pending(self, key)

    def tensors(self, key):
        """Waits for the read; the tensors of file `key` (once), or None (handed out already, or
        the read fell back to the mapping). Raises what the read raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        with self._lock:
            return None if self._tensors is None else self._tensors.pop(key, None)

    def finish(self):
        """Waits for a read still running (from_pretrained is returning) and lets go of the
        tensors nobody asked for."""
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            self._tensors = None

    def _run(self):
        try:
            self._tensors = self._read()
        except BaseException as e:  # handed to the threads that wait for it
            self._error = e
        finally:
            self._done.set()

    def _read(self):
        fw = _frameworks.get("pt")
        torch = fw.torch
        storage = self.storage_options
        index, owner = self._index()
        loader = None  # with an index that agrees with its shards: one Loader (one pipeline, one
        # open of every shard)
        try:
            described = {key: [] for key in self.files}  # file -> Output descriptions
            try:
                if index is not None:
                    loader = _index_loader(index, storage)
                if loader is not None:
                    for o in loader._describe():
                        described[owner[o.name]].append(o)
                else:
                    for path in self.files:  # one at a time: each would hold a pipeline
                        with Loader(path, storage_options=storage) as probe:
                            described[path] = probe._describe()
                sizes = [o.bytes for outputs in described.values() for o in outputs]
                if self.check_room and sizes:
                    room = _device_room(self.device)
                    if room is not None and sum(sizes) + 2 * max(sizes) + (256 << 20) > room:
                        return {}  # would not fit beside what the model needs: mapped
                per_file = {key: fw.empty_for(outputs, self.device)
                            for key, outputs in described.items()}
            except (UnsupportedDTypeError, torch.cuda.OutOfMemoryError):
                return {}  # every file mapped
            if loader is not None:
                loader.load_into({n: t for tensors in per_file.values()
                                  for n, t in tensors.items()})
            else:
                for path, tensors in per_file.items():
                    with Loader(path, storage_options=storage) as one:
                        one.load_into(tensors)
            return per_file
        finally:
            if loader is not None:
                loader.close()

    def _index(self):
        """(the model.safetensors.index.json beside the files, {tensor name: file}) when that
        index names exactly them (beside the names transformers gave: in a Hugging Face cache
        they are links into blobs/; for URLs, the object beside them), else (None, None)."""
        if len(self.files) < 2:
            return None, None
        remote = is_url(self.given[0])
        path = posixpath if remote else os.path
        folder = path.dirname(self.given[0])
        index = path.join(folder, "model.safetensors.index.json")
        try:
            if remote:
                text = _core.read_object(index, storage_load_options(self.storage_options),
                                         _MAX_SIDE_FILE)
            else:
                with open(index, "rb") as f:
                    text = f.read()
            owner = {name: _file_key(path.join(folder, shard))
                     for name, shard in json.loads(text)["weight_map"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None, None
        return (index, owner) if set(owner.values()) == set(self.files) else (None, None)


def _index_loader(index, storage):
    """One Loader over the shards `index` names, or None when the index disagrees with them (it
    maps a tensor to a shard that lacks it, or leaves out one a shard holds). transformers uses the
    index only to list the files and reads each shard's own tensors, so such a checkpoint loads
    there; here its files are then read as the index-less route reads them, a Loader per file."""
    try:
        return Loader(index, storage_options=storage)
    except _core.SafetensorError as e:
        if getattr(e, "code", None) in ("index_missing_tensor", "index_unlisted_tensor"):
            return None
        raise


def _file_key(filename):
    """How a checkpoint file is known to _DeviceRead: its real path, or its URL."""
    filename = os.fspath(filename)
    return filename if is_url(filename) else os.path.realpath(filename)


class _Pending:
    """What a safe_open of one of the call's files holds until its first request:
    _DeviceRead.tensors for that file."""

    def __init__(self, read, key):
        self.read = read
        self.key = key

    def get(self):
        return self.read.tensors(self.key)


class safe_open(_safe_open):
    """tensorferry's drop-in safe_open (same arguments and results), answering whole-tensor
    requests from one copy-on-write mapping of the file (see the module's docstring). Files that
    cannot be mapped here (URLs, a CUDA device, backend="pread") behave as tensorferry.safe_open.
    backend=None maps files on local file systems and reads those on network or FUSE file systems
    (as tensorferry.safe_open); an explicit backend="mmap" maps whatever the file system. (The
    subclass loading()/enable() put in transformers' modules, _TransformersSafeOpen, takes the
    backend="mmap" transformers passes, its platform default, as None.)
    """

    def __init__(self, filename, framework, device="cpu", *, backend=None, storage_options=None):
        if storage_options is None and is_url(filename):
            storage_options = _storage_in_force()  # loading(storage_options=...)
        super().__init__(filename, framework, device, backend=backend,
                         storage_options=storage_options)
        self._filename = filename
        self._backend = backend
        self._storage_options = storage_options
        self._map_lock = threading.Lock()
        self._views = None  # name -> view of the mapping; {} when the file cannot be mapped
        # A URL is not mapped: a whole-tensor first request reads the whole object (many ranged
        # GETs in flight) and the requests are answered from those tensors.
        self._mappable = (self._fw.name == "torch" and str(self._device) == "cpu"
                          and backend in (None, "mmap"))
        self._on_device = False  # the views are tensors on a device, each handed out once
        self._pending = None  # a _Pending until the first request: the tensors on the device
        self._populate = getattr(_target, "populate", True)
        call = getattr(_target, "call", None)
        if call is not None and self._mappable:
            self._pending = call.take(filename)

    def close(self):
        super().close()
        self._views = None
        self._pending = None

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
                if self._pending is not None:  # the read onto the device: wait for it once
                    read = self._pending.get()  # what the read raised, every time
                    self._pending = None
                    # _on_device before _views: a thread that finds _views set without the
                    # lock must find _on_device true with it (or it would not pop the tensor).
                    self._on_device = read is not None
                    self._views = read
                if self._views is None:
                    try:
                        # backend="mmap" maps whatever the file system; else the mapping
                        # is for local file systems (Loader's prefer_mmap).
                        # The file this handle opened (its header checked), not its path
                        # again: a file replaced meanwhile is not read under the old names.
                        engine = "mmap" if self._backend == "mmap" else "auto"
                        populate = whole and self._populate
                        with Loader(self._open_reader(), engine=engine, prefer_mmap=True,
                                    populate=populate) as loader:
                            if loader.engine_info["engine"] == "mmap" or (whole and populate):
                                self._views = loader.load()
                            else:
                                # Files not mapped (network or FUSE file systems), and a part
                                # first or nothing to read ahead (a map with disk offload):
                                # each request reads its own bytes, none held by the handle.
                                self._views = {}
                    except UnsupportedDTypeError:
                        self._views = {}  # per tensor, each with its own error if it has one
                views = self._views
        if self._on_device and whole:
            # Handed out once: the parameter owns its memory from now on (converted to another
            # dtype, the original is freed as soon as transformers drops it).
            view = views.pop(name, None)
            if view is not None:
                self._check_as_opened(name, view)
            return view
        view = views.get(name)
        if view is not None and self._on_device:
            self._check_as_opened(name, view)  # a part of it first (get_slice)
        return view

    def _check_as_opened(self, name, view):
        """SafetensorError unless `view` (read onto the device by _DeviceRead, which opens the
        files by their names) has the dtype and shape this handle's header gives `name`: the file
        was replaced between the two opens."""
        info = self._open_reader().info(name)
        fw = self._fw
        if view.dtype != fw.dtype(info.dtype, name) or \
                list(view.shape) != fw.shape(info.dtype, info.shape, name):
            raise _core.SafetensorError(
                f"{self._filename}: tensor {name!r} read as {view.dtype} {list(view.shape)}, but "
                f"the file opened says {info.dtype} {list(info.shape)}: the file was replaced "
                "while it was being loaded; load again once it is complete")

    def get_tensor(self, name):
        view = self._view(name)
        if view is None:
            return super().get_tensor(name)
        # A tensor object of its own on each call (as safetensors returns), over the same bytes:
        # requires_grad_() or resize_() on one does not reach the next.
        return view if self._on_device else view[...]

    def get_slice(self, name):
        reader = self._open_reader()
        info = reader.info(name)  # SafetensorError for a missing name, as the reference
        return self._track(_MappedSlice(self, name, info))


class _TransformersSafeOpen(safe_open):
    """safe_open as transformers' modules call it while loading()/enable() is in force (_apply
    puts this class in place of their safetensors.safe_open). transformers passes backend="mmap"
    on every Linux machine (backend="pread" for MPS and on Windows): its platform default, not
    the user's choice, so it is taken as None and tensorferry still decides (files on network or
    FUSE file systems are read, not mapped; TENSORFERRY_ENGINE=mmap maps whatever the file
    system). Other backends are kept."""

    def __init__(self, filename, framework, device="cpu", *, backend=None, storage_options=None):
        if backend == "mmap":
            backend = None
        super().__init__(filename, framework, device, backend=backend,
                         storage_options=storage_options)


def _whole(index):
    """True for the indexes that select a whole tensor: ..., :, (...,), (:,)."""
    if type(index) is tuple and len(index) == 1:
        index = index[0]
    if index is Ellipsis:
        return True
    return type(index) is slice and index.start is None and index.stop is None and \
        index.step is None


class _MappedSlice(_Slice):
    def __getitem__(self, index):
        if self._owner._closed:  # the slice outlives its file handle: read through its reader
            return super().__getitem__(index)
        whole = _whole(index)
        if not whole and self._dtype == "F4":
            # Indexed in the file's 4-bit elements (_slicing.packed_index), not in the packed
            # pairs a mapped view holds: the reader's way.
            return super().__getitem__(index)
        view = self._owner._view(self._name, whole)
        if view is None:
            return super().__getitem__(index)
        # The framework's own result; a part of the tensor is copied (only its bytes are read).
        return self._owner._fw.own(view[index], view)


# --- models named by a URL ------------------------------------------------------------------------

# The largest file beside the weights that is read whole (configuration, tokenizer, index).
_MAX_SIDE_FILE = 1 << 30
# Weights in other formats: transformers asks for them when it finds no safetensors files; they
# are not read from object storage (reported missing, so that transformers says what it looked for).
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx",
                  ".bin.index.json")

def _storage_in_force():
    """The storage_options of the loading() block or enable() in force here, or None."""
    settings = _settings()
    return settings.storage if settings is not None else None


_side_lock = threading.Lock()
_side_root = []  # the process's folder of files read from URLs (made on first use)


def _side_folder(base):
    """The local folder holding the files read from the model at URL `base` (this process's)."""
    with _side_lock:
        if not _side_root:
            root = tempfile.mkdtemp(prefix="tensorferry-transformers-")
            atexit.register(shutil.rmtree, root, True)
            _side_root.append(root)
    return os.path.join(_side_root[0], hashlib.sha256(base.encode()).hexdigest()[:16])


# What a model's prefix holds beside config.json when it holds anything of a model (_url_files).
_MODEL_FILES = ("model.safetensors.index.json", "model.safetensors", "tokenizer_config.json")


def _holds_model(prefix, storage):
    """Whether any of _MODEL_FILES is at the URL `prefix` (a ranged GET each, until one is);
    True when the store cannot tell (an error other than not found)."""
    for name in _MODEL_FILES:
        try:
            _core.object_size(f"{prefix}/{name}", storage)
            return True
        except FileNotFoundError:
            continue
        except OSError:
            return True
    return False


def _url_files(url, filenames, subfolder="", revision=None, raise_missing=True,
               raise_connection=True):
    """transformers' cached_files for a model named by a URL: each .safetensors file as its URL
    (read later through safe_open), each other file read whole into this process's folder for the
    model (a fresh copy every call: they are small) and named by its local path. Missing files,
    and on request unreachable ones, are left out (None when none is left), or an OSError naming
    the URL as transformers raises for a local folder."""
    if revision not in (None, "main"):
        raise OSError(f"{url}: revision={revision!r}: a model in object storage has no revisions "
                      f"(name the prefix that holds the version instead)")
    base = url.rstrip("/")
    storage = storage_load_options(_storage_in_force())
    found = []
    for name in filenames:
        rel = posixpath.normpath(posixpath.join(subfolder or "", name))
        if rel.startswith(("/", "../")) or rel == "..":
            raise OSError(f"{url}: {name!r} is outside the model's prefix")
        target = f"{base}/{rel}"
        try:
            if rel.endswith(_OTHER_WEIGHTS):
                raise FileNotFoundError(
                    f"{target}: tensorferry reads only safetensors weights from object storage")
            if rel.endswith(".safetensors"):
                if not raise_missing:  # a probe (model.safetensors or the index?): ask the store
                    _core.object_size(target, storage)
                found.append(target)  # a missing shard is reported by its read, naming its URL
                continue
            data = _core.read_object(target, storage, _MAX_SIDE_FILE)
        except FileNotFoundError as e:
            if not raise_missing:
                continue
            if name != "config.json":
                raise OSError(f"{url} does not appear to have a file named {rel} ({e})") from e
            # A folder without config.json is left to transformers (as it does for a local one),
            # a model that is not there at all (a mistyped URL) is an error naming it.
            where = posixpath.dirname(target)
            if not _holds_model(where, storage):
                raise OSError(f"{where} is not a model: none of config.json, "
                              f"{', '.join(_MODEL_FILES)} is there ({e})") from e
            continue
        except OSError:
            if raise_connection:
                raise
            continue
        local = os.path.join(_side_folder(base), *rel.split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(local), prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temporary, local)  # whole or not at all, whichever thread wrote it
        except BaseException:
            os.unlink(temporary)
            raise
        found.append(local)
    return found or None


# --- models named by an hf:// path ----------------------------------------------------------------

_COMMIT = re.compile(r"[0-9a-f]{40}")  # a commit, as the hub names it


class _HubLoad(str):
    """Where one transformers load reads a model named by an hf:// path (or by a plain hub id read
    as one: _streamed_id) from, passed around as that load's `revision`. Each public entry point of
    transformers (from_pretrained, AutoTokenizer.from_pretrained, ...) resolves the revision once
    (transformers.utils.hub.resolve_revision, which _pinning wraps) and hands the result to every
    file lookup of its call, so the decisions kept here last exactly one load: its configuration,
    tokenizer and weights come from one commit, the next load decides again (a branch moved since
    is followed), and a failure (a hub that did not answer) is never remembered past it. A lookup
    made outside such an entry point gets one of its own, for itself alone.

    Its text is the revision's, as huggingface_hub's ResolvedRevision's is; a copy is the object
    itself (transformers deep-copies the keyword arguments that carry it), a pickle plain text."""

    def __new__(cls, name, path, requested, upstream=None, streamed=False):
        text = upstream if isinstance(upstream, str) else (requested or "main")
        self = super().__new__(cls, text)
        self.name = name            # what transformers was given: the hf:// path or the hub id
        self.path = path            # the hf:// path, hf://OWNER/NAME[@REVISION]
        self.requested = requested  # the caller's revision= (None: the path's own, or main)
        # transformers' own resolution of a plain hub id (a ResolvedRevision, or what it returned
        # when that failed): what its own lookups of this load are given.
        self.upstream = upstream
        self.streamed = streamed    # a plain hub id: what tensorferry cannot read is transformers'
        self.storage = _storage_in_force()
        self._lock = threading.Lock()
        self._roots = {}  # subfolder -> root, or None: transformers' own lookup reads it
        self._why = {}  # subfolder -> why an hf:// path's root is None (tensorferry's error)
        # The commit transformers pinned, else (a hub id) a commit asked for, whether the hub
        # answered or not.
        pinned = (getattr(upstream, "resolved", None), requested if streamed else None)
        self._commit = next((c for c in pinned if isinstance(c, str) and _COMMIT.fullmatch(c)),
                            None)
        return self

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return str, (str(self),)

    def repo(self):
        """(OWNER/NAME, the revision the path names or None). OSError for what from_pretrained
        does not take: a revision= beside an hf:// path, a folder inside the repository, a dataset
        or a space."""
        path = self.path
        if not self.streamed and self.requested not in (None, "main"):
            raise OSError(f"{path}: revision={self.requested!r}: name the revision in the path "
                          f"(hf://OWNER/NAME@REVISION)")
        body = path[5:].strip("/")
        revision, after = "", ""
        at = body.find("@")
        if at >= 0:  # (an unescaped refs/pr/N is the revision whole: hub_revision_length)
            end = at + 1 + hub_revision_length(body[at + 1:])
            revision, after, body = body[at + 1:end], body[end:], body[:at]
        parts = body.split("/")
        if len(parts) > 2 or after or parts[0] in ("datasets", "spaces"):
            raise OSError(f"{path}: from_pretrained takes a model repository, hf://OWNER/NAME"
                          f"[@REVISION] (a folder inside it: subfolder=...)")
        return body, revision.replace("%2F", "/").replace("%2f", "/") or None

    def root(self, subfolder=None):
        """The snapshot folder in the local hub cache or the https://.../resolve/<commit> prefix on
        the hub (include/tensorferry/hub.h; tensorferry's Checkpoint decides) that this load reads
        the files under `subfolder` from, or None where transformers' own lookup reads them: no
        safetensors checkpoint there that tensorferry can read (a configuration's or tokenizer's
        repository or folder, a .bin-only model), or, for a plain hub id, a hub that did not
        answer. Decided at the first lookup of each subfolder; the first commit found is the one
        every later decision of the load reads."""
        repo, _ = self.repo()
        sub = (subfolder or "").strip("/")
        with self._lock:  # one decision per subfolder, whichever thread asks first
            if sub not in self._roots:
                self._roots[sub] = self._find(repo, sub)
            return self._roots[sub]

    def _find(self, repo, sub):
        if self.streamed and self._commit is None:
            # transformers could not pin the branch (its resolve_revision failed: a rate limit,
            # a mirror without the API, a hub not reachable): a cached refs/main may be stale,
            # where transformers' own lookup asks the hub file by file (and falls back to the
            # cache itself). Its own lookup reads the model then.
            return None
        probe = self.path if self._commit is None else f"hf://{repo}@{self._commit}"
        if sub:
            probe += "/" + sub
        try:
            with Loader(probe, storage_options=self.storage) as loader:
                first = loader.files[0]
        except OSError as e:
            if self.streamed:
                return None
            if isinstance(e, FileNotFoundError):
                self._why[sub] = e
                return None
            raise
        root = hub_root(first)
        if root is None:  # not a hub-cache snapshot or a hub URL: the checkpoint decides otherwise
            raise OSError(f"{probe}: its files are not in a snapshot of the hub cache or on the "
                          f"hub ({first})")
        self._commit = root[-40:]
        return root

    def own(self, lookup, subfolder=None):
        """transformers' own lookup, `lookup(repository id, revision)`, where root() is None: at
        the commit this load read already when it read one, else at transformers' own resolution
        of a hub id, else at the revision asked for. For an hf:// path, its plain OSError (the
        repository is nowhere) names the path and what tensorferry found too."""
        repo, revision = self.repo()
        if self._commit is not None:
            revision = self._commit
        elif self.streamed:
            repo, revision = self.name, \
                self.upstream if self.upstream is not None else self.requested
        try:
            return lookup(repo, revision)
        except OSError as e:
            why = self._why.get((subfolder or "").strip("/"))
            if self.streamed or why is None or type(e) is not OSError:
                raise
            raise OSError(f"{why}; nor did transformers' own lookup of {repo} find it: {e}") from e


def _hub_load(path_or_repo_id, args, kwargs):
    """The _HubLoad that reads `path_or_repo_id` in a file lookup with `args` and `kwargs`: the one
    its load's revision carries, else one for this lookup alone; None where tensorferry does not
    read it (not an hf:// path, and not a hub id read as one: _streamed_id)."""
    revision = kwargs.get("revision")
    carried = isinstance(revision, _HubLoad)
    if carried and revision.name == path_or_repo_id:
        load, requested = revision, revision.requested
    else:
        load, requested = None, revision.requested if carried else revision
    if is_hub_path(path_or_repo_id):
        return load or _HubLoad(path_or_repo_id, path_or_repo_id, requested)
    path = _streamed_id(path_or_repo_id, args, dict(kwargs, revision=requested))
    if path is None:
        return None
    return load or _HubLoad(path_or_repo_id, path, requested, streamed=True)


def _own_revision(name, kwargs):
    """`kwargs` for transformers' own lookup of `name`: a _HubLoad revision replaced by the one
    transformers' own rules take (its own resolution of this hub id, else the caller's)."""
    revision = kwargs.get("revision")
    if isinstance(revision, _HubLoad):
        mine = revision.streamed and revision.name == name
        kwargs["revision"] = revision.upstream if mine else revision.requested
    return kwargs


def _pinning(original):
    """transformers.utils.hub.resolve_revision (each public entry point's one resolution of the
    revision, passed to every file lookup of its call): for a model named by an hf:// path, or by
    a hub id read as one, a _HubLoad that keeps this call's decisions (transformers' own
    resolution of a hub id inside it)."""

    @functools.wraps(original)
    def wrapper(path_or_repo_id, revision=None, **kwargs):
        if not enabled():  # left in a module imported while enabled: transformers' own
            return original(path_or_repo_id, revision, **kwargs)
        if isinstance(revision, _HubLoad):
            if revision.name == path_or_repo_id:
                return revision  # resolved once per load: nested entry points keep it
            revision = revision.requested  # another repository (an adapter's base model)
        if is_hub_path(path_or_repo_id):
            return _HubLoad(path_or_repo_id, path_or_repo_id, revision)
        upstream = original(path_or_repo_id, revision, **kwargs)
        lookup = {k: kwargs[k] for k in ("token", "local_files_only", "cache_dir", "repo_type")
                  if k in kwargs}
        path = _streamed_id(path_or_repo_id, (), dict(lookup, revision=revision))
        if path is None:
            return upstream
        return _HubLoad(path_or_repo_id, path, revision, upstream=upstream, streamed=True)

    return wrapper


def _templates(original):
    """transformers.utils.hub.list_repo_templates (the chat templates under a model's
    additional_chat_templates/), listing an s3:// or gs:// prefix; an HTTP server cannot be listed (none
    found there)."""

    @functools.wraps(original)
    def wrapper(repo_id, *args, **kwargs):
        if not enabled():  # left in a module imported while enabled: transformers' own
            return original(repo_id, *args, **kwargs)
        if is_hub_path(repo_id):
            load = _hub_load(repo_id, (), kwargs)
            kwargs.pop("revision", None)
            root = load.root()
            if root is None:  # nothing tensorferry reads there: transformers lists the repository
                return load.own(lambda repo, revision: original(repo, *args, revision=revision,
                                                                **kwargs))
            if not is_url(root):
                return original(root, *args, **kwargs)
            return []  # an HTTP server cannot be listed
        _own_revision(repo_id, kwargs)
        if not is_url(repo_id if isinstance(repo_id, str) else None):
            return original(repo_id, *args, **kwargs)
        folder = f"{repo_id.rstrip('/')}/additional_chat_templates"
        storage = storage_load_options(_storage_in_force())
        try:
            urls = _core.list_objects(folder, ".jinja", storage)
        except FileNotFoundError:
            return []
        return [u.rsplit("/", 1)[-1] for u in urls]

    return wrapper


def _streamed_id(repo_id, args, kwargs):
    """The hf:// path a plain hub id given to cached_files is read as (enable()'s hub="stream",
    `kwargs`' revision in it); None where transformers' own download applies: hub=
    "download", a name that is not a hub id or is a local path, positional arguments, any of
    cache_dir=, token= (other than True), local_files_only=, force_download=, proxies=, a
    repo_type other than model, or huggingface_hub offline."""
    settings = _settings()
    if settings is None or settings.hub != "stream" or args or not is_hub_id(repo_id) \
            or os.path.exists(repo_id):
        return None
    if kwargs.get("cache_dir") is not None or kwargs.get("token") not in (None, True) \
            or kwargs.get("local_files_only") or kwargs.get("force_download") \
            or kwargs.get("proxies") or kwargs.get("repo_type") not in (None, "model"):
        return None
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return None
    return hub_id_path(repo_id, kwargs.get("revision"))


def _snapshot_files(original, own, snapshot, filenames, args, kwargs):
    """cached_files from a snapshot of the hub cache that holds this load's weights. It may hold
    only some of the repository's files (an earlier load of the weights and configuration alone,
    `hf download --include "*.safetensors"`, a vLLM download, tensorferry's own streaming, which
    keeps what it read): the names it lacks are looked up by `own` (transformers' own lookup at
    the load's commit, which downloads into the same snapshot), whose rules (a missing file an
    error or left out) then apply. In the order of `filenames`; None when none is found."""
    filenames = list(filenames)
    quiet = dict(kwargs, _raise_exceptions_for_missing_entries=False)
    found = set(original(snapshot, filenames, *args, **quiet) or ())
    sub = kwargs.get("subfolder") or ""
    local = {n: os.path.join(snapshot, os.path.join(sub, n)) for n in filenames}
    lacking = [n for n in filenames if local[n] not in found]
    more = (own(lacking) or []) if lacking else []

    def fetched(name):  # where the lookup put `name`, if it found it
        tail = os.sep + os.path.join(sub, name)
        return next((f for f in more if str(f).endswith(tail)), None)

    ordered = [local[n] if local[n] in found else fetched(n) for n in filenames]
    ordered = [f for f in ordered if f is not None]
    return ordered or None


def _resolving(original):
    """transformers.utils.hub.cached_files, taking s3://, gs:// and http(s):// URLs (_url_files)
    and hf:// paths and plain hub ids read as their hf:// paths (_HubLoad)."""

    @functools.wraps(original)
    def wrapper(path_or_repo_id, filenames, *args, **kwargs):
        if not enabled():  # left in a module imported while enabled: transformers' own
            return original(path_or_repo_id, filenames, *args, **kwargs)
        load = _hub_load(path_or_repo_id, args, kwargs)
        if load is not None:
            root = load.root(kwargs.get("subfolder"))
            kwargs.pop("revision", None)

            def own(names):  # transformers' own lookup, of the repository at this load's commit
                return load.own(lambda repo, revision: original(
                    repo, names, *args, revision=revision, **kwargs), kwargs.get("subfolder"))

            # Weights tensorferry does not read (use_safetensors=False, gguf_file=): the hub
            # serves them, through transformers' own download.
            if root is None or any(str(n).endswith(_OTHER_WEIGHTS) for n in filenames):
                return own(filenames)
            path_or_repo_id = root
            if not is_url(path_or_repo_id):  # a snapshot in the hub cache: a local folder
                return _snapshot_files(original, own, root, filenames, args, kwargs)
        else:
            _own_revision(path_or_repo_id, kwargs)
        if not is_url(path_or_repo_id if isinstance(path_or_repo_id, str) else None):
            return original(path_or_repo_id, filenames, *args, **kwargs)
        return _url_files(
            path_or_repo_id, list(filenames), subfolder=kwargs.get("subfolder") or "",
            revision=kwargs.get("revision"),
            raise_missing=kwargs.get("_raise_exceptions_for_missing_entries", True),
            raise_connection=kwargs.get("_raise_exceptions_for_connection_errors", True))

    return wrapper


def _original_safe_open():
    import safetensors
    return safetensors.safe_open


def enable(to_device=None, storage_options=None, hub="stream"):
    """Routes transformers' safetensors reads through tensorferry until disable() (idempotent
    while enabled). `to_device`: whether a device map onto one CUDA device reads the checkpoint
    straight into tensors on it: None (default) when it fits the device, True always, False never
    (see the module's docstring). `storage_options`: object-storage settings (s3_*, object_*:
    docs/object_storage.md) for models named by an s3://, gs:// or http(s):// URL (the AWS_* variables
    and ~/.aws files apply without them). `hub`: how a model named by its hub id ("OWNER/NAME",
    not a local folder) is read: "stream" (default) as its hf:// path (the local hub cache, else
    streamed from the hub while kept in the hub cache), except where transformers' own download
    applies (cache_dir=, token=, local_files_only=, force_download=, proxies=, offline);
    "download": transformers' download first. ImportError when transformers is not installed."""
    settings = _checked(to_device, storage_options, hub)
    with _lock:
        _acquire()
        _enabled.append(settings)


def disable():
    """Undoes the latest enable() (loading() blocks undo themselves): once neither is in force,
    transformers reads with safetensors again."""
    with _lock:
        if not _enabled:
            return
        _enabled.pop()
        _release()


def _checked(to_device, storage_options, hub):
    if to_device not in (None, True, False):
        raise _core.InvalidArgumentError(
            f"to_device must be None, True or False, not {to_device!r}")
    if hub not in ("stream", "download"):
        raise _core.InvalidArgumentError(f"hub must be 'stream' or 'download', not {hub!r}")
    mode = None if to_device is None else bool(to_device)
    storage = storage_load_options(storage_options)  # names checked here, values at first use
    return _Settings(mode, storage or None, hub)


def _acquire():
    """One more enable() or loading() in force (_lock held): the patches are applied by the
    first."""
    global _depth
    if _depth == 0:
        _apply()
    _depth += 1


def _release():
    """One fewer (_lock held): the last one restores transformers."""
    global _depth
    _depth -= 1
    if _depth == 0:
        _restore()


def enabled():
    """Whether transformers' reads go through tensorferry now."""
    return _depth > 0


@contextmanager
def loading(to_device=None, storage_options=None, hub="stream"):
    """Within the block, transformers' from_pretrained (and everything else in transformers that
    opens safetensors files) reads through tensorferry, and takes s3://, gs:// and http(s):// URLs and
    hf://OWNER/NAME[@REVISION] paths (the local hub cache, else streamed from the hub) for models,
    a plain hub id as its hf:// path; `to_device`, `storage_options` and `hub` as in enable().
    The settings are this thread's (its context's): blocks in other threads, and enable(), keep
    theirs."""
    settings = _checked(to_device, storage_options, hub)
    with _lock:
        _acquire()
    token = _block.set(settings)
    try:
        yield
    finally:
        _block.reset(token)
        with _lock:
            _release()


def _host_only(load_config):
    """Whether `load_config` keeps every parameter in host memory: no device map or one of "cpu"
    entries only, no quantizer, no device mesh."""
    device_map = getattr(load_config, "device_map", None)
    if getattr(load_config, "hf_quantizer", None) is not None or \
            getattr(load_config, "device_mesh", None) is not None:
        return False
    return not device_map or all(str(v) == "cpu" for v in device_map.values())


def _with_target(original):
    """transformers' PreTrainedModel._load_pretrained_model (a staticmethod), noting on the calling
    thread the files to read whole in the background from their first open: onto the one CUDA
    device the load_config puts every parameter on (to_device), or, for a checkpoint in object
    storage whose parameters stay in host memory, into host memory (one Loader over the index:
    every file's ranged GETs in flight together, instead of each file read when transformers
    first asks for one of its tensors)."""
    function = original.__func__

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        files = kwargs.get("checkpoint_files", args[2] if len(args) > 2 else None)
        load_config = kwargs.get("load_config", args[3] if len(args) > 3 else None)
        settings = _settings()
        mode = settings.to_device if settings is not None else False
        device = _direct_device(load_config) if mode is not False else None
        readable = bool(files) and all(isinstance(f, (str, os.PathLike)) and
                                       os.fspath(f).endswith(".safetensors") for f in files)
        check_room = mode is None
        if device is None and readable and all(is_url(os.fspath(f)) for f in files) and \
                _host_only(load_config):
            import torch
            device, check_room = torch.device("cpu"), False
        previous = getattr(_target, "call", None)
        previous_populate = getattr(_target, "populate", True)
        storage = _storage_in_force()
        call = _DeviceRead(device, files, check_room=check_room, storage_options=storage) \
            if device is not None and readable else None
        _target.call = call
        device_map = getattr(load_config, "device_map", None) or {}
        _target.populate = "disk" not in (str(v) for v in device_map.values())
        try:
            return function(*args, **kwargs)
        finally:
            _target.call = previous
            _target.populate = previous_populate
            if call is not None:
                call.finish()

    return staticmethod(wrapper)


def _disk_offload(original):
    """transformers' accelerate_disk_offload, given no checkpoint files when they are URLs (a
    model in object storage or streamed from the hub): the weights a device map puts on "disk"
    are then saved into offload_folder as they load (transformers' own error when there is none),
    because accelerate reads offloaded weights later with the stock safe_open, which opens local
    files only; an offload index naming the URLs would fail at the model's first forward."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        args = list(args)
        files = kwargs.get("checkpoint_files", args[2] if len(args) > 2 else None)
        if files and any(is_url(os.fspath(f)) or is_hub_path(os.fspath(f)) for f in files):
            if "checkpoint_files" in kwargs:
                kwargs["checkpoint_files"] = None
            else:
                args[2] = None
        return original(*args, **kwargs)

    return wrapper


def _apply():
    original = _original_safe_open()
    for name in _LOADING_MODULES:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "transformers" or name.startswith("transformers.")):
            continue
        if getattr(module, "safe_open", None) is original:
            _patched.append((module, "safe_open", original, _TransformersSafeOpen))
            module.safe_open = _TransformersSafeOpen
    # For enable(to_device=True): the device map and the files of each from_pretrained. A
    # transformers without this method still reads through tensorferry, through the mapping.
    model_class = sys.modules["transformers.modeling_utils"].PreTrainedModel
    load = vars(model_class).get("_load_pretrained_model")
    if isinstance(load, staticmethod):
        wrapped = _with_target(load)
        _patched.append((model_class, "_load_pretrained_model", load, wrapped))
        model_class._load_pretrained_model = wrapped
    # Models named by a URL or an hf:// path: the files transformers looks for, found in the
    # bucket, the hub cache or on the hub; the revision each load resolves once, carrying where
    # that load reads an hf:// path from (_HubLoad).
    hub = importlib.import_module("transformers.utils.hub")
    for attr, wrap in (("cached_files", _resolving), ("list_repo_templates", _templates),
                       ("resolve_revision", _pinning)):
        original_function = vars(hub).get(attr)
        if original_function is not None:
            _patch_modules(attr, original_function, wrap(original_function))
    offload = vars(importlib.import_module("transformers.integrations.accelerate")).get(
        "accelerate_disk_offload")
    if offload is not None:
        _patch_modules("accelerate_disk_offload", offload, _disk_offload(offload))
    missing = [n for n in _LOADING_MODULES
               if getattr(sys.modules[n], "safe_open", None) is not _TransformersSafeOpen]
    if missing:
        _restore()
        raise _core.InvalidArgumentError(
            f"tensorferry.transformers: {', '.join(missing)} no longer reads through "
            f"safetensors.safe_open; this transformers version is not supported (tested with "
            f"the version pinned in requirements.txt)")


def _transformers_modules():
    """The transformers modules imported now, with their namespaces (vars: no lazy import)."""
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "transformers" or name.startswith("transformers.")):
            yield module, getattr(module, "__dict__", {})


def _patch_modules(attr, original, replacement):
    """`replacement` in place of `original` wherever a transformers module holds it as `attr`
    (modules import these functions by name: from .utils.hub import cached_files)."""
    for module, namespace in _transformers_modules():
        if namespace.get(attr) is original:
            _patched.append((module, attr, original, replacement))
            setattr(module, attr, replacement)


def _restore():
    undone = {}  # (attribute, id of the replacement) -> (attribute, original, replacement)
    while _patched:
        owner, attr, original, replacement = _patched.pop()
        if vars(owner).get(attr) is replacement:
            setattr(owner, attr, original)
        undone[attr, id(replacement)] = (attr, original, replacement)
    # A module first imported while the patches were in force took a replacement by name from a
    # patched one (from .utils.hub import cached_files): it gets the original back too.
    for module, namespace in _transformers_modules():
        for attr, original, replacement in undone.values():
            if namespace.get(attr) is replacement:
                setattr(module, attr, original)

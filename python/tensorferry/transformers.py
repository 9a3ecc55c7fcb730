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
the index's shards, checksums checked), while transformers goes on with its keys (renaming,
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
weights in other formats (.bin, ...) are not read from a bucket.

Models named by an hf://OWNER/NAME[@REVISION] path: read from the local hub cache's snapshot when
it holds the checkpoint (as transformers reads a local folder), else streamed from the hub
(HF_ENDPOINT; HF_TOKEN) as the URL of its resolve/<commit> prefix, above; which one is decided
once per path while loading() is in force, so everything one from_pretrained reads comes from one
commit (include/tensorferry/hub.h).

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
import shutil
import sys
import tempfile
import threading
from contextlib import contextmanager

from . import _core, _frameworks
from ._frameworks import UnsupportedDTypeError
from ._loader import Loader
from ._safe_open import (_Slice, hub_id_path, hub_root, is_hub_id, is_hub_path, is_url,
                         storage_load_options)
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
# on it; its loading threads materialize the tensors later).
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
        loader = None  # with an index: one Loader (one pipeline, one open of every shard)
        try:
            described = {key: [] for key in self.files}  # file -> Output descriptions
            try:
                if index is not None:
                    loader = Loader(index, storage_options=storage)
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
                    self._views = self._pending.get()  # what the read raised, every time
                    self._pending = None
                    self._on_device = self._views is not None
                if self._views is None:
                    try:
                        # backend="mmap" maps whatever the file system; else the mapping
                        # is for local file systems (Loader's prefer_mmap).
                        engine = "mmap" if self._backend == "mmap" else "auto"
                        with Loader(self._filename, engine=engine, prefer_mmap=True,
                                    populate=whole,
                                    storage_options=self._storage_options) as loader:
                            if whole or loader.engine_info["engine"] == "mmap":
                                self._views = loader.load()
                            else:  # a part first, files not mapped: each slice reads its bytes
                                self._views = {}
                    except UnsupportedDTypeError:
                        self._views = {}  # per tensor, each with its own error if it has one
                views = self._views
        if self._on_device and whole:
            # Handed out once: the parameter owns its memory from now on (converted to another
            # dtype, the original is freed as soon as transformers drops it).
            return views.pop(name, None)
        return views.get(name)

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
            if raise_missing and rel != "config.json":  # config.json: as transformers does
                raise OSError(f"{url} does not appear to have a file named {rel} ({e})") from e
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

_hub_lock = threading.Lock()
_hub_roots = {}  # (hf:// path, storage options) -> where it is read from, while loading() is in force


def _hub_key(path):
    """What a decision about hf:// `path` is remembered by while loading() is in force: the path
    and the storage options in force."""
    return (path.rstrip("/"), json.dumps(_storage_in_force(), sort_keys=True, default=str))


def _hub_root(path, revision=None):
    """Where the model at hf:// `path` (a repository, OWNER/NAME[@REVISION]) is read from: its
    snapshot folder in the local hub cache when that holds the checkpoint, else its
    https://.../resolve/<commit> prefix on the hub (include/tensorferry/hub.h; tensorferry's
    Checkpoint decides). Decided once per path while loading() is in force, so that the
    configuration, tokenizer and weights of one from_pretrained come from one commit."""
    if revision not in (None, "main"):
        raise OSError(f"{path}: revision={revision!r}: name the revision in the path "
                      f"(hf://OWNER/NAME@REVISION)")
    repo = path[5:].strip("/").split("/")
    if len(repo) > 2 or (len(repo) == 2 and "@" in repo[0]) or \
            repo[0] in ("datasets", "spaces"):
        raise OSError(f"{path}: from_pretrained takes a model repository, hf://OWNER/NAME"
                      f"[@REVISION] (a folder inside it: subfolder=...)")
    storage = _storage_in_force()
    key = _hub_key(path)
    with _hub_lock:
        if key in _hub_roots:
            return _hub_roots[key]
    try:
        with Loader(path, storage_options=storage) as loader:
            first = loader.files[0]
    except FileNotFoundError as e:
        raise OSError(f"{path} is not a model tensorferry can read: {e}") from e
    root = hub_root(first)
    if root is None:  # not a hub-cache snapshot or a hub URL: the checkpoint decides otherwise
        raise OSError(f"{path}: its files are not in a snapshot of the hub cache or on the hub "
                      f"({first})")
    with _hub_lock:
        return _hub_roots.setdefault(key, root)


def _templates(original):
    """transformers.utils.hub.list_repo_templates (the chat templates under a model's
    additional_chat_templates/), listing an s3:// or gs:// prefix; an HTTP server cannot be listed (none
    found there)."""

    @functools.wraps(original)
    def wrapper(repo_id, *args, **kwargs):
        if is_hub_path(repo_id):
            repo_id = _hub_root(repo_id, kwargs.get("revision"))
            if not is_url(repo_id):
                kwargs.pop("revision", None)
                return original(repo_id, *args, **kwargs)
            return []  # an HTTP server cannot be listed
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


_not_streamed = set()  # hf:// paths of plain hub ids tensorferry cannot read, while enabled


def _streamed_root(repo_id, args, kwargs):
    """_hub_root of a plain hub id's hf:// path (_streamed_id), its revision then taken out of
    `kwargs`; None where transformers' own download applies, including a repository that holds
    no safetensors checkpoint tensorferry can read (a tokenizer's, a .bin-only model's) or a hub
    that cannot be reached (transformers' own rules then decide)."""
    path = _streamed_id(repo_id, args, kwargs)
    if path is None:
        return None
    key = _hub_key(path)
    with _hub_lock:
        if key in _not_streamed:
            return None
    try:
        root = _hub_root(path)
    except OSError:
        with _hub_lock:
            _not_streamed.add(key)
        return None
    kwargs.pop("revision", None)
    return root


def _resolving(original):
    """transformers.utils.hub.cached_files, taking s3://, gs:// and http(s):// URLs (_url_files)
    and hf:// paths (_hub_root), and plain hub ids as their hf:// paths (_streamed_id)."""

    @functools.wraps(original)
    def wrapper(path_or_repo_id, filenames, *args, **kwargs):
        root = _streamed_root(path_or_repo_id, args, kwargs)
        if root is None and is_hub_path(path_or_repo_id):
            root = _hub_root(path_or_repo_id, kwargs.pop("revision", None))
        if root is not None:
            path_or_repo_id = root
            if not is_url(path_or_repo_id):  # a snapshot in the hub cache: a local folder
                return original(path_or_repo_id, filenames, *args, **kwargs)
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
        with _hub_lock:
            _hub_roots.clear()
            _not_streamed.clear()


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
        storage = _storage_in_force()
        call = _DeviceRead(device, files, check_room=check_room, storage_options=storage) \
            if device is not None and readable else None
        _target.call = call
        try:
            return function(*args, **kwargs)
        finally:
            _target.call = previous
            if call is not None:
                call.finish()

    return staticmethod(wrapper)


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
    # Models named by a URL: the files transformers looks for, found in the bucket.
    hub = importlib.import_module("transformers.utils.hub")
    files = getattr(hub, "cached_files", None)
    if files is not None:
        wrapped = _resolving(files)
        _patched.append((hub, "cached_files", files, wrapped))
        hub.cached_files = wrapped
    templates = getattr(hub, "list_repo_templates", None)
    if templates is not None:
        wrapped = _templates(templates)
        for name, module in list(sys.modules.items()):
            if module is not None and (name == "transformers" or name.startswith("transformers.")) \
                    and getattr(module, "list_repo_templates", None) is templates:
                _patched.append((module, "list_repo_templates", templates, wrapped))
                module.list_repo_templates = wrapped
    missing = [n for n in _LOADING_MODULES
               if getattr(sys.modules[n], "safe_open", None) is not _TransformersSafeOpen]
    if missing:
        _restore()
        raise _core.InvalidArgumentError(
            f"tensorferry.transformers: {', '.join(missing)} no longer reads through "
            f"safetensors.safe_open; this transformers version is not supported (tested with "
            f"the version pinned in requirements.txt)")


def _restore():
    while _patched:
        owner, attr, original, replacement = _patched.pop()
        if vars(owner).get(attr) is replacement:
            setattr(owner, attr, original)

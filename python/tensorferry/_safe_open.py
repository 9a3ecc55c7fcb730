"""safe_open: the safetensors file API (same names, signatures and results as safetensors 0.8)."""
import errno
import os
import re
import threading
import weakref

from . import _core, _frameworks, _slicing
from ._core import SafetensorError

# backend= of safetensors (plus tensorferry's own engine names) -> load options.
_BACKENDS = {"mmap": "mmap", "pread": "pread", "io_uring": "io_uring", "auto": "auto"}


def default_load_options(backend=None):
    """Load options for whole-file CPU loads (load_file, get_tensors, large get_tensor).

    Default: the mmap engine with populate for a file on a local file system ("auto" with
    prefer_mmap). Measured on warm files (docs/benchmarks.md) it is the fastest way to a fully
    resident tensor set: the file's cached pages are mapped copy-on-write, not copied, and
    populate faults every page in (in parallel) during the load, so the load is complete when it
    returns and a file that shrank is reported then. Tensors are private, writable copy-on-write
    views. A file on a network or FUSE file system is read instead (io_uring, many large reads in
    flight): page faults there wait for a round trip each. TENSORFERRY_ENGINE /
    TENSORFERRY_POPULATE / TENSORFERRY_PREFER_MMAP override the default (docs/python.md);
    backend= overrides them all (backend="mmap" maps whatever the file system).
    """
    if backend is not None:
        engine = _BACKENDS.get(backend) if isinstance(backend, str) else None
        if engine is None:
            raise SafetensorError(
                f'backend "{backend}" is invalid (expected one of: "mmap", "pread"; tensorferry '
                f'also accepts "io_uring" and "auto")')
        options = {"engine": engine}
        if engine == "mmap" and not os.environ.get("TENSORFERRY_POPULATE"):
            options["populate"] = True
        return options
    options = {}
    if not os.environ.get("TENSORFERRY_ENGINE"):
        options["engine"] = "auto"
        if not os.environ.get("TENSORFERRY_PREFER_MMAP"):
            options["prefer_mmap"] = True
        if not os.environ.get("TENSORFERRY_POPULATE"):
            options["populate"] = True
    return options


def device_load_options(backend=None):
    """Load options for loads to a CUDA device: a copying engine (the staging ring reads through
    it; mmap has nothing to offer there), TENSORFERRY_ENGINE or backend= when given."""
    if backend is not None:
        options = default_load_options(backend)
        options.pop("populate", None)
        return options
    return {}


_STORAGE_PREFIXES = ("s3_", "gcs_", "http_", "object_")


def storage_load_options(storage_options):
    """The load options of `storage_options` (a dict of object-storage settings, keys s3_*, gcs_*
    and object_* as docs/object_storage.md lists them), checked by name here and by value in the core.
    """
    if storage_options is None:
        return {}
    if not isinstance(storage_options, dict):
        raise _core.InvalidArgumentError(
            f"storage_options must be a dict, not {type(storage_options).__name__}")
    out = {}
    for key, value in storage_options.items():
        if not isinstance(key, str) or not key.startswith(_STORAGE_PREFIXES):
            raise _core.InvalidArgumentError(
                f"storage_options: unknown setting {key!r} (settings start with s3_, gcs_, "
                f"http_ or object_; see docs/object_storage.md)")
        if value is not None:
            out[key] = value
    return out


def is_url(path):
    """True for the s3://, gs:// and http(s):// paths the core reads through an object source."""
    return isinstance(path, str) and \
        path.split("://", 1)[0].lower() in ("s3", "gs", "http", "https") \
        and "://" in path


def is_hub_path(path):
    """True for hf:// paths (a hub repository: the local hub cache, else the hub itself)."""
    return isinstance(path, str) and path[:5].lower() == "hf://"


# A Hugging Face hub id: NAME or OWNER/NAME (letters, digits, '-', '_', '.'; no '..').
_HUB_ID = re.compile(r"(?!.*\.\.)[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?", re.ASCII)


def is_hub_id(name):
    """True for a string shaped like a hub repository id (OWNER/NAME or NAME), whether or not a
    local path of that name exists."""
    return isinstance(name, str) and _HUB_ID.fullmatch(name) is not None


def hub_id_path(repo_id, revision=None, subfolder=None):
    """The hf:// path of hub repository `repo_id` at `revision` (None or "main": the default
    branch; a '/' in it written %2F, hub.h), optionally a `subfolder` of it."""
    path = "hf://" + repo_id
    if revision and revision != "main":
        path += "@" + revision.replace("/", "%2F")
    if subfolder and subfolder.strip("/"):
        path += "/" + subfolder.strip("/")
    return path


# A file of an hf:// checkpoint as Loader.files lists it lies in a snapshot of the hub cache or
# under the hub's resolve/<commit> prefix (include/tensorferry/hub.h).
_HUB_ROOT = re.compile(r"^(.*/(?:snapshots|resolve)/[0-9a-f]{40})(?:/|$)")


def hub_root(first_file):
    """The snapshot folder or https://.../resolve/<commit> prefix that `first_file`, a file of an
    hf:// checkpoint as Loader.files lists it, lies in (the one commit the load was pinned to);
    None for any other path."""
    match = _HUB_ROOT.match(first_file) if isinstance(first_file, str) else None
    return match.group(1) if match else None


_HUB_COMMIT = re.compile(r"[0-9a-f]{40}")
_SNAPSHOT_ROOT = re.compile(r"^.*/(models|datasets|spaces)--([^/]+)/snapshots/([0-9a-f]{40})$")
_RESOLVE_ROOT = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+(?:/[^/]+)?)/resolve/([0-9a-f]{40})$")


# huggingface_hub's unescaped form of a pull request's or a conversion's ref after '@'
# (parse_hf_uri reads "hf://o/n@refs/pr/1/sub" as revision refs/pr/1, path sub): the core reads
# it so too (src/checkpoint/hub.cc).
_UNESCAPED_REF = re.compile(r"refs/(?:pr/[0-9]+|convert/[A-Za-z0-9._-]+)(?=/|$)")


def hub_revision_length(text):
    """How much of `text` (what follows '@' in an hf:// path) is the revision: up to the first
    '/', or an unescaped refs/pr/N or refs/convert/NAME whole."""
    match = _UNESCAPED_REF.match(text)
    if match:
        return match.end()
    slash = text.find("/")
    return len(text) if slash < 0 else slash


def is_pinned_hub_path(path):
    """True for an hf:// path whose revision is a commit (hf://REPO@<40 hex digits>[/PATH]): it
    names the same bytes wherever and whenever it is read."""
    if not is_hub_path(path):
        return False
    head = path[5:].split("/")
    for part in head[:3]:  # [datasets/|spaces/]OWNER/NAME: the revision is on the repository
        if "@" in part:
            return _HUB_COMMIT.fullmatch(part.split("@", 1)[1]) is not None
    return False


def pinned_hub_path(path, root):
    """`path`, an hf:// path, at the commit that `root` (hub_root of a file its load read: a
    snapshot folder of the hub cache, or <HF_ENDPOINT>/[TYPE/]REPO/resolve/<commit>) lies in:
    hf://[TYPE/]REPO@<commit>[/PATH], which names the same files on any host and at any later
    time (the local hub cache's snapshot of that commit, else the hub at it). None when `root`
    is neither, or `path` does not name root's repository."""
    if not is_hub_path(path) or not isinstance(root, str):
        return None
    match = _SNAPSHOT_ROOT.match(root)
    if match:
        kind, repo, commit = match.group(1), match.group(2).replace("--", "/"), match.group(3)
    else:
        endpoint = (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or "https://huggingface.co"
        match = _RESOLVE_ROOT.match(root[len(endpoint):]) if root.startswith(endpoint) else None
        if not match:
            return None
        kind, repo, commit = match.group(1) or "models", match.group(2), match.group(3)
    rest = path[5:]
    prefix = "" if kind == "models" else kind + "/"
    if not rest.startswith(prefix + repo):
        return None
    rest = rest[len(prefix + repo):]
    if rest.startswith("@"):
        rest = rest[1 + hub_revision_length(rest[1:]):]
    if rest and not rest.startswith("/"):
        return None  # another repository whose name starts with root's
    return f"hf://{prefix}{repo}@{commit}{rest}"


def open_file(filename, options):
    """A _core.Reader of one file. `filename`: str, bytes or os.PathLike; a name that is not
    UTF-8 (a str from os.fsdecode, with surrogate escapes) opens the file os.fsencode names."""
    path = os.fspath(filename)
    if not isinstance(path, str):
        path = os.fsdecode(path)
    if not is_url(path) and os.path.isdir(path):
        # As the core's file-system errors: an IsADirectoryError that is a SafetensorError too.
        error = _core.os_error(errno.EISDIR, f"Is a directory: {path}", path)
        error.code, error.category = "io_error", "io"  # as every raised error carries them
        raise error
    options = dict(options)
    options.setdefault("device", "cpu")  # the Python default, whatever TENSORFERRY_DEVICE says
    return _core.Reader(path, True, options)


class safe_open:
    """Opens a safetensors file lazily: the header is read and fully validated at once, tensor
    bytes only when asked for.

    Args:
        filename (str or os.PathLike): the file.
        framework (str): "pt" (torch) or "np" (numpy).
        device (str, int or torch.device): where tensors go ("cpu" by default). "cuda" /
            "cuda:N" (framework "pt"): get_tensor and get_tensors read straight into GPU memory
            through tensorferry's device pipeline and return CUDA tensors sharing that memory
            (docs/gpu.md); CudaNotFoundError says why when CUDA is not usable here.
        backend (str, keyword-only): "mmap" or "pread" as in safetensors (also "io_uring",
            "auto"); default: tensorferry's choice (see docs/python.md).
        storage_options (dict, keyword-only): object-storage settings for s3://, gs:// and http(s)://
            filenames (s3_endpoint, s3_region, object_concurrency, ...: docs/object_storage.md);
            the AWS_* environment variables and ~/.aws files apply without them.

    Tensors are the caller's: they stay valid after the file is closed.
    """

    def __init__(self, filename, framework, device="cpu", *, backend=None, storage_options=None):
        self._fw = _frameworks.get(framework)
        self._device = self._fw.device(device)
        options = default_load_options(backend)
        core_device = self._fw.core_device(self._device)
        self._core_device = core_device  # "cuda:N" (torch on a GPU), else None
        if core_device is not None:
            options = device_load_options(backend)
            options["device"] = core_device
        options.update(storage_load_options(storage_options))
        self._reader = open_file(filename, options)
        self._closed = False
        self._slices = 0  # live get_slice results (_track): they keep the file open
        self._slices_lock = threading.Lock()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.close()

    def close(self):
        """Closes the file. Tensors already returned stay valid, and so do slices (get_slice):
        the file is closed when the last of them goes, as safetensors keeps it."""
        with self._slices_lock:
            if self._closed:
                return
            self._closed = True
            last = not self._slices
        if last:
            self._reader.close()

    def _track(self, piece):
        """Counts `piece` (a get_slice result) as holding the file open until it goes: the file
        (its descriptor) is closed when the handle is closed and its last slice has gone. (The
        count is locked: a slice's finalizer runs on whichever thread drops it last.)"""
        with self._slices_lock:
            self._slices += 1
        weakref.finalize(piece, self._slice_gone)
        return piece

    def _slice_gone(self):
        with self._slices_lock:
            self._slices -= 1
            last = self._closed and not self._slices
        if last:
            self._reader.close()

    def _open_reader(self):
        if self._closed:
            raise SafetensorError("File is closed")
        return self._reader

    def keys(self):
        """Names of the tensors, sorted."""
        return self._open_reader().names(False)

    def offset_keys(self):
        """Names of the tensors in the order of their data in the file."""
        return self._open_reader().names(True)

    def metadata(self):
        """The "__metadata__" table (dict of str to str), or None when the file has none."""
        return self._open_reader().file_metadata(0)

    def get_tensor(self, name):
        """The tensor `name`, in the framework and on the device of this file."""
        reader = self._open_reader()
        fw = self._fw
        info = reader.info(name)
        st_dtype, st_shape = info.dtype, info.shape
        fw.dtype(st_dtype, name)
        fw.shape(st_dtype, st_shape, name)
        if self._core_device is not None:
            tensors = self._read_into_torch(reader, [name])
            if tensors is not None:
                return tensors[name]
        tensor = fw.finish(reader.get_tensor(name, fw.code), st_dtype)
        return fw.to_device(tensor, self._device)

    def get_tensors(self):
        """Every tensor, as a dict in file order (one load for the whole file)."""
        reader = self._open_reader()
        self._fw.check(reader)
        if self._core_device is not None:
            tensors = self._read_into_torch(reader)
            if tensors is not None:
                return tensors
        return dict(self._fw.finish_all(reader.load(None, self._fw.code), self._device))

    def _read_into_torch(self, reader, names=None):
        """get_tensor(s) on a CUDA device: the tensors `names` (all when None), each allocated by
        torch on the device (its caching allocator, as safetensors' tensors are: torch.cuda's
        memory statistics count them, each is freed on its own and its memory stays in torch's
        cache for the model; no cudaFree, which waits for the device, when one goes), then read
        into in one load through the device pipeline (Reader.load_into), as {name: tensor} in
        file order. None when a dtype has no torch storage of its own (sub-byte types): the
        core's buffers then."""
        fw = self._fw
        torch = fw.torch
        if not torch.cuda.is_available() or any(odd for odd in reader.dtypes(names).values()):
            return None
        tensors = fw.empty_for(reader.describe(names), self._device)
        fw.after_queued_work(tensors.values())
        reader.load_into([(name, self._core_device, t.data_ptr(), t.numel() * t.element_size())
                          for name, t in tensors.items()])
        return tensors

    def get_slice(self, name):
        """A lazy view of tensor `name`: index it (framework rules) to read only what is needed."""
        reader = self._open_reader()
        info = reader.info(name)  # SafetensorError for a missing name, as the reference
        return self._track(_Slice(self, name, info))


class _Slice:
    """What safe_open.get_slice returns: get_shape(), get_dtype() and indexing. It keeps its file's
    reader (and so the file) open after the safe_open is closed, as safetensors' slices do; the
    reader closes when the last reference to it goes."""

    def __init__(self, owner, name, info):
        self._owner = owner
        self._reader = owner._reader
        self._name = name
        self._shape, self._dtype = list(info.shape), info.dtype

    def get_shape(self):
        return list(self._shape)

    def get_dtype(self):
        return self._dtype

    def __getitem__(self, index):
        owner = self._owner
        try:
            result = _slicing.get_slice(self._reader, owner._fw, self._name, index)
        except (IndexError, ValueError, TypeError) as e:
            if not owner._fw.slice_errors_are_safetensor_errors or \
                    isinstance(e, SafetensorError):
                raise
            raise _frameworks.as_safetensor_error(e).with_traceback(e.__traceback__) from None
        return owner._fw.to_device(result, owner._device)

"""vLLM loader plugin: `vllm serve MODEL --load-format tensorferry` (docs/models.md, "vLLM").

The package declares the entry point `tensorferry = "tensorferry.vllm:register"` in vLLM's
`vllm.general_plugins` group; vLLM calls register() in every process it starts (API server,
engine core, workers), which registers TensorferryModelLoader, a BaseModelLoader, under the load
format "tensorferry". Importing this module needs neither vLLM nor torch: only register() and
the loader class (built on first use: `tensorferry.vllm.TensorferryModelLoader`) import vLLM.

What the loader does, per worker: it finds the model's safetensors files as vLLM's default loader
does (local directory or Hugging Face download, the index's weight_map deciding which files count,
the model's allow_patterns_overrides, is_unused_checkpoint_weight and secondary_weights), streams
their tensors with tensorferry.Loader under a byte budget to the device the model's parameters
live on (a CUDA GPU: read straight into GPU memory), and feeds them to `model.load_weights`, which
shards, fuses and converts them as it does for every vLLM loader. Then it checks that every
parameter was loaded, exactly as vLLM's DefaultModelLoader does (same rule, same ValueError).

A model without safetensors files is read from its torch.save files (pytorch_model*.bin, then
*.pt, as vLLM's default loader picks them, its files not needed for inference left out) without
running their pickles (tensorferry's own unpickler, as `tensorferry convert`: docs/convert.md),
tensor by tensor into CPU tensors (vLLM's own .bin iterator torch.loads each file whole), each
zip storage's CRC-32 checked before its tensor is given out. Local files only (a hub id's are
downloaded by vLLM first); not cooperative.

Options come from `--model-loader-extra-config` (LoadConfig.model_loader_extra_config), checked
by parse_options(); an unknown key or a bad value is a ValueError naming it:

    budget        bytes of tensor data held at once: an int, a size string ("2GB", "1.5GiB"),
                  0 or None (unbounded), or "auto" (default: 1 GiB, raised to four times the
                  largest tensor). vLLM's load_weights may keep up to two earlier tensors alive
                  while it asks for the next (Llama's stacked q/k/v and gate/up parameters), and
                  batches are at most half the budget, so a budget must hold the two largest
                  tensors and one batch: four of the largest tensor; a smaller explicit one is
                  an error naming that tensor. A model that keeps more (a whole layer, with online
                  quantization or an in-place reload; every weight, with list(weights)) grows
                  the automatic budget (doubled, with a warning, reading on from the next
                  tensor: no weight is given twice); an explicit budget is never exceeded (an
                  error naming the last tensor given), counting every weight given and still
                  alive, whichever file or weight source it came from. On a GPU it bounds the
                  GPU memory of the batches.
    cooperative   false (default) or true: with tensor parallelism, each rank of vLLM's
                  tensor-parallel group reads 1/N of the checkpoint's bytes and receives the rest
                  through that group's collectives (NCCL on GPUs, gloo on CPUs), round by round
                  under the budget. Every rank still gets every whole tensor: vLLM's weight
                  loaders cut each rank's shard themselves. No effect when the group has one rank.
    device        "auto" (default): where the model's parameters are; "cpu": host memory, the
                  model's weight loaders copy to the device.
    threads       I/O threads (positive int; default one per CPU, the pread engine at least 8).
    engine        "auto", "pread", "io_uring" or "mmap" (tensorferry.Loader's engines).
    gds           GPUDirect Storage: "auto" (default), "on" or "off".
    enable_weights_track
                  bool, as for vLLM's default loader: check that every parameter was loaded
                  (default: on for unquantized models whose load_weights reports what it loaded).
    weights       where the model's weights are read from instead of the model's own files: an
                  s3://, gs:// or http(s):// URL (a prefix, an index or a .safetensors file, read
                  straight from object storage: docs/object_storage.md), an
                  hf://OWNER/NAME[@REVISION] path (the local hub cache's snapshot, else streamed
                  from the hub at HF_ENDPOINT with HF_TOKEN, pinned to one commit, nothing
                  written to disk: where vLLM would download the whole model first), a local
                  folder or file (a missing one is a FileNotFoundError), or a hub id. vLLM reads the
                  configuration (and tokenizer) from --model as usual (a local folder or a hub
                  id), so a model whose weights live in a bucket is served with --model naming
                  its configuration. (vLLM itself refuses load formats other
                  than its Run:ai ones for an s3:// --model.) The option is for the model it was
                  given with: vLLM's in-place reload from another path (model_config.model set
                  to it) reads that path.
    storage_options
                  dict of object-storage settings for `weights` (s3_endpoint, s3_region,
                  object_cache_dir, ...; as tensorferry.Loader's storage_options); the AWS_* and
                  TENSORFERRY_OBJECT_* environment variables apply as well.
    hub           how the weights of a model named by its Hugging Face hub id (--model
                  OWNER/NAME, not a local folder) are read: "stream" (default) reads them as
                  hf://OWNER/NAME[@REVISION]: from the local hub cache when it holds them, else
                  streamed from the hub into the model while they are kept in the hub cache as
                  huggingface_hub keeps them (unless storage_options' object_hub_cache is off),
                  instead of vLLM downloading every file before the load; "download": vLLM's own
                  download first, as its default loader. vLLM's download also applies with
                  --download-dir, with ModelScope (VLLM_USE_MODELSCOPE), with ignore_patterns
                  other than vLLM's default, to a repository whose weights are neither in
                  model.safetensors.index.json nor in model.safetensors (the hub cannot be
                  listed file by file), and to a model whose allow_patterns_overrides match
                  none of those files: logged at info level.

torchao-serialized checkpoints (--quantization torchao, or the load config's
safetensors_load_strategy "torchao") are refused with a ValueError naming the setting: use
vLLM's default load format for them.
"""
import dataclasses
import difflib
import fnmatch
import glob
import json
import os
import threading
import time

LOAD_FORMAT = "tensorferry"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_BUDGET = 1 << 30
# A budget holds this many of the largest tensor: the two earlier ones load_weights may keep
# and one batch (at most half the budget) for the next (the `budget` option).
BUDGET_FACTOR = 4

_ENGINES = ("auto", "pread", "io_uring", "mmap")
_GDS = ("auto", "on", "off")
_DEVICES = ("auto", "cpu")
_HUBS = ("stream", "download")


@dataclasses.dataclass(frozen=True)
class Options:
    """The checked model_loader_extra_config (module docstring). budget: "auto", None (unbounded)
    or a byte count > 0."""
    budget: object = "auto"
    cooperative: bool = False
    device: str = "auto"
    threads: int = None
    engine: str = None
    gds: str = None
    enable_weights_track: bool = None
    weights: str = None
    storage_options: dict = None
    hub: str = "stream"


_KEYS = tuple(f.name for f in dataclasses.fields(Options))


def _bad(key, message):
    return ValueError(f"model_loader_extra_config[{key!r}] for load format {LOAD_FORMAT!r}: "
                      f"{message}")


def parse_options(extra):
    """Options from vLLM's model_loader_extra_config (a dict; None: the defaults). Errors:
    ValueError naming the unknown key (with the closest known one) or the bad value."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(f"model_loader_extra_config for load format {LOAD_FORMAT!r} must be a "
                         f"dict, not {type(extra).__name__}")
    for key in extra:
        if key not in _KEYS:
            close = difflib.get_close_matches(str(key), _KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"model_loader_extra_config for load format {LOAD_FORMAT!r}: unknown "
                             f"key {key!r}{hint}; known keys: {', '.join(_KEYS)}")
    values = {}
    if "budget" in extra:
        budget = extra["budget"]
        if budget == "auto":
            values["budget"] = "auto"
        elif budget is None or (type(budget) is int and budget == 0) or budget == "0":
            values["budget"] = None
        else:
            if isinstance(budget, bool) or not isinstance(budget, (int, str)):
                raise _bad("budget", f"{budget!r} is not a size (an int, a string such as "
                           f"\"2GB\", 0 for unbounded, or \"auto\")")
            from . import parse_size
            try:
                values["budget"] = parse_size(budget) or None
            except ValueError as e:
                raise _bad("budget", str(e)) from None
    for key in ("cooperative", "enable_weights_track"):
        if key in extra:
            value = extra[key]
            if not isinstance(value, bool) and not (key == "enable_weights_track"
                                                    and value is None):
                raise _bad(key, f"{value!r} is not true or false")
            values[key] = value
    if "threads" in extra:
        threads = extra["threads"]
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                    or threads <= 0):
            raise _bad("threads", f"{threads!r} is not a positive integer")
        values["threads"] = threads
    for key, choices in (("device", _DEVICES), ("engine", _ENGINES), ("gds", _GDS),
                         ("hub", _HUBS)):
        if key in extra:
            value = extra[key]
            if value is None and key not in ("device", "hub"):
                values[key] = None
                continue
            if value not in choices:
                raise _bad(key, f"{value!r} is not one of {', '.join(map(repr, choices))}")
            values[key] = value
    if "weights" in extra:
        values["weights"] = _check_weights(extra["weights"])
    if "storage_options" in extra:
        storage = extra["storage_options"]
        if storage is not None:
            from . import _safe_open
            try:
                _safe_open.storage_load_options(storage)
            except ValueError as e:
                raise _bad("storage_options", str(e)) from None
        values["storage_options"] = storage
    return Options(**values)


def _check_weights(weights):
    """The `weights` option: None, or a URL tensorferry reads, or a local path (str)."""
    if weights is None:
        return None
    if isinstance(weights, os.PathLike):
        weights = os.fspath(weights)
    if not isinstance(weights, str) or not weights:
        raise _bad("weights", f"{weights!r} is not a URL or a path")
    if "://" in weights and not _is_url(weights):
        scheme = weights.split("://", 1)[0]
        raise _bad("weights", f"{weights!r}: tensorferry reads s3://, gs://, http:// and "
                   f"https:// URLs and hf:// paths, not {scheme}:// (a store with an "
                   f"S3-compatible endpoint is read as s3:// with storage_options "
                   f"{{\"s3_endpoint\": ...}})")
    return weights


# --- which files ------------------------------------------------------------------------------


def _keep(is_unused_weight):
    """Loader's `select` keeping what is_unused_weight(name) does not drop (None: everything)."""
    return None if is_unused_weight is None else (lambda n, _f=is_unused_weight: not _f(n))


@dataclasses.dataclass
class Part:
    """One Loader's worth of a weight source: a checkpoint path (an index or a .safetensors file)
    and the names to load from it (None: all). torch: a torch.save file (.bin, .pt) read by
    _torch_file (select is then a callable or None)."""
    checkpoint: str
    select: list = None
    torch: bool = False


TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def is_torch_file(path):
    """Whether `path` names a torch.save file by its suffix (.bin, .pt, .pth), as vLLM tells
    them from safetensors files, or the index of such files (pytorch_model.bin.index.json)."""
    return path.endswith(TORCH_SUFFIXES) or \
        path.endswith(tuple(s + ".index.json" for s in TORCH_SUFFIXES))


def weight_patterns(allow_patterns=None, fall_back_to_pt=True):
    """The file patterns a weight source is looked up with, in order (the first that matches
    any file picks the files), as vLLM's default loader for --load-format auto: safetensors,
    then .bin, then .pt unless the model or source says not to fall back to them; the model's
    allow_patterns_overrides instead when it has them."""
    if allow_patterns is not None:
        return list(allow_patterns)
    return ["*.safetensors", "*.bin"] + (["*.pt"] if fall_back_to_pt else [])


def plan_parts(folder, files, is_unused_weight=None):
    """The Loaders that read exactly `files` (paths inside `folder`, as vLLM's file selection
    leaves them): the folder's index with a `select` of the tensors those files hold when the
    index names them all (one Loader for a sharded checkpoint); without an index, the folder
    when they are all of its safetensors files (one Loader, which checks numbered series); else
    one Loader per file.
    is_unused_weight(name) -> True drops single tensors the model says it does not load."""
    index = os.path.join(folder, INDEX_NAME)
    parts = []
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map") or {}
        in_index = {os.path.normpath(os.path.join(folder, v)) for v in weight_map.values()}
        wanted = {os.path.normpath(p) for p in files}
        if wanted <= in_index:
            names = None
            if wanted != in_index or is_unused_weight is not None:
                names = [n for n, v in weight_map.items()
                         if os.path.normpath(os.path.join(folder, v)) in wanted
                         and not (is_unused_weight is not None and is_unused_weight(n))]
            parts.append(Part(index, names))
            return parts
    keep = _keep(is_unused_weight)
    # Every safetensors file of a folder without an index (vLLM's selection when nothing is
    # filtered): the folder itself, one Loader, which refuses an incomplete numbered series
    # (model-00002-of-00003.safetensors missing) naming the missing files, instead of loading
    # the others and leaving the model's weights half initialized.
    if not os.path.isfile(index):
        listed = {os.path.normpath(p) for p in glob.glob(os.path.join(folder, "*.safetensors"))}
        if listed and {os.path.normpath(p) for p in files} == listed:
            return [Part(folder, keep)]
    for path in sorted(files):
        parts.append(Part(path, keep))
    return parts


# What tensorferry checks of a whole checkpoint (an index, a folder) and vLLM's own loader never
# sees: it reads each selected file whole, using the index only to choose the files.
# (A file the index names but the folder lacks stays an error: vLLM's loader would load the others
# and say only at the end which weights were not initialized.)
_PER_FILE_CODES = frozenset({"index_path_escape", "index_missing_tensor", "index_unlisted_tensor",
                             "index_duplicate_tensor"})


def natural_order(paths):
    """`paths` in vLLM's file order (its _natural_sort_key: numbers in the file name compared
    as numbers), so that of one name in two files the same file's tensor is given last."""
    import re

    def key(path):
        return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", os.path.basename(path))]
    return sorted(paths, key=key)


def openable_parts(parts, files, is_unused_weight=None, warn=None):
    """`parts` (plan_parts' for `files`), where a Part over the folder's index or the folder
    itself is opened first: when tensorferry refuses that whole checkpoint for what vLLM's own
    loader does not check (shards that are links to files outside the folder, an index that
    leaves out or misplaces a tensor, one tensor name in two files of a folder without an
    index), one Part per file instead, as vLLM reads them; warn(message) says why. Other errors
    (a damaged file, an incomplete numbered series) are raised."""
    import tensorferry
    from . import _core
    out = []
    for part in parts:
        if part.torch or not (part.checkpoint.endswith(INDEX_NAME) or
                              os.path.isdir(part.checkpoint)):
            out.append(part)
            continue
        try:
            tensorferry.Loader(part.checkpoint).close()
        except _core.SafetensorError as e:
            if getattr(e, "code", None) not in _PER_FILE_CODES:
                raise
            if warn is not None:
                warn(f"tensorferry: {part.checkpoint} is read file by file, as vLLM's own "
                     f"loader reads it: as one checkpoint it is refused ({e})")
            keep = _keep(is_unused_weight)
            out.extend(Part(p, keep) for p in natural_order(files))
            continue
        out.append(part)
    return out


def matching_files(files, patterns):
    """The files (URLs or paths) the first of `patterns` that matches any of them picks, by file
    name, as vLLM picks local files; [] when none matches."""
    for pattern in patterns:
        chosen = [f for f in files if fnmatch.fnmatch(f.rsplit("/", 1)[-1], pattern)]
        if chosen:
            return chosen
    return []


def plan_remote(url, files, allow_patterns=None, is_unused_weight=None):
    """The Loaders that read an object-storage checkpoint `url` (whose files are `files`, as
    tensorferry.Loader lists them): the URL itself, one Loader, unless the model's
    allow_patterns_overrides leave out some of its files (then one per kept file). Files are
    matched by name as vLLM matches local ones (the first pattern that matches any file wins)."""
    keep = _keep(is_unused_weight)
    if allow_patterns is None:
        return [Part(url, keep)]
    chosen = matching_files(files, allow_patterns)
    if not chosen:
        raise RuntimeError(f"Cannot find any safetensors weights in {url!r} matching the model's "
                           f"allow_patterns_overrides {list(allow_patterns)}")
    if sorted(chosen) == sorted(files):
        return [Part(url, keep)]
    return [Part(f, keep) for f in sorted(chosen)]


def hub_path(model_or_path, revision, subfolder, options, download_dir=None,
             ignore_patterns=None):
    """The hf:// path that the weights of `model_or_path`, a Hugging Face hub id, are read from
    (the `hub` option, "stream"), or None where vLLM's download applies: a local path or a URL,
    hub="download", a --download-dir, ModelScope (VLLM_USE_MODELSCOPE), ignore_patterns other
    than vLLM's default. A revision's '/' is written %2F (hub.h)."""
    from . import _safe_open
    if options.hub != "stream" or download_dir is not None \
            or os.environ.get("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true") \
            or not _safe_open.is_hub_id(model_or_path) or os.path.exists(model_or_path):
        return None
    if ignore_patterns not in (None, [], ["original/**/*"]):
        return None
    return _safe_open.hub_id_path(model_or_path, revision, subfolder)


# --- registration ------------------------------------------------------------------------------

_CLASS = None
_REGISTERED = False


def loader_class():
    """TensorferryModelLoader, the vllm BaseModelLoader subclass (built on first call; imports
    vLLM)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_class()
    return _CLASS


def register():
    """The `vllm.general_plugins` entry point: registers TensorferryModelLoader under the load
    format "tensorferry" (vllm.model_executor.model_loader.register_model_loader). Safe to call
    more than once in a process (registers once)."""
    global _REGISTERED
    from vllm.model_executor.model_loader import register_model_loader
    cls = loader_class()
    if not _REGISTERED:
        register_model_loader(LOAD_FORMAT)(cls)
        _REGISTERED = True
    return cls


def __getattr__(name):
    if name == "TensorferryModelLoader":
        return loader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_draft(model_config):
    """Whether `model_config` is the speculative-decoding draft of the vLLM config being built
    (vLLM builds it with the served model's load config unless draft_load_config is given)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return False
    config = get_current_vllm_config_or_none()
    speculative = getattr(config, "speculative_config", None) if config is not None else None
    draft = getattr(speculative, "draft_model_config", None)
    return draft is not None and model_config is draft


_GIVEN_FOR = "_tensorferry_weights_for"  # the ModelConfig attribute (TensorferryModelLoader)


def _same_model(a, b):
    """Whether two --model values name the same model (paths compared resolved)."""
    if a == b:
        return True
    if _is_url(a) or _is_url(b):
        return False
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def _torchao_serialized(model_config, load_config):
    """Whether vLLM's default loader would take the checkpoint of `--quantization torchao` as
    torchao-serialized (its quantization config's quant_method names torchao), as its
    load_weights decides; True where that cannot be told (the config does not load)."""
    try:
        from vllm.model_executor.model_loader.weight_utils import get_quant_config
        quant_config = get_quant_config(model_config, load_config)
    except Exception:  # noqa: BLE001 - undecidable: refused, as before
        return True
    return bool(getattr(quant_config, "is_checkpoint_torchao_serialized", False))


def refuse_torchao(model_config, load_config):
    """ValueError for a torchao-serialized checkpoint (--quantization torchao with a checkpoint
    whose quantization config names torchao, or the load config's safetensors_load_strategy
    "torchao"): its tensors are torchao tensor subclasses that only vLLM's own safetensors
    loading rebuilds. Online torchao quantization (--quantization torchao over a plain
    checkpoint, quantized after loading) is streamed as any other."""
    if getattr(model_config, "quantization", None) == "torchao" and \
            _torchao_serialized(model_config, load_config):
        setting = "quantization='torchao'"
    elif getattr(load_config, "safetensors_load_strategy", None) == "torchao":
        setting = "safetensors_load_strategy='torchao'"
    else:
        return
    raise ValueError(f"load format {LOAD_FORMAT!r} does not read torchao-serialized checkpoints "
                     f"({setting}): their tensors are torchao tensor subclasses rebuilt by "
                     f"vLLM's own loader; use --load-format auto or safetensors")


def _is_url(path):
    """True for what tensorferry reads in place rather than through vLLM's download: s3://,
    gs:// and http(s):// URLs, and hf:// paths (the local hub cache, else streamed from the hub:
    include/tensorferry/hub.h)."""
    from . import _safe_open
    return _safe_open.is_url(path) or _safe_open.is_hub_path(path)


def _make_class():
    import torch
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader import weight_utils

    import tensorferry
    from . import _core, _loader, _safe_open

    logger = init_logger("vllm.tensorferry")

    class TensorferryModelLoader(BaseModelLoader):
        """vLLM model loader reading safetensors checkpoints with tensorferry (module docstring
        of tensorferry.vllm). load_weights(model, model_config) fills an initialized model;
        stats (a dict) describes the last load: tensors, bytes (delivered), bytes_read (read
        by this process), peak_held_bytes, budget, rounds, seconds, cooperative."""

        _reloading = False  # in get_all_weights (vLLM's in-place reload)
        _told_not_cooperative = False  # logged once: torch.save files are read by every rank

        def __init__(self, load_config):
            super().__init__(load_config)
            self.options = parse_options(load_config.model_loader_extra_config)
            self.stats = {}
            # Bytes of the tensors handed to load_weights that are still alive, whatever read
            # them (every Part, source and load of this loader): an explicit budget bounds them
            # all, not each Loader's own.
            self._held = 0  # at least the bytes of self._given still alive (_held_now: exactly)
            self._given = {}  # storage (StorageWeakRef.cdata) -> (StorageWeakRef, bytes)
            self._held_lock = threading.Lock()

        def _hand_out(self, tensor):
            """Counts the memory of `tensor` (about to be given to load_weights) as held until
            its storage goes: views the model keeps of it (narrow, slices of stacked experts)
            keep it counted."""
            from torch.multiprocessing.reductions import StorageWeakRef
            storage = tensor.untyped_storage()
            ref = StorageWeakRef(storage)
            with self._held_lock:
                if ref.cdata not in self._given:
                    self._given[ref.cdata] = (ref, storage.nbytes())
                    self._held += storage.nbytes()

        def _held_now(self):
            """The bytes of the storages given that are still alive (those gone dropped)."""
            with self._held_lock:
                gone = [k for k, (ref, _) in self._given.items() if ref.expired()]
                for k in gone:
                    self._held -= self._given.pop(k)[1]
                return self._held

        def _explicit(self, budget):
            return self.options.budget != "auto" and bool(budget)

        def _refuse_held(self, budget, nbytes, what, checkpoint):
            """BudgetExceededError when an explicit `budget` cannot hold `nbytes` more (`what`,
            of `checkpoint`) beside the weights load_weights still holds."""
            if not self._explicit(budget) or self._held + nbytes <= budget:
                return  # (_held never counts less than is alive: nothing to look up)
            held = self._held_now()
            if held + nbytes <= budget:
                return
            fmt = _core.format_bytes
            raise _core.BudgetExceededError(
                f"load format {LOAD_FORMAT!r}: the model's load_weights keeps {fmt(held)} of "
                f"the weights it was given alive, and {what} of {checkpoint!r} ({fmt(nbytes)}) "
                f"does not fit model_loader_extra_config['budget'] ({fmt(budget)}) beside them "
                f"(a model that keeps weights across its weight sources or files): raise the "
                f"budget, or use \"auto\" or 0 (unbounded)")

        # --- files, as vLLM's default loader finds them ----------------------------------------

        def _files(self, model_or_path, revision, subfolder=None, allow_patterns=None,
                   fall_back_to_pt=True):
            """(folder, files, safetensors) of one weight source, found as vLLM's default
            loader finds them (weight_patterns: safetensors first, else torch.save files);
            downloads when not local. safetensors: whether the files are safetensors (else
            .bin/.pt files, vLLM's files not needed for inference left out)."""
            found = weight_utils.maybe_download_from_modelscope(model_or_path, revision)
            model_or_path = found or model_or_path
            patterns = weight_patterns(allow_patterns, fall_back_to_pt)
            if os.path.isdir(model_or_path):
                folder = model_or_path
            else:
                folder = weight_utils.download_weights_from_hf(
                    model_or_path, self.load_config.download_dir, patterns, revision,
                    subfolder=subfolder, ignore_patterns=self.load_config.ignore_patterns)
                weight_utils.download_safetensors_index_file_from_hf(
                    model_or_path, INDEX_NAME, cache_dir=self.load_config.download_dir,
                    subfolder=subfolder, revision=revision)
            if subfolder is not None:
                folder = os.path.join(folder, subfolder)
            files, pattern = [], None
            for pattern in patterns:  # the first pattern that matches, as vLLM
                files = sorted(glob.glob(os.path.join(folder, pattern)))
                if files:
                    break
            safetensors = bool(files) and pattern.endswith(".safetensors")
            if safetensors:
                if allow_patterns is None:
                    files = weight_utils.filter_duplicate_safetensors_files(files, folder,
                                                                            INDEX_NAME)
            else:
                files = weight_utils.filter_files_not_needed_for_inference(files)
                other = [f for f in files if not is_torch_file(f)]
                if other:
                    raise RuntimeError(
                        f"load format {LOAD_FORMAT!r} reads safetensors files and torch.save "
                        f"files (.bin, .pt, .pth): the weight pattern {pattern!r} of "
                        f"{model_or_path!r} picks {os.path.basename(other[0])!r}")
            if not files:
                raise RuntimeError(
                    f"Cannot find any model weights in {model_or_path!r} (load format "
                    f"{LOAD_FORMAT!r} looks for {', '.join(patterns)})")
            return folder, files, safetensors

        def _primary(self, model_config):
            """Where the model's own weights are: the `weights` option (for the served model
            only: a speculative-decoding draft built with the same load config reads its own),
            else vLLM's model_weights (set for object-storage models), else the model."""
            if self.options.weights is not None and not _is_draft(model_config) \
                    and self._weights_apply(model_config):
                return self._primary_option()
            return getattr(model_config, "model_weights", "") or model_config.model

        def _remember(self, model_config):
            """Records on model_config the model the `weights` option is given for (the model
            of its first load: vLLM's in-place reload from another path changes it)."""
            if self.options.weights is None or getattr(model_config, _GIVEN_FOR, None):
                return
            try:
                setattr(model_config, _GIVEN_FOR, model_config.model)
            except (AttributeError, TypeError, ValueError):  # a config refusing attributes
                pass

        def _weights_apply(self, model_config):
            """Whether the `weights` option is for model_config.model: the model recorded at
            the first load, else the one vLLM read the configuration from (hf_config's
            name_or_path, which a reload to another path leaves as it was)."""
            given = getattr(model_config, _GIVEN_FOR, None)
            if not given:
                hf = getattr(model_config, "hf_config", None)
                given = getattr(hf, "name_or_path", None) or None
            if given is None:
                if not self._reloading:
                    return True  # the first load: the option is for this model
                raise ValueError(
                    f"model_loader_extra_config['weights'] for load format {LOAD_FORMAT!r}: "
                    f"cannot tell whether {self.options.weights!r} is for "
                    f"{model_config.model!r} (the model vLLM reloads from): reload with "
                    f"weights_path naming the weights, or without the option")
            if _same_model(given, model_config.model):
                return True
            logger.info("tensorferry: %s is reloaded from %s: the weights option (%s, for %s) "
                        "does not apply", given, model_config.model, self.options.weights,
                        given)
            return False

        def download_model(self, model_config):
            refuse_torchao(model_config, self.load_config)
            self._remember(model_config)
            primary = self._primary(model_config)
            self._check_weights(primary)
            if os.path.isfile(primary):  # the `weights` option naming one file or an index
                return
            # Object storage is read in place; a hub id is streamed (the `hub` option).
            if not _is_url(primary) and self._hub_path(primary, model_config.revision) is None:
                self._files(primary, model_config.revision)

        def _check_weights(self, path):
            """FileNotFoundError for a `weights` option naming a local path that does not exist
            (anything neither a URL nor shaped like a hub id is a path; a hub id is downloaded
            as --model would be)."""
            from . import _safe_open
            if self.options.weights is None or _is_url(path) or os.path.exists(path) or \
                    path != self._primary_option():
                return
            if path.startswith(("/", ".")) or not _safe_open.is_hub_id(path):
                raise FileNotFoundError(
                    f"model_loader_extra_config['weights'] for load format "
                    f"{LOAD_FORMAT!r}: {self.options.weights!r} does not exist")

        def _primary_option(self):
            weights = self.options.weights
            return weights if weights is None or _is_url(weights) else os.path.expanduser(weights)

        def _hub_path(self, model_or_path, revision, subfolder=None):
            return hub_path(model_or_path, revision, subfolder, self.options,
                            self.load_config.download_dir, self.load_config.ignore_patterns)

        def _hub_parts(self, model_or_path, revision, subfolder, patterns, unused):
            """The Parts of a hub id's weights read as its hf:// path (_hub_path), or None: not
            a hub id streamed, or weights neither in an index nor in a model.safetensors there,
            or none of them matching the model's allow_patterns_overrides (then vLLM downloads
            them). With several ranks and a branch, every rank reads the commit the first rank
            found (_pinned)."""
            if _is_url(model_or_path):
                return None
            path = self._hub_path(model_or_path, revision, subfolder)
            world = None
            if self.options.hub == "stream" and _safe_open.is_hub_id(model_or_path) \
                    and not _safe_open.is_pinned_hub_path(
                        _safe_open.hub_id_path(model_or_path, revision)):
                world = self._world()  # the same answer on every rank: all join, or none
            if world is None:
                return self._hub_parts_at(path, subfolder, patterns, unused, True)[0] \
                    if path is not None else None
            return self._pinned(world, path, lambda: self._hub_parts_at(
                path, subfolder, patterns, unused, True) if path is not None else (None, None),
                lambda pinned: self._hub_parts_at(pinned, subfolder, patterns, unused,
                                                  False)[0])

        def _hub_parts_at(self, path, subfolder, patterns, unused, fall_back):
            """(Parts, the hf:// path pinned to the commit read) of the hf:// path `path`, or
            (None, None) when `fall_back` and vLLM's download applies instead."""
            try:
                with tensorferry.Loader(path, **self._common()) as probe:
                    files = probe.files
            except FileNotFoundError as e:
                if not fall_back:
                    raise
                logger.info("tensorferry: %s: not streamed (%s); vLLM's download instead",
                            path, e)
                return None, None
            if patterns is not None and not matching_files(files, patterns):
                if not fall_back:
                    raise RuntimeError(
                        f"{path}: none of its files {files} match the model's "
                        f"allow_patterns_overrides {list(patterns)}")
                # (a model whose allow_patterns_overrides name files the index does not, such
                # as consolidated*.safetensors beside the shards: vLLM's download finds them)
                logger.info("tensorferry: %s: none of its files match the model's "
                            "allow_patterns_overrides %s; vLLM's download instead", path,
                            list(patterns))
                return None, None
            # Later opens read where this one did (the snapshot, or the hub at the commit the
            # branch named now), not the branch again: one commit, and no more API requests.
            root = _safe_open.hub_root(files[0]) if files else None
            pinned = _safe_open.pinned_hub_path(path, root)
            if root is not None:
                path = root + ("/" + subfolder.strip("/") if subfolder else "")
            return plan_remote(path, files, patterns, unused), pinned

        def _world(self):
            """(vLLM's tensor-parallel group, its pipeline-parallel group) of this rank: the
            ranks of this model replica (not the data-parallel replicas, which may load or
            reload on their own), when they are more than one; else None."""
            try:
                from vllm.distributed import get_pp_group, get_tp_group
                tp, pp = get_tp_group(), get_pp_group()
            except (ImportError, AssertionError):  # no distributed state: one process
                return None
            return (tp, pp) if tp.world_size * pp.world_size > 1 else None

        def _pinned(self, world, what, first, others):
            """What the ranks of this replica (`world`: its tensor- and pipeline-parallel
            groups) read from `what`, an hf:// path naming a branch (or a hub id streamed as
            one), at one commit: the replica's first rank (first of both groups) runs
            `first()`, which returns (its result, the hf:// path pinned to the commit it read,
            or None), and sends the others that path, over its tensor-parallel group and then
            every pipeline-parallel group (each rank of the first stage to the ranks of the
            other stages with its tensor-parallel rank); they return `others(path)`. Without
            this, each rank would ask the hub which commit the branch names, and a branch that
            moves between their questions would give the ranks other weights. When the first
            rank reads without a commit (vLLM's download instead: the result None) the others
            return None too; when it fails, they fail naming it."""
            tp, pp = world
            leader = tp.rank_in_group == 0 and pp.rank_in_group == 0
            message = result = failure = None
            if leader:
                try:
                    result, pinned = first()
                    message = ("none", None) if result is None else ("ok", pinned)
                except BaseException as e:
                    failure = e
                    message = ("failed", f"{type(e).__name__}: {e}")
            # (A group of one rank returns what it is given.)
            message = tp.broadcast_object(message if tp.rank_in_group == 0 else None)
            message = pp.broadcast_object(message if pp.rank_in_group == 0 else None)
            if leader:
                if failure is not None:
                    raise failure
                return result
            kind, pinned = message
            if kind == "failed":
                raise RuntimeError(f"load format {LOAD_FORMAT!r}: the first rank of vLLM's "
                                   f"model replica could not open {what}: {pinned}")
            if kind == "none":
                return None
            if pinned is None:  # read without a commit (no hub root): as the first rank did
                return first()[0]
            logger.info("tensorferry: %s read at %s, the commit the first rank read", what,
                        pinned)
            return others(pinned)

        def _sources(self, model, model_config):
            yield (self._primary(model_config), model_config.revision, None, "",
                   getattr(model, "allow_patterns_overrides", None),
                   getattr(model, "is_unused_checkpoint_weight", None),
                   getattr(model, "fall_back_to_pt_during_load", True))
            for s in getattr(model, "secondary_weights", ()):
                yield (s.model_or_path, s.revision, getattr(s, "subfolder", None),
                       getattr(s, "prefix", ""), getattr(s, "allow_patterns_overrides", None),
                       getattr(s, "is_unused_weight", None), getattr(s, "fall_back_to_pt", True))

        # --- weights ---------------------------------------------------------------------------

        def _device(self, model):
            if self.options.device == "cpu":
                return torch.device("cpu")
            for p in model.parameters():
                if p.device.type != "meta":
                    return p.device
            return torch.device("cpu")

        def _tp(self):
            """(group coordinator, rank, world) of vLLM's tensor-parallel group, or None when
            the mode is not cooperative or the group has one rank."""
            if not self.options.cooperative:
                return None
            from vllm.distributed import get_tp_group
            tp = get_tp_group()
            return (tp, tp.rank_in_group, tp.world_size) if tp.world_size > 1 else None

        def _budget(self, loader, checkpoint):
            """The byte budget for this Loader: checked against its largest tensor (vLLM's
            load_weights may keep two earlier tensors alive while it asks for the next, Llama's
            stacked parameters, and a batch is at most half the budget: BUDGET_FACTOR)."""
            outputs = loader._describe()
            largest = max(outputs, key=lambda o: o.bytes, default=None)
            return self._budget_for(largest.name if largest is not None else None,
                                    largest.bytes if largest is not None else 0, checkpoint)

        def _budget_for(self, largest, size, checkpoint):
            """The byte budget given the largest tensor to load (its name and byte size)."""
            budget = self.options.budget
            if budget == "auto":
                return max(DEFAULT_BUDGET, BUDGET_FACTOR * size)
            if budget is not None and budget < BUDGET_FACTOR * size:
                fmt = _core.format_bytes
                raise ValueError(
                    f"model_loader_extra_config['budget'] for load format {LOAD_FORMAT!r}: "
                    f"{fmt(budget)} is less than four times the largest tensor, "
                    f"{largest!r} ({fmt(size)}, of {checkpoint!r}): vLLM's load_weights "
                    f"may keep two earlier tensors alive while it asks for the next, and a "
                    f"batch is at most half the budget, so the budget must hold two tensors "
                    f"and a batch; use at least {BUDGET_FACTOR * size} bytes, "
                    f"\"auto\", or 0 (unbounded)")
            return budget

        def _progress(self):
            """A progress bar over bytes when vLLM asks for one, on the first rank only (as
            vLLM's own weight iterators)."""
            if not self.load_config.use_tqdm_on_load:
                return False
            import torch.distributed as dist
            return not dist.is_initialized() or dist.get_rank() == 0

        def _common(self):
            o = self.options
            return {k: v for k, v in (("threads", o.threads), ("engine", o.engine),
                                      ("gds", o.gds), ("storage_options", o.storage_options))
                    if v is not None}

        def _remote_parts(self, url, patterns, unused):
            """The Parts of an object-storage weight source (plan_remote). An hf:// path naming
            a branch is read at one commit by every rank (_pinned)."""
            world = None
            if _safe_open.is_hub_path(url) and not _safe_open.is_pinned_hub_path(url):
                world = self._world()
            if world is None:
                return self._remote_parts_at(url, patterns, unused)[0]
            return self._pinned(world, url, lambda: self._remote_parts_at(url, patterns, unused,
                                                                          pin=True),
                                lambda pinned: self._remote_parts_at(pinned, patterns,
                                                                     unused)[0])

        def _remote_parts_at(self, url, patterns, unused, pin=False):
            """(Parts, `url` pinned to the commit read when `pin`: _safe_open.pinned_hub_path).
            Pinned, the Parts read the pinned path too: opening `url` again would ask the hub
            for the branch again."""
            files = None
            if patterns is not None or pin:
                with tensorferry.Loader(url, **self._common()) as probe:
                    files = probe.files
            pinned = None
            if pin and files:
                pinned = _safe_open.pinned_hub_path(url, _safe_open.hub_root(files[0]))
                if pinned is not None:
                    # Its files listed again (under the pinned path) only when patterns choose.
                    parts = self._remote_parts_at(pinned, patterns, unused)[0] \
                        if patterns is not None else plan_remote(pinned, None, None, unused)
                    return parts, pinned
            return plan_remote(url, files, patterns, unused), pinned

        def _stream(self, part, prefix, device):
            """(name, tensor) of one Part through Loader.iter_tensors under the budget. A model
            keeping more alive than the automatic budget holds (a whole layer, with online
            quantization or vLLM's layerwise reload; every weight, with list(weights)) makes
            it grow: doubled, with a warning, reading on from the first tensor not yet given
            (a restart would give the model weights it has already processed). An explicit
            budget is never exceeded: BudgetExceededError naming the last tensor given."""
            # The probe only describes (sizes are the same wherever the tensors go): on the host,
            # so it makes no device pipeline. The load reads the checkpoint the probe opened.
            with tensorferry.Loader(part.checkpoint, select=part.select,
                                    **self._common()) as probe:
                budget = self._budget(probe, part.checkpoint)
                described = probe._describe()
                names = [o.name for o in described]
                rest_of_budget = budget  # (messages and stats say the budget given)
                if self._explicit(budget) and self._held_now():
                    # What earlier Parts gave is still held: this Loader gets the rest of the
                    # budget, which must still hold a batch of its largest tensor.
                    largest = max((o.bytes for o in described), default=0)
                    self._refuse_held(budget, max(budget // 2, largest), "the next batch",
                                      part.checkpoint)
                    rest_of_budget = budget - self._held_now()
                loader = tensorferry.Loader(probe, device=device, budget=rest_of_budget,
                                            select=part.select,
                                            progress=self._progress(),
                                            **self._common())
            given = set()
            last = None
            while loader is not None:
                with loader as current:
                    loader = None
                    try:
                        for name, tensor in current.iter_tensors():
                            given.add(name)
                            last = name
                            self._hand_out(tensor)
                            yield prefix + name, tensor
                            del tensor  # before the next batch is asked for
                        exceeded = None
                    except _core.BudgetExceededError as e:
                        exceeded = e
                    s = current.stats
                    self._account(s.tensors, s.bytes, s.bytes_read or s.bytes,
                                  max(s.peak_budget_bytes, s.peak_device_bytes), s.batches,
                                  budget)
                    if exceeded is None:
                        return
                    fmt = _core.format_bytes
                    after = f"after {prefix + last!r}" if last is not None else \
                        "before any tensor"
                    if self.options.budget != "auto":
                        raise _core.BudgetExceededError(
                            f"load format {LOAD_FORMAT!r}: the model's load_weights keeps more "
                            f"weights alive than model_loader_extra_config['budget'] "
                            f"({fmt(budget)}) allows: the next tensors of {part.checkpoint!r} "
                            f"do not fit {after} (a model that keeps a whole layer, or every "
                            f"weight, before using them): raise the budget, or use \"auto\" or "
                            f"0 (unbounded). {exceeded}") from None
                    rest = [n for n in names if n not in given]
                    if not rest:
                        return
                    logger.warning("tensorferry: %s's load_weights keeps more weights alive "
                                   "than the automatic budget (%s) holds %s; reading the "
                                   "remaining %d tensors of %s under %s", self._model_name,
                                   fmt(budget), after, len(rest), part.checkpoint,
                                   fmt(2 * budget))
                    budget *= 2
                    # From the checkpoint this load opened (an object changed since is not
                    # read: its ETag is the one seen at open).
                    loader = tensorferry.Loader(current, device=device, budget=budget,
                                                select=rest, **self._common())

        def _stream_torch(self, part, prefix, tp):
            """(name, tensor) of one torch.save file (Part.torch), read tensor by tensor into
            CPU tensors without running its pickle (_torch_file), as vLLM's own .bin/.pt
            iterator gives them (its weight loaders copy them to the device). The budget is
            checked as for safetensors (this reader holds one tensor at a time; load_weights
            may keep two more). Not cooperative: each rank reads the files it loads."""
            from . import _torch_file
            if tp is not None and not self._told_not_cooperative:
                self._told_not_cooperative = True
                logger.info("tensorferry: torch.save weights (%s) are not read cooperatively: "
                            "each rank reads them whole", part.checkpoint)
            with _torch_file.TorchFile(part.checkpoint) as f:
                keep = part.select
                chosen = [e for e in f.entries if keep is None or keep(e[0])]
                largest = max(chosen, key=lambda e: e[3], default=None)
                budget = self._budget_for(largest[0] if largest is not None else None,
                                          largest[3] if largest is not None else 0,
                                          part.checkpoint)
                count = total = 0
                try:
                    for name, tensor in f.tensors(keep):
                        count += 1
                        total += tensor.numel() * tensor.element_size()
                        self._refuse_held(budget, tensor.nbytes, f"tensor {name!r}",
                                          part.checkpoint)
                        self._hand_out(tensor)
                        yield prefix + name, tensor
                        del tensor
                finally:
                    self._account(count, total, total,
                                  largest[3] if largest is not None else 0, 1, budget)

        def _cooperative(self, part, prefix, device, tp):
            """(name, tensor) of one Part, read cooperatively by the tensor-parallel group in
            rounds of at most half the budget (each round: every rank reads ~1/N of its bytes,
            the whole tensors reach every rank by broadcast)."""
            coordinator, rank, world = tp
            group = coordinator.device_group if device.type == "cuda" else \
                coordinator.cpu_group
            loader = tensorferry.Loader(part.checkpoint, device=device, select=part.select,
                                        process_group=group, tp_rank=rank, tp_size=world,
                                        shard_rules="none", **self._common())
            with loader:
                budget = self._budget(loader, part.checkpoint)
                loader._check_dtypes()
                rounds, current, held = [], [], 0
                seen = set()
                for o in loader._describe():  # checkpoint order; aliases share their target
                    nbytes = 0 if o.stored in seen else o.bytes
                    seen.add(o.stored)
                    if current and budget is not None and held + nbytes > budget // 2:
                        rounds.append((current, held))
                        current, held = [], 0
                    current.append(o.name)
                    held += nbytes
                if current:
                    rounds.append((current, held))
                for names, held in rounds:
                    self._refuse_held(budget, held, f"a round of {len(names)} tensors",
                                      part.checkpoint)
                    # One cooperative load per round: what Loader.load() does for all of them.
                    tensors, stats = loader._cooperative.load(names, _loader.LoadStats)
                    read = loader.cooperative_stats["bytes_read"]
                    self._account(len(tensors), held, read, held, 1, budget)
                    while tensors:
                        name = next(iter(tensors))
                        tensor = tensors.pop(name)
                        self._hand_out(tensor)
                        yield prefix + name, tensor
                        del tensor

        def _account(self, tensors, nbytes, read, peak, rounds, budget):
            s = self.stats
            s["tensors"] += tensors
            s["bytes"] += nbytes
            s["bytes_read"] += read
            s["peak_held_bytes"] = max(s["peak_held_bytes"], peak)
            s["rounds"] += rounds
            s["budget"] = budget

        def weights(self, model, model_config):
            """(name, tensor) pairs of every weight source of `model`, as load_weights takes
            them."""
            device = self._device(model)
            tp = self._tp()
            self._model_name = type(model).__name__
            for k, (model_or_path, revision, subfolder, prefix, patterns, unused, pt) in \
                    enumerate(self._sources(model, model_config)):
                if k == 0:
                    self._check_weights(model_or_path)  # a missing local path: raises
                streamed = self._hub_parts(model_or_path, revision, subfolder, patterns, unused)
                if streamed is not None:  # a hub id read as hf:// (the `hub` option)
                    parts = streamed
                elif _is_url(model_or_path):
                    parts = self._remote_parts(model_or_path, patterns, unused)
                elif os.path.isfile(model_or_path):  # the `weights` option: one file
                    parts = [Part(model_or_path, _keep(unused),
                                  torch=is_torch_file(model_or_path))]
                else:
                    folder, files, safetensors = self._files(model_or_path, revision, subfolder,
                                                             patterns, pt)
                    if not safetensors:
                        parts = [Part(f, _keep(unused), torch=True) for f in files]
                    else:
                        if unused is not None:
                            files = weight_utils.filter_safetensors_files_by_weight_name(
                                files, unused)
                        parts = openable_parts(plan_parts(folder, files, unused), files,
                                               unused, logger.warning)
                for part in parts:
                    if part.torch:
                        yield from self._stream_torch(part, prefix, tp)
                    elif tp is None:
                        yield from self._stream(part, prefix, device)
                    else:
                        yield from self._cooperative(part, prefix, device, tp)

        def _reset_stats(self):
            self.stats = {"tensors": 0, "bytes": 0, "bytes_read": 0, "peak_held_bytes": 0,
                          "rounds": 0, "budget": None, "seconds": 0.0,
                          "cooperative": self._tp() is not None}

        def get_all_weights(self, model_config, model):
            """Every (name, tensor) of the model's weight sources, as vLLM's default loader
            gives them (its in-place weight reload asks for this, after setting
            model_config.model to the path reloaded from: the `weights` option applies to the
            model it was given for only)."""
            refuse_torchao(model_config, self.load_config)
            self._reset_stats()
            self._reloading = True
            try:
                yield from self.weights(model, model_config)
            finally:
                # As after load_weights: the staging rings the reads kept go back.
                self.stats["staging_released"] = _core.release_idle_staging()

        def load_weights(self, model, model_config):
            refuse_torchao(model_config, self.load_config)
            self._remember(model_config)
            self._reset_stats()
            start = time.perf_counter()
            try:
                # No restart: a weight given to load_weights is never given again (a budget
                # the model outgrows grows instead, _stream).
                loaded = model.load_weights(self.weights(model, model_config))
            finally:
                # A worker loads its weights once: the pinned staging rings its loads left for a
                # next one (keep_staging) go back now rather than stay pinned while it serves.
                self.stats["staging_released"] = _core.release_idle_staging()
            self.stats["seconds"] = time.perf_counter() - start
            s = self.stats
            logger.info("tensorferry: %d tensors, %s (%s read by this rank) in %.2f s, peak "
                        "held %s%s", s["tensors"], _core.format_bytes(s["bytes"]),
                        _core.format_bytes(s["bytes_read"]), s["seconds"],
                        _core.format_bytes(s["peak_held_bytes"]),
                        ", cooperative" if s["cooperative"] else "")
            track = self.options.enable_weights_track
            if track is None:
                track = model_config.quantization is None and loaded is not None
            if track:
                # vLLM's own check (the same rule and message as its default loader).
                DefaultModelLoader.track_weights_loading(
                    self, model, loaded, quantized=model_config.quantization is not None)

    TensorferryModelLoader.__module__ = __name__
    TensorferryModelLoader.__qualname__ = "TensorferryModelLoader"
    return TensorferryModelLoader

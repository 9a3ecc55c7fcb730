"""Loader: the streaming loader for serving engines (tensorferry::Loader, include/tensorferry/loader.h)."""
import dataclasses
import os
import time

from . import _core, _distributed, _frameworks, _safe_open
from ._core import InvalidArgumentError, SafetensorError
from ._shard import shard_spec


def parse_size(value):
    """Bytes from an int >= 0 or a string such as "256MB", "1.5GiB", "4096" (None: None). The
    core's parser and checks (tensorferry::ParseSize): InvalidArgumentError otherwise."""
    return None if value is None else _core.parse_size(value)


def layers(first, last=None):
    """A `select` predicate: tensors of transformer layers first..last (inclusive), named as
    "model.layers.N.", "transformer.h.N.", "blocks.N." and the like (tensorferry::LayerOf)."""
    last = first if last is None else last

    def predicate(name):
        layer = _core.layer_of(name)
        return layer is not None and first <= layer <= last

    predicate.__name__ = f"layers({first}, {last})"
    return predicate


def peak_rss_bytes():
    """The process's peak resident set (VmHWM), or None where /proc is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _StatsMethods:
    @property
    def gbps(self):
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self):
        rss = f", peak RSS {_core.format_bytes(self.peak_rss_bytes)}" if self.peak_rss_bytes else ""
        return (f"{self.tensors} tensors in {self.batches} batches: "
                f"{_core.format_bytes(self.bytes)} in {self.seconds:.3f} s ({self.gbps:.2f} GB/s) "
                f"with {self.engine}; peak held {_core.format_bytes(self.peak_budget_bytes)}{rss}")

    def _add(self, core):
        """Adds the core stats dict of one more load: counts add up, peaks ("peak_*",
        "pinned_bytes") take the maximum, texts the latest non-empty one ("device": "mixed"
        when the loads went to different devices); "seconds" is the caller's."""
        for key, value in core.items():
            mine = getattr(self, key)
            if key == "seconds":
                continue
            if key == "device":
                self.device = value if not mine or mine == value else "mixed"
            elif isinstance(value, str):
                setattr(self, key, value or mine)
            elif key.startswith("peak_") or key == "pinned_bytes":
                setattr(self, key, max(mine, value))
            else:
                setattr(self, key, mine + value)


# Totals of the last load() or iteration of a Loader: every field of the core's LoadStats
# (include/tensorferry/stats.h, the one list of them) plus the process's peak resident set.
LoadStats = dataclasses.make_dataclass(
    "LoadStats",
    [(name, type(zero), dataclasses.field(default=zero))
     for name, zero in _core.stats_fields().items()]
    + [("peak_rss_bytes", int, dataclasses.field(default=None))],
    bases=(_StatsMethods,))
LoadStats.__module__ = __name__
LoadStats.__doc__ = """Totals of the last load() or iteration of a Loader: the fields of the
core's LoadStats (docs/python.md lists them) and peak_rss_bytes, the whole process's peak resident
set (VmHWM) afterwards."""


@dataclasses.dataclass
class Batch:
    """One batch of Loader.iter_batches(): tensors that share one buffer (on one device)."""
    index: int
    count: int
    bytes: int
    tensors: dict
    device: str = "cpu"  # "cpu" or "cuda:N": batches never mix devices


class _Progress:
    def __init__(self, progress, total, desc):
        self._bar = None
        self._callback = None
        self._done = 0
        self._total = total
        if callable(progress):
            self._callback = progress
        elif progress:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc)

    def update(self, n):
        self._done += n
        if self._bar is not None:
            self._bar.update(n)
        if self._callback is not None:
            self._callback(self._done, self._total)

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _environment_budget():
    """Whether TENSORFERRY_BUDGET sets a budget ("0", "0MB" or unset: none; a value the core
    refuses counts as one: the core reports it)."""
    text = os.environ.get("TENSORFERRY_BUDGET", "").strip()
    if not text:
        return False
    try:
        return _core.parse_size(text) != 0
    except SafetensorError:
        return True


class Loader:
    """Loads a checkpoint (a .safetensors file, a directory, or a model.safetensors.index.json)
    into host memory, batch by batch under a byte budget, as tensors the caller owns.

    Args:
        checkpoint: path of the file, directory or index; or an open Loader, whose checkpoint
            the new one reads with its own options (nothing is opened or parsed again: for a
            checkpoint in object storage, no request; storage_options are the first one's).
        device: where tensors go: "cpu", or (framework "pt") "cuda" / "cuda:N" / a torch.device:
            tensors are read straight into GPU memory through the device pipeline (a pinned
            staging ring, or GPUDirect Storage) and returned as CUDA tensors sharing one device
            buffer per batch (docs/gpu.md). Other torch devices: each tensor is moved after it is
            loaded. CudaNotFoundError says why when CUDA is not usable.
        device_map: per-tensor placement as accelerate's device_map: {name prefix: device}
            (e.g. {"model.layers.0": "cuda:0", "lm_head": "cpu"}); tensors matching no prefix go
            to `device`. Batches never mix devices.
        device_budget: most bytes of GPU batch buffers held at once per device (None/0:
            unbounded); the device counterpart of budget. With device="cuda" and no device_map,
            `budget` is taken as the device budget when device_budget is not given.
        gds: GPUDirect Storage, "auto" (default), "on" or "off".
        staging_bytes: pinned host memory of the staging ring (default 64MB).
        budget: most bytes of tensor data held at once (int, or a string such as "256MB");
            None or 0: unbounded. Under a budget, iter_tensors()/iter_batches() deliver batches of
            at most half the budget (at most the budget less the largest tensor, with a larger
            tensor alone, when a tensor is over half), so the tensor the consumer still holds when
            it asks for the next one does not block the next batch.
        threads: I/O threads (None: one per CPU; the pread engine keeps at least 8).
        engine: "auto", "pread", "io_uring" or "mmap". Default: "auto" (io_uring where the
            kernel allows, else pread), which with no budget prefers "mmap" with populate, as
            load_file, for files on local file systems (prefer_mmap), unless a setting only the
            copying engines use is given (direct, chunk_size, queue_depth, drop_cache,
            memory_limit); files on network or FUSE file systems are read, never mapped
            (docs/python.md, "Slow file systems").
            TENSORFERRY_ENGINE overrides the default. `engine_info` says what was chosen.
        select: which tensors: None (all), a name, a list of names, or a predicate on the name
            (e.g. tensorferry.layers(0, 3)).
        framework: "pt" (torch tensors, default) or "np" (numpy arrays).
        memory_limit: without a budget, host memory the copying engines ("pread", "io_uring",
            "auto") may fill: a size, or "off"; default: 3/4 of what this process may use (the
            memory cgroup's limit less its unreclaimable usage, and MemAvailable). A selection
            larger than that streams under a budget of that size (stats.memory_budget says so),
            and load() fails before reading with BudgetExceededError naming the limit instead of
            the process being OOM-killed. The mmap engine is exempt (page-cache pages).
        drop_cache: after each load, drop the files read from the page cache (posix_fadvise
            DONTNEED), for servers that want that memory back; not with the mmap engine, whose
            tensors are those pages. Object storage: the copies in object_cache_dir.
        direct, chunk_size, queue_depth, order, populate, prefer_mmap, allow_oversized,
            pool_bytes: the other
            fields of tensorferry::LoadOptions (None: the default, or its TENSORFERRY_*
            environment variable).
        progress: True for a tqdm progress bar over bytes (when tqdm is installed), or a callable
            progress(done_bytes, total_bytes).
        tp_rank, tp_size: tensor parallelism: every tensor comes back as the shard rank tp_rank
            of tp_size holds (local shape), and only its bytes are read (stats.bytes_read).
        shard_rules: how tensors are split (any tensorferry.shard_spec() form: None/"builtin"
            for the built-in rules, a dict, JSON, a file, (pattern, rule) pairs; docs/python.md).
        shard_max_gap: strided shards: gaps up to this many bytes are read and discarded, in
            every file (default: exact strides for files in the page cache, 64 KiB for the
            others; 0: exact strides). On a GPU, strided shards of files in the page cache
            are gathered row by row into the staging ring; of other files, or whenever
            shard_max_gap is given, staged as covering ranges copied as 2D (docs/gpu.md).
        process_group: a torch.distributed process group of the tp_size ranks: cooperative mode,
            each byte read once by one rank and the slices exchanged (docs/distributed.md);
            load(), and iter_batches/iter_tensors/stream round by round (every rank must
            iterate to the end). With device="cuda" each reader loads its tensors straight into GPU
            memory and the exchange runs on GPU buffers (NCCL); `budget` bounds each round.
        coop_timeout_ms: with process_group, the longest any collective of the exchange may
            wait for the other ranks (default 300000; 0: forever); past it, load() raises
            OSError naming this rank and the step (a rank died or hangs, or a link is down).
        coop_exchange: with process_group, which tensors are read once and exchanged: "auto"
            (default: a cost model of each host's storage and network time, see
            docs/distributed.md), "all", or "none" (each rank reads its own slices).
        coop_storage_rate, coop_network_rate: the cost model's storage read rate and network
            rate per host (bytes per second or sizes like "2G"; defaults 2 GB/s and, for the
            network, what the probe measures, else 1.25 GB/s).
        coop_probe_bytes: with process_group, coop_exchange "auto", no coop_network_rate and
            ranks on more than one host, the bytes each rank sends to the other hosts' ranks to
            measure the network rate before planning (default "16MiB"; 0: no probe).
        storage_options: for s3://, gs:// and http(s):// checkpoints, a dict of object-storage
            settings (s3_endpoint, s3_region, s3_profile, s3_access_key_id,
            s3_secret_access_key, s3_session_token, s3_anonymous, s3_path_style, gcs_token,
            http_token, object_concurrency, object_part_size, object_retries,
            object_timeout_ms, ...;
            docs/object_storage.md). Without it the AWS_* variables and ~/.aws files apply.

    Tensors stay valid after the loader is closed; memory is freed when the last tensor of a
    batch is dropped. A Loader may be used from one thread at a time.
    """

    def __init__(self, checkpoint, device="cpu", budget=None, threads=None, engine=None,
                 select=None, *, framework="pt", direct=None, chunk_size=None, queue_depth=None,
                 order=None, populate=None, prefer_mmap=None, allow_oversized=None,
                 pool_bytes=None,
                 progress=False, device_map=None, device_budget=None, gds=None,
                 staging_bytes=None, tp_rank=None, tp_size=None, shard_rules=None,
                 shard_max_gap=None, process_group=None, storage_options=None,
                 memory_limit=None, drop_cache=None, verify=None, coop_timeout_ms=None,
                 coop_exchange=None, coop_storage_rate=None, coop_network_rate=None,
                 coop_probe_bytes=None):
        self._fw = _frameworks.get(framework)
        self._device = self._fw.device(device)
        core_device = self._fw.core_device(self._device)
        placement = None
        if device_map is not None:
            placement = []
            for prefix, where in dict(device_map).items():
                if isinstance(where, int):
                    where = f"cuda:{where}"
                target = self._fw.core_device(self._fw.device(where))
                if target is None and self._fw.device(where) != self._fw.device("cpu"):
                    raise _core.InvalidArgumentError(
                        f"device_map: {prefix!r} -> {where!r}: only cpu and cuda devices")
                placement.append((str(prefix), target or "cpu"))
        options = {
            "engine": engine,
            "direct": direct,
            "threads": threads,
            "chunk_size": chunk_size,
            "queue_depth": queue_depth,
            # A number (the choices below depend on it), read and checked by the core's Set.
            "budget": None if budget is None else _core.parse_option("budget", budget),
            "allow_oversized": allow_oversized,
            "order": order,
            "pool_bytes": pool_bytes,
            "populate": populate,
            "prefer_mmap": prefer_mmap,
            "memory_limit": memory_limit,
            "drop_cache": drop_cache,
            # Always explicit: the Python default is the host, whatever TENSORFERRY_DEVICE says.
            "device": core_device or "cpu",
            "placement": placement,
            "device_budget": device_budget,
            "gds": gds,
            "staging_bytes": staging_bytes,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "shard_max_gap": shard_max_gap,
            "verify": verify,
            "coop_timeout_ms": coop_timeout_ms,
            "coop_exchange": coop_exchange,
            "coop_storage_rate": coop_storage_rate,
            "coop_network_rate": coop_network_rate,
            "coop_probe_bytes": coop_probe_bytes,
        }
        options.update(_safe_open.storage_load_options(storage_options))
        if shard_rules is not None:
            if tp_size is None:
                raise InvalidArgumentError("shard_rules needs tp_rank and tp_size")
            options["shard_rules"] = shard_spec(shard_rules)
        if process_group is not None and device_map is not None:
            raise InvalidArgumentError("process_group= and device_map= do not go together: the "
                                       "cooperative exchange needs one device per rank")
        # The torch device cooperative mode exchanges on (self._device is None once the core
        # loads to the GPU itself).
        requested = self._device
        if core_device is not None and placement is None and device_budget is None \
                and options["budget"] and process_group is None:
            # Every tensor goes to the GPU: the budget is about GPU memory. (Cooperative mode
            # keeps `budget` as the bytes each rank reads per round.)
            options["device_budget"] = options.pop("budget")
        if placement is not None:
            # Tensors are already where the map puts them; `device` is where unmatched ones go.
            self._device = None
        elif core_device is not None:
            self._device = None  # already on the device
        # Settings only a copying engine uses, turned on explicitly: asking for one (the mmap
        # default below made them do nothing, silently). Values that turn them off do not.
        def on(key):
            value = options.get(key)
            if value is None or value is False:
                return False
            return str(value).strip().lower() not in ("off", "0", "false", "no", "none", "")
        copying = any(options.get(k) is not None for k in ("chunk_size", "queue_depth")) or \
            any(on(k) for k in ("direct", "drop_cache", "memory_limit"))
        if engine is None and not options.get("budget") and not copying \
                and not os.environ.get("TENSORFERRY_ENGINE") and not _environment_budget() \
                and core_device is None and placement is None:
            # Unbounded: the same default as load_file (mmap with populate on local file
            # systems), the fastest measured way to tensors in host memory (docs/python.md).
            # Under a budget, the copying engines.
            options["engine"] = "auto"
            if prefer_mmap is None and not os.environ.get("TENSORFERRY_PREFER_MMAP"):
                options["prefer_mmap"] = True
            if populate is None and not os.environ.get("TENSORFERRY_POPULATE"):
                options["populate"] = True
        given = {k: v for k, v in options.items() if v is not None}
        if isinstance(checkpoint, Loader):
            self._reader = _core.Reader(checkpoint._reader, given)
        elif isinstance(checkpoint, _core.Reader):  # an open file's (safe_open's): not reopened
            self._reader = _core.Reader(checkpoint, given)
        else:
            self._reader = _core.Reader(os.fspath(checkpoint), False, given)
        self._cooperative = None if process_group is None else _distributed.Cooperative(
            self._reader, process_group, options, self._fw, requested)
        self._names = self._resolve(select)
        self._progress = progress
        self._stats = LoadStats()
        self._streams = []
        self._closed = False

    # --- what is in the checkpoint ----------------------------------------------------------------

    def _resolve(self, select):
        reader = self._reader
        if select is None:
            return None
        if isinstance(select, str):
            select = [select]
        if callable(select):
            # Asked of every tensor a load delivers: tied aliases the files lack too (as
            # Selection::Where offers them), not only the stored names. When describing them
            # all fails (a tensor-parallel rule that cannot split a tensor the predicate may
            # leave out), of the stored names; the selected ones are described after.
            try:
                candidates = [o.name for o in reader.describe(None)]
            except SafetensorError:
                candidates = reader.names(True)
            return [n for n in candidates if select(n)]
        names = list(select)
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"select: tensor names must be str, not {type(n).__name__}")
        reader.describe(names)  # SafetensorError naming a missing tensor
        return names

    def _describe(self):
        """What a load delivers, in output order: one _core.Output (name, dtype, local shape,
        bytes, the stored tensor whose bytes it is, its file, whether it is a tied alias) per
        tensor (tensorferry::Loader::Describe)."""
        return self._reader.describe(self._names)

    def keys(self):
        """Names of the selected tensors, in the order load() returns them (file order; a tied
        alias the files lack right after its target)."""
        return [o.name for o in self._describe()]

    def __len__(self):
        return len(self._describe())

    @property
    def files(self):
        """Paths of the checkpoint's files."""
        return self._reader.files()

    @property
    def total_bytes(self):
        """Bytes of the selected tensors (a tensor-parallel rank's shards: their local bytes), each
        stored tensor once (a tied alias shares its target's bytes)."""
        return sum({o.stored: o.bytes for o in self._describe()}.values())

    def metadata(self):
        """The index's "metadata" (values as JSON text) for a sharded checkpoint, else the
        "__metadata__" of the file (or None)."""
        index = self._reader.index_metadata()
        return index if index else self._reader.file_metadata(0)

    @property
    def options(self):
        """The load options in effect (defaults and TENSORFERRY_* variables included)."""
        return self._reader.options()

    @property
    def cooperative_stats(self):
        """With process_group: this rank's figures of the last load() (bytes_read, bytes_sent,
        bytes_received, rounds, seconds, read_seconds, exchange_seconds: the rounds' collectives
        and the wait for the local reads, network_seconds: inside the exchanges'
        all_to_all_single alone, local_seconds, probe_seconds, ...); else None."""
        return None if self._cooperative is None else dict(self._cooperative.stats)

    @property
    def stats(self):
        """LoadStats of the last load() or iteration."""
        return self._stats

    @property
    def engine_info(self):
        """The engine this loader reads with, why, and the file systems of the files: a dict
        with "engine", "engine_reason" and "filesystem" (as in stats), known before any load."""
        return self._reader.engine()

    # --- loading --------------------------------------------------------------------------------

    def _check_dtypes(self):
        names = self._names
        if names is not None:
            names = sorted({o.stored for o in self._describe()})
        self._fw.check(self._reader, names)

    def _finish(self, triples):
        return self._fw.finish_all(triples, self._device)

    def load(self):
        """Every selected tensor, as a dict in file order. With a budget, they must all fit it
        (BudgetExceededError otherwise: use iter_tensors)."""
        self._check_open()
        self._check_dtypes()
        if self._cooperative is not None:
            out, self._stats = self._cooperative.load(self._names, LoadStats)
            return out
        stats = LoadStats()
        start = time.perf_counter()
        if self._progress:
            # Read file by file below (for the bar), but promised whole: the budget and memory
            # limit are checked for the whole selection first, as the one-call load does.
            self._reader.check_fits_at_once(self._names)
        outputs = self._describe() if self._progress else None
        progress = _Progress(self._progress, sum({o.stored: o.bytes for o in outputs}.values()),
                             "tensorferry") if self._progress else None
        out = {}
        try:
            if progress is None:
                groups = [self._names]
            else:
                # One load per file, so progress moves shard by shard.
                by_file = {}
                for o in outputs:
                    by_file.setdefault(o.file, []).append(o.name)
                groups = [by_file[f] for f in sorted(by_file)]
            for group in groups:
                triples = self._reader.load(group, self._fw.code)
                core = self._reader.stats()
                stats._add(core)
                out.update(self._finish(triples))
                del triples
                if progress is not None:
                    progress.update(core["bytes"])
        finally:
            if progress is not None:
                progress.close()
        stats.seconds = time.perf_counter() - start
        stats.peak_rss_bytes = peak_rss_bytes()
        self._stats = stats
        if len(groups) > 1:  # each load returned its tensors in output order; merge them so
            order = {o.name: i for i, o in enumerate(outputs)}
            out = dict(sorted(out.items(), key=lambda kv: order[kv[0]]))
        return out

    def load_into(self, destinations):
        """Reads tensors into memory the caller owns: `destinations` maps tensor names to
        contiguous, writable torch tensors (CPU or CUDA) or numpy arrays of the tensor's dtype
        with room for its bytes (e.g. a model's parameters). Everything is checked before any
        read: unknown names, a dtype other than the file's, a destination smaller than the tensor
        (InvalidArgumentError naming the tensor and both sizes), destinations that overlap.
        Bytes past a tensor in a larger destination are left untouched. With tp_rank/tp_size,
        each destination receives this rank's slice (local row-major bytes: room for the slice
        is enough). CUDA destinations are written after the work already queued on their
        device's current stream (as torch's copy_ into them would be), and are complete when this
        returns."""
        self._check_open()
        # SafetensorError for a name that is neither a tensor nor a tied alias of one.
        described = {o.name: o for o in self._reader.describe(list(destinations))}
        entries = []
        on_cuda = []
        for name, dst in destinations.items():
            st_dtype = described[name].dtype
            # The destination's own kind decides the dtype to compare with, whatever framework
            # the Loader hands out tensors in.
            kind = _frameworks.get("pt" if hasattr(dst, "data_ptr") else "np")
            want = kind.dtype(st_dtype, name)
            if hasattr(dst, "data_ptr"):  # torch
                if not dst.is_contiguous():
                    raise _core.InvalidArgumentError(f"load_into: {name!r}: not contiguous")
                if dst.dtype != want:
                    raise _core.InvalidArgumentError(
                        f"load_into: {name!r} is {st_dtype} in the file, the destination is "
                        f"{dst.dtype}")
                device = "cpu" if dst.device.type == "cpu" else \
                    kind.core_device(kind.device(dst.device))
                if device is None:
                    raise _core.InvalidArgumentError(
                        f"load_into: {name!r}: destinations live on cpu or cuda, not {dst.device}")
                entries.append((name, device, dst.data_ptr(), dst.numel() * dst.element_size()))
                if device != "cpu":
                    on_cuda.append(dst)
            else:  # numpy
                if not dst.flags.c_contiguous or not dst.flags.writeable:
                    raise _core.InvalidArgumentError(
                        f"load_into: {name!r}: not a contiguous, writable array")
                if dst.dtype != want:
                    raise _core.InvalidArgumentError(
                        f"load_into: {name!r} is {st_dtype} in the file, the destination is "
                        f"{dst.dtype}")
                entries.append((name, "cpu", dst.ctypes.data, dst.nbytes))
        if on_cuda:
            _frameworks.get("pt").after_queued_work(on_cuda)
        stats = LoadStats()
        self._reader.load_into(entries)
        stats._add(self._reader.stats())
        stats.seconds = self._reader.stats()["seconds"]
        self._stats = stats

    def iter_batches(self):
        """Yields Batch objects (index, count, bytes, tensors: dict) one at a time under the
        budget, while the next batch is read ahead when the budget allows it."""
        self._check_open()
        self._check_dtypes()
        if self._cooperative is not None:
            yield from self._iter_cooperative_batches()
            return
        stats = LoadStats()
        self._stats = stats
        progress = _Progress(self._progress, self.total_bytes, "tensorferry") \
            if self._progress else None
        stream = self._reader.iterate(self._names, self._fw.code)
        self._streams.append(stream)
        try:
            while True:
                got = stream.next()
                if got is None:
                    break
                index, count, nbytes, triples, device = got
                del got
                batch = Batch(index, count, nbytes, dict(self._finish(triples)), device)
                del triples
                if progress is not None:
                    progress.update(nbytes)
                yield batch
                del batch
        finally:
            stream.close()
            self._streams.remove(stream)
            if progress is not None:
                progress.close()
            core = self._reader.stats()
            stats._add(core)
            stats.seconds = core["seconds"]
            stats.peak_rss_bytes = peak_rss_bytes()

    def _iter_cooperative_batches(self):
        """iter_batches with process_group=: one Batch per round of the exchange (index: the
        round), as soon as the round is exchanged; every rank must iterate to the end."""
        device = str(self._cooperative.device)

        def on_stats(stats):
            self._stats = stats

        for index, tensors in self._cooperative.iter_rounds(self._names, LoadStats, on_stats):
            if self._closed:
                raise _core.InvalidArgumentError("the iteration was stopped: its Loader was closed")
            nbytes = sum(t.nbytes for t in tensors.values())
            yield Batch(index, len(tensors), nbytes, tensors, device)
            del tensors

    def iter_tensors(self):
        """Yields (name, tensor) pairs batch by batch under the budget (the shape of vLLM's
        weights iterators). The generator keeps no reference to a tensor it has yielded."""
        for batch in self.iter_batches():
            tensors = batch.tensors
            del batch
            while tensors:
                if self._closed:
                    raise _core.InvalidArgumentError(
                        "the iteration was stopped: its Loader was closed")
                name = next(iter(tensors))
                tensor = tensors.pop(name)
                yield name, tensor
                del tensor

    def stream(self, callback):
        """Calls callback(batch) for each Batch, on this thread (tensorferry::Loader::Stream).
        An exception from the callback stops the load and propagates."""
        self._check_open()
        self._check_dtypes()
        if self._cooperative is not None:
            for batch in self._iter_cooperative_batches():
                callback(batch)
            return

        def on_batch(index, count, nbytes, triples, device):
            callback(Batch(index, count, nbytes, dict(self._finish(triples)), device))

        stats = LoadStats()
        self._stats = stats
        try:
            self._reader.stream(self._names, self._fw.code, on_batch)
        finally:
            core = self._reader.stats()
            stats._add(core)
            stats.seconds = core["seconds"]
            stats.peak_rss_bytes = peak_rss_bytes()

    # --- lifetime -------------------------------------------------------------------------------

    def _check_open(self):
        if self._closed:
            raise _core.SafetensorError("Loader is closed")

    def close(self):
        """Stops any iteration and releases the loader's threads, buffers and files. Tensors
        already handed out stay valid."""
        if self._closed:
            return
        self._closed = True
        # From another thread, an iteration may be starting: its stream exists a moment before
        # it is listed here, and the reader refuses to close while it runs. Close what is listed
        # and try again until the newcomer is listed too (it then stops at its next batch).
        for attempt in range(1000):
            for stream in list(self._streams):
                stream.close()
            try:
                self._reader.close()
                return
            except InvalidArgumentError as e:
                if "busy" not in str(e) or attempt == 999:
                    raise
                time.sleep(0.001)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self.close()

#!/usr/bin/env python3
"""Checkpoint to GPU memory: tensorferry against safetensors.torch.load_file(device="cuda"),
fastsafetensors and runai-model-streamer (each where importable; absent ones are skipped with a
note), warm and cold, with the pinned host-to-device bandwidth of this machine measured in the
same run as the reference.

    .venv/bin/python bench/gpu_bench.py data/default                 # --repeats 3 --modes warm,cold
    .venv/bin/python bench/gpu_bench.py data/default --json gpu.json --child-timeout 90

Each loader runs in a child process of its own (CUDA context creation and imports are not timed;
a 1-byte allocation initializes the context first). A run is timed from the call that starts the
load until every tensor is in device memory (torch.cuda.synchronize()). For each run:
  - GB/s over the checkpoint's tensor bytes; medians over --repeats runs are reported.
  - peak extra device memory: a thread samples cudaMemGetInfo (torch.cuda.mem_get_info, which sees
    every allocation, torch's caching allocator and tensorferry's own cudaMalloc alike) every
    millisecond during the load; extra = (free before - lowest free during) - tensor bytes. For
    tensorferry, LoadStats.peak_device_bytes (its batch buffers) is printed too.
  - a checksum (sum of every tensor's bytes, computed on the GPU after timing) that must agree
    between loaders.
--json is rewritten (atomically) after every row, so a benchmark cut off keeps the rows it
measured; --child-timeout kills a loader's child that runs longer (its row says "timed out") and
goes on with the next.
Cold runs evict every file with posix_fadvise(POSIX_FADV_DONTNEED) (and, as root, drop_caches when
that left more than 1% cached) and report what stayed cached.

The references: pinned host memory to device (torch.empty(pin_memory=True).to("cuda",
non_blocking=True)), the PCIe limit a staged load cannot beat warm; and pageable host memory to
device (a plain torch.empty(...).to("cuda")), what a loader that copies from unpinned buffers gets.
"""
import argparse
import glob
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time

from _pagecache import evict, warm

LOADERS = ["tensorferry", "tensorferry (gds off)", "tensorferry (gds off, verify off)",
           "tensorferry (load_file)", "tensorferry (load_file, keep_staging off)",
           "tensorferry (device budget 1GB)",
           "tensorferry (load_into)", "tensorferry (tp 0/2)", "tensorferry (tp 1/2)",
           "tensorferry (tp 0/8)", "tensorferry (tp 7/8)", "tensorferry (tp 0/8 covering)",
           "tensorferry (get_tensor)", "safetensors", "safetensors (get_tensor)", "fastsafetensors",
           "fastsafetensors (nogds)", "runai-model-streamer"]
# Variants: "load_file" is tensorferry.torch.load_file(f, device="cuda") per shard, the drop-in
# beside safetensors' own row ("keep_staging off": each call pins and frees its own staging ring,
# TENSORFERRY_KEEP_STAGING=0, as before rings were kept for the next Loader); "get_tensor" (both
# libraries) is safe_open(f, "pt", device="cuda") asked for each tensor in turn, the loop many
# users write; "device budget 1GB" streams batches (iter_batches) under device_budget=1GB, summing
# each batch on the GPU and keeping nothing; "load_into" reads into destinations allocated before
# the timer starts (a model's parameters); "tp R/W" loads rank R's slices of world W (builtin
# rules), one rank per process in turn: its bytes are the rank's local bytes and its checksum is
# not compared with the others'; "covering" stages strided slices as covering ranges (an explicit
# shard_max_gap) instead of gathering the rows of cached files; "verify off" skips the checksums
# (checked by default in the staging slots when the checkpoint carries them, as `tensorferry
# gen`'s do). TENSORFERRY_* settings in the environment apply to every tensorferry variant (e.g.
# TENSORFERRY_DEVICE_PRODUCERS, TENSORFERRY_STAGING_BYTES).


def loader_names(text):
    """The comma-separated loader names of --loaders; a comma inside parentheses belongs to the
    name ("tensorferry (gds off, verify off)"). Exits on a name that is not one of LOADERS, before
    anything is measured."""
    names, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            names.append(cur.strip())
            cur = ""
        else:
            cur += ch
    names.append(cur.strip())
    names = [n for n in names if n]
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        sys.exit(f"gpu_bench: unknown loader(s) {unknown}; known: {', '.join(LOADERS)}")
    return names


def get_tensors_one_by_one(safe_open, files):
    """The "get_tensor" rows: each file opened on the device with `safe_open` (either library's)
    and asked for each tensor in turn, the loop many users write."""
    out = {}
    for f in files:
        with safe_open(f, "pt", device="cuda") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def shards(path):
    if os.path.isfile(path):
        return [path]
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


# --- the child: one loader, every run ----------------------------------------------------------

class MinFree:
    """Samples the device's free memory every millisecond; `lowest` is the minimum seen."""

    def __init__(self, torch):
        self.torch = torch
        self.lowest = torch.cuda.mem_get_info()[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.lowest = min(self.lowest, self.torch.cuda.mem_get_info()[0])
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.lowest = min(self.lowest, self.torch.cuda.mem_get_info()[0])


def child(args):
    import gc
    import torch
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context, untimed
    name = args.child
    files = shards(args.path)
    extra = {}
    if name.startswith("tensorferry"):
        import re
        import tensorferry
        gds = "auto" if name == "tensorferry" else "off"
        kwargs = {}
        tp = re.search(r"tp (\d+)/(\d+)", name)
        if tp:
            kwargs.update(tp_rank=int(tp.group(1)), tp_size=int(tp.group(2)))
        if "device budget" in name:
            kwargs["device_budget"] = "1GB"
        if "covering" in name:  # strided slices staged as covering ranges, not gathered rows
            kwargs["shard_max_gap"] = 64 << 10
        if "verify off" in name:
            kwargs["verify"] = "off"

        def record(loader):
            s = loader.stats
            extra.update(peak_device_bytes=s.peak_device_bytes, staged_bytes=s.staged_bytes,
                         gathered_bytes=getattr(s, "gathered_bytes", 0),
                         gds_bytes=s.gds_bytes, gds_reason=s.gds_reason,
                         pinned_bytes=s.pinned_bytes, engine=s.engine,
                         verified_tensors=s.verified_tensors,
                         verify_skipped_tensors=s.verify_skipped_tensors)

        if "load_into" in name:
            import safetensors
            shapes = {}
            for f in files:
                with safetensors.safe_open(f, "pt") as h:
                    for k in h.keys():
                        sl = h.get_slice(k)
                        shapes[k] = (sl.get_shape(), sl.get_dtype())
            dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                      "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}

            def load():
                dests = {k: torch.empty(shape, dtype=dtypes[dt], device="cuda")
                         for k, (shape, dt) in shapes.items()}
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with tensorferry.Loader(args.path, device="cuda", gds=gds) as loader:
                    loader.load_into(dests)
                    record(loader)
                torch.cuda.synchronize()
                return dests, time.perf_counter() - t0, True
        elif "get_tensor" in name:
            def load():
                return get_tensors_one_by_one(tensorferry.safe_open, files)
        elif "load_file" in name:
            import tensorferry.torch

            keep = "keep_staging off" not in name

            def load():  # the drop-in API, per shard as safetensors' row (a Loader per call)
                out = {}
                before = os.environ.get("TENSORFERRY_KEEP_STAGING")
                if not keep:
                    tensorferry.release_idle_staging()
                    os.environ["TENSORFERRY_KEEP_STAGING"] = "0"
                try:
                    for f in files:
                        out.update(tensorferry.torch.load_file(f, device="cuda"))
                finally:
                    if not keep:
                        if before is None:
                            del os.environ["TENSORFERRY_KEEP_STAGING"]
                        else:
                            os.environ["TENSORFERRY_KEEP_STAGING"] = before
                return out
        elif "device budget" in name:
            def load():
                total, checksum = 0, 0
                with tensorferry.Loader(args.path, device="cuda", gds=gds, **kwargs) as loader:
                    for batch in loader.iter_batches():
                        for t in batch.tensors.values():
                            total += t.numel() * t.element_size()
                            if t.numel():
                                checksum += int(t.contiguous().reshape(-1).view(torch.uint8)
                                                .sum(dtype=torch.int64))
                        del batch, t  # hold nothing while the next batch is allocated
                    record(loader)
                return ("summary", total, checksum)
        else:
            def load():
                # Where the time goes besides the pipeline (the core's own seconds): opening,
                # the Python side of load() (wrapping the tensors), closing (the pinned ring).
                t0 = time.perf_counter()
                loader = tensorferry.Loader(args.path, device="cuda", gds=gds, **kwargs)
                t1 = time.perf_counter()
                out = loader.load()
                t2 = time.perf_counter()
                record(loader)
                core = loader._reader.stats()
                loader.close()
                t3 = time.perf_counter()
                extra.update(open_s=t1 - t0, load_s=t2 - t1, core_s=core["seconds"],
                             close_s=t3 - t2)
                return out
    elif name == "safetensors":
        import safetensors.torch

        def load():
            out = {}
            for f in files:
                out.update(safetensors.torch.load_file(f, device="cuda"))
            return out
    elif name == "safetensors (get_tensor)":
        import safetensors

        def load():
            return get_tensors_one_by_one(safetensors.safe_open, files)
    elif name.startswith("fastsafetensors"):
        import fastsafetensors
        nogds = "nogds" in name

        try:  # newer releases want a process group object; SingleGroup is the one-process one
            from fastsafetensors import SingleGroup
            group = SingleGroup()
        except ImportError:
            group = None

        def load():
            loader = fastsafetensors.SafeTensorsFileLoader(group, "cuda:0", nogds=nogds)
            loader.add_filenames({0: files})
            fb = loader.copy_files_to_device()
            out = {k: fb.get_tensor(k).clone() for k in loader.get_keys()}
            fb.close()
            loader.close()
            return out
    elif name == "runai-model-streamer":
        from runai_model_streamer import SafetensorsStreamer

        def load():
            out = {}
            with SafetensorsStreamer() as streamer:
                streamer.stream_files(files)
                for k, t in streamer.get_tensors():
                    out[k] = t.to("cuda", non_blocking=True)
            return out
    elif name in ("pinned h2d", "pageable h2d"):
        pinned = name == "pinned h2d"
        total = sum(os.path.getsize(f) for f in files)
        n = min(total, 4 << 30)
        host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        runs = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev = host.to("cuda", non_blocking=pinned)
            torch.cuda.synchronize()
            runs.append({"seconds": time.perf_counter() - t0, "bytes": n})
            del dev
            torch.cuda.empty_cache()
        print(json.dumps({"loader": name, "runs": {"warm": runs}}))
        return
    else:
        raise SystemExit(f"unknown loader {name}")

    out = {"loader": name, "runs": {}}
    for mode in args.modes.split(","):
        runs = []
        for _ in range(args.repeats):
            left = evict(files, empty=0.0) if mode == "cold" else warm(files, empty=0.0)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            free0 = torch.cuda.mem_get_info()[0]
            reserved0 = torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            with MinFree(torch) as sampler:
                t0 = time.perf_counter()
                tensors = load()
                torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
            if isinstance(tensors, tuple) and len(tensors) == 3 and tensors[2] is True:
                tensors, seconds, _ = tensors  # load_into: timed without the destinations
            resident = 0  # device bytes the result holds (the destinations count as the result)
            if isinstance(tensors, tuple):  # streamed: summed batch by batch, nothing kept
                _, nbytes, checksum = tensors
                # The checksum's own temporaries sit in torch's caching allocator (about 1 GB
                # for the largest tensors, measured): not the loader's memory.
                resident = torch.cuda.max_memory_reserved() - reserved0
            else:
                nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
                resident = nbytes
                checksum = 0
                for t in tensors.values():
                    if t.numel():
                        checksum += int(t.contiguous().reshape(-1).view(torch.uint8)
                                        .sum(dtype=torch.int64))
            runs.append({"seconds": seconds, "bytes": nbytes, "checksum": checksum,
                         "cached_fraction": left,
                         "peak_extra_device_bytes": max(0, free0 - sampler.lowest - resident),
                         "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                         * 1024,
                         **extra})
            del tensors
        out["runs"][mode] = runs
    print(json.dumps(out))


# --- the parent ----------------------------------------------------------------------------------

# The module each loader row imports, by the name before its variant in parentheses
# ("tensorferry (tp 0/8)" -> tensorferry, "safetensors (get_tensor)" -> safetensors).
MODULES = {"tensorferry": "tensorferry", "safetensors": "safetensors",
           "fastsafetensors": "fastsafetensors", "runai-model-streamer": "runai_model_streamer"}


def module_of(name):
    """The module a loader row needs; KeyError names the row when MODULES lacks its library."""
    base = name.split(" (", 1)[0]
    if base not in MODULES:
        raise KeyError(f"gpu_bench: no module known for loader {name!r} (MODULES)")
    return MODULES[base]


def available(name):
    import importlib.util
    return importlib.util.find_spec(module_of(name)) is not None


def write_json(path, results):
    """Writes the results so far: to a temporary file, then renamed over `path`, so a process
    killed while writing leaves the previous complete file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default="data/default")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="warm,cold")
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--json", help="write the results here too (rewritten after every row)")
    p.add_argument("--child-timeout", type=float, default=0,
                   help="seconds one loader's child may run (0: no limit); a child over it is "
                        "killed and its row recorded as timed out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    try:
        import torch
    except ImportError:
        sys.exit("gpu_bench: needs torch")
    if not torch.cuda.is_available():
        sys.exit("gpu_bench: torch sees no CUDA device")
    files = shards(args.path)
    if not files:
        sys.exit(f"gpu_bench: no .safetensors under {args.path}")
    device = torch.cuda.get_device_name(0)
    total = sum(os.path.getsize(f) for f in files)
    print(f"# {args.path}: {len(files)} files, {total / 1e9:.2f} GB; {device}; "
          f"{platform.node()}; torch {torch.__version__}; repeats {args.repeats} (medians)")
    results = {"path": args.path, "device": device, "host": platform.node(),
               "torch": torch.__version__, "repeats": args.repeats, "loaders": {}, "skipped": {}}
    del torch
    names = ["pinned h2d", "pageable h2d"] + loader_names(args.loaders)
    try:
        present = {n: n.endswith(" h2d") or available(n) for n in names}
    except KeyError as e:  # a row of LOADERS without its module in MODULES: before measuring
        sys.exit(e.args[0])
    if args.json:
        write_json(args.json, results)
    checksums = {}
    for name in names:
        if args.json:  # what was measured so far survives a kill of this process
            write_json(args.json, results)
        if not present[name]:
            results["skipped"][name] = "not installed"
            print(f"{name:26s} skipped: not installed (pip install it to compare)", flush=True)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), args.path, "--child", name,
               "--repeats", str(args.repeats), "--modes", args.modes]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True,
                               timeout=args.child_timeout or None)
        except subprocess.TimeoutExpired:  # the child is killed; the next row still runs
            why = f"timed out after {time.perf_counter() - t0:.0f} s (--child-timeout)"
            results["skipped"][name] = why
            results.setdefault("timed_out", []).append(name)
            print(f"{name:26s} {why}", flush=True)
            continue
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["failed"])[-1]
            results["skipped"][name] = why
            print(f"{name:26s} failed: {why}", flush=True)
            continue
        got = json.loads(r.stdout.strip().splitlines()[-1])
        results["loaders"][name] = got
        for mode, runs in got["runs"].items():
            gbps = statistics.median(x["bytes"] / x["seconds"] / 1e9 for x in runs)
            line = f"{name:34s} {mode:4s} {gbps:7.2f} GB/s"
            if "peak_extra_device_bytes" in runs[0]:
                extra = statistics.median(x["peak_extra_device_bytes"] for x in runs)
                line += f"  peak extra device {extra / 1e6:8.1f} MB"
                rss = statistics.median(x["peak_rss_bytes"] for x in runs)
                line += f"  peak RSS {rss / 1e6:7.0f} MB"
                sums = {x["checksum"] for x in runs}
                if "(tp " not in name:  # a rank's slices have their own sum
                    checksums.setdefault(next(iter(sums)), []).append(name)
                if len(sums) != 1:
                    line += "  CHECKSUM DIFFERS BETWEEN RUNS"
                if mode == "cold":
                    line += f"  (cached before: {max(x['cached_fraction'] for x in runs):.1%})"
            if "peak_device_bytes" in runs[0]:
                line += (f"  [loader: peak buffers {runs[0]['peak_device_bytes'] / 1e6:.1f} MB,"
                         f" GDS {runs[0]['gds_bytes'] / 1e6:.0f} MB,"
                         f" staged {runs[0]['staged_bytes'] / 1e6:.0f} MB"
                         f" (gathered {runs[0].get('gathered_bytes', 0) / 1e6:.0f} MB),"
                         f" pinned {runs[0]['pinned_bytes'] / 1e6:.0f} MB]")
            if "core_s" in runs[0]:
                ms = {k: statistics.median(x[k] for x in runs) * 1e3
                      for k in ("open_s", "load_s", "core_s", "close_s")}
                line += (f"  [ms, medians: open {ms['open_s']:.1f}, load() {ms['load_s']:.1f}"
                         f" of which core {ms['core_s']:.1f}, close {ms['close_s']:.1f}]")
            print(line, flush=True)
    if len(checksums) > 1:
        print(f"checksums disagree: {checksums}")
        results["checksum_mismatch"] = {str(k): v for k, v in checksums.items()}
    if args.json:
        write_json(args.json, results)
    if len(checksums) > 1:
        sys.exit(1)


if __name__ == "__main__":
    main()

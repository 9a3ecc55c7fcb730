#!/usr/bin/env python3
"""Python loaders side by side on one checkpoint: tensorferry (load_file, Loader) against
safetensors, fastsafetensors, runai-model-streamer and torch.load of the same weights as .bin,
warm and cold, on the CPU.

Every run is a fresh subprocess (imports are not timed; peak RSS is that process's VmHWM, shown
above its RSS after the imports). A run is timed from the call that starts the load until every
byte of every tensor has been read once (a sum over a uint8 view of each tensor), so lazy mmap
loaders pay for their page faults as their users would; the sums, combined, are a checksum that
must agree between loaders. Same-run limits, as docs/BENCHMARKING asks: the first-touch cost of
fresh memory, and the page-cache copy limit (pread of the cached files into touched memory, one
thread per core) or, cold, the storage read limit (the same pread on evicted files).

    .venv/bin/python bench/python_load_bench.py data/default            # --runs 5 --modes warm,cold
    .venv/bin/python bench/python_load_bench.py data/small --json out.json --svg out.svg

The checkpoint is generated when missing (--preset, with build/release/bin/tensorferry gen).
Cold runs evict each file with posix_fadvise(POSIX_FADV_DONTNEED), check with mincore that < 1% is
still cached, and as root fall back to /proc/sys/vm/drop_caches.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from _pagecache import evict, warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOADERS = [
    "tensorferry load_file",
    "tensorferry load_file (pread)",
    "tensorferry load_file (mmap)",
    "tensorferry Loader.load",
    "tensorferry Loader.iter_tensors 1GB",
    "safetensors load_file",
    "safetensors load_file (pread)",
    "fastsafetensors (nogds)",
    "runai-model-streamer",
    "torch.load .bin",
    "limit: first touch",
    "limit: pread copy",
]


# --- the child: one loader, one run ---------------------------------------------------------------

def rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def child(name, checkpoint, bin_dir):
    import torch
    # The byte sums are the benchmark's own work: one thread, so they cannot straggle behind a
    # busy core (a sum split over both cores waits for the slower one).
    torch.set_num_threads(1)
    files = shard_files(checkpoint)
    checksum = 0
    nbytes = 0
    ntensors = 0

    def touch(t):
        # Reads every byte: a wrapping sum of the bytes taken 8 at a time (torch sums int64 at
        # memory speed; a uint8 sum widened to int64 would run at a tenth of that), then the tail.
        nonlocal checksum, nbytes, ntensors
        if t.numel():
            u8 = t.reshape(-1).view(torch.uint8)
            n = u8.numel()
            whole = n // 8 * 8
            total = 0
            if whole:
                head = u8[:whole]
                try:
                    total = int(head.view(torch.int64).sum())
                except RuntimeError:  # a view at an offset that is not a multiple of 8
                    total = int(head.clone().view(torch.int64).sum())
            if whole < n:
                total += int(u8[whole:].sum(dtype=torch.int64))
            checksum = (checksum + total) & ((1 << 64) - 1)
            nbytes += n
        ntensors += 1

    if name.startswith("tensorferry"):
        import tensorferry
        import tensorferry.torch
    elif name.startswith("safetensors"):
        import safetensors.torch
    elif name.startswith("fastsafetensors"):
        import fastsafetensors
    elif name.startswith("runai"):
        from runai_model_streamer import SafetensorsStreamer
    elif name.startswith("limit"):
        import numpy as np
    baseline = rss_kb("VmRSS")
    total = sum(os.path.getsize(f) for f in files)

    start = time.perf_counter()
    if name == "tensorferry load_file":
        tensors = {}
        for f in files:
            tensors.update(tensorferry.torch.load_file(f))
        loaded = time.perf_counter()
        for t in tensors.values():
            touch(t)
    elif name == "tensorferry load_file (pread)":
        tensors = {}
        for f in files:
            tensors.update(tensorferry.torch.load_file(f, backend="pread"))
        loaded = time.perf_counter()
        for t in tensors.values():
            touch(t)
    elif name == "tensorferry load_file (mmap)":
        tensors = {}
        for f in files:
            tensors.update(tensorferry.torch.load_file(f, backend="mmap"))
        loaded = time.perf_counter()
        for t in tensors.values():
            touch(t)
    elif name == "tensorferry Loader.load":
        tensors = tensorferry.Loader(checkpoint).load()
        loaded = time.perf_counter()
        for t in tensors.values():
            touch(t)
    elif name == "tensorferry Loader.iter_tensors 1GB":
        for _, t in tensorferry.Loader(checkpoint, budget="1GB").iter_tensors():
            touch(t)
        loaded = time.perf_counter()
    elif name == "safetensors load_file":
        tensors = {}
        for f in files:
            tensors.update(safetensors.torch.load_file(f))
        loaded = time.perf_counter()
        for t in tensors.values():
            touch(t)
    elif name == "safetensors load_file (pread)":
        tensors = {}
        for f in files:
            tensors.update(safetensors.torch.load_file(f, backend="pread"))
        loaded = time.perf_counter()
        for t in tensors.values():
            touch(t)
    elif name == "fastsafetensors (nogds)":
        loader = fastsafetensors.SafeTensorsFileLoader(None, "cpu", nogds=True)
        loader.add_filenames({0: files})
        fb = loader.copy_files_to_device()
        tensors = {k: fb.get_tensor(k) for k in loader.get_keys()}
        loaded = time.perf_counter()
        for t in tensors.values():
            touch(t)
    elif name == "runai-model-streamer":
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            for _, t in streamer.get_tensors():
                touch(t)
        loaded = time.perf_counter()
    elif name == "torch.load .bin":
        tensors = {}
        for f in sorted(os.listdir(bin_dir)):
            if f.endswith(".bin"):
                tensors.update(torch.load(os.path.join(bin_dir, f), map_location="cpu",
                                          weights_only=True))
        loaded = time.perf_counter()
        for t in tensors.values():
            touch(t)
    elif name == "limit: first touch":
        buf = np.empty(total, dtype=np.uint8)
        buf.fill(1)  # every page written once: what fresh memory costs here
        loaded = time.perf_counter()
        nbytes = total
    elif name == "limit: pread copy":
        import threading
        buf = np.empty(total, dtype=np.uint8)
        buf.fill(0)  # touched before timing: this limit is the copy alone
        start = time.perf_counter()
        chunk = 8 << 20
        jobs = []
        at = 0
        for f in files:
            size = os.path.getsize(f)
            for off in range(0, size, chunk):
                jobs.append((f, off, min(chunk, size - off), at + off))
            at += size
        view = memoryview(buf)
        lock = threading.Lock()

        def worker():
            fds = {}
            while True:
                with lock:
                    if not jobs:
                        break
                    f, off, n, dst = jobs.pop()
                fd = fds.get(f) or fds.setdefault(f, os.open(f, os.O_RDONLY))
                got = 0
                while got < n:
                    got += os.preadv(fd, [view[dst + got:dst + n]], off + got)
            for fd in fds.values():
                os.close(fd)

        threads = [threading.Thread(target=worker) for _ in range(os.cpu_count() or 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        loaded = time.perf_counter()
        nbytes = total
    else:
        raise SystemExit(f"unknown loader {name}")
    end = time.perf_counter()
    print(json.dumps({"seconds": end - start, "load_seconds": loaded - start, "bytes": nbytes,
                      "tensors": ntensors, "checksum": checksum,
                      "peak_rss_kb": rss_kb("VmHWM"), "baseline_rss_kb": baseline}))


# --- the parent ----------------------------------------------------------------------------------

def shard_files(checkpoint):
    if os.path.isfile(checkpoint):
        return [checkpoint]
    return sorted(os.path.join(checkpoint, f) for f in os.listdir(checkpoint)
                  if f.endswith(".safetensors"))


def ensure_checkpoint(checkpoint, preset):
    if os.path.exists(checkpoint):
        return
    cli = os.path.join(ROOT, "build", "release", "bin", "tensorferry")
    print(f"generating {checkpoint} ({preset} preset)", file=sys.stderr)
    subprocess.run([cli, "gen", checkpoint, "--preset", preset], check=True,
                   stdout=subprocess.DEVNULL)


def ensure_bin(checkpoint, bin_dir):
    """The same weights as pickle .bin shards (one per safetensors shard), written once."""
    files = shard_files(checkpoint)
    want = [os.path.join(bin_dir, os.path.basename(f).replace(".safetensors", ".bin"))
            for f in files]
    if all(os.path.exists(w) for w in want):
        return want
    os.makedirs(bin_dir, exist_ok=True)
    code = ("import sys, torch, safetensors.torch as st\n"
            "torch.save(st.load_file(sys.argv[1]), sys.argv[2])\n")
    for f, w in zip(files, want):
        print(f"writing {w}", file=sys.stderr)
        subprocess.run([sys.executable, "-c", code, f, w + ".tmp"], check=True)
        os.replace(w + ".tmp", w)
    return want


def environment():
    def version(module):
        try:
            from importlib.metadata import version as v
            return v(module)
        except Exception:  # noqa: BLE001
            return "not installed"

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) // 1024 for line in open("/proc/meminfo")
                if line.startswith("MemTotal")), 0)
    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_mib": mem, "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {m: version(m) for m in ("tensorferry", "torch", "numpy", "safetensors",
                                             "fastsafetensors", "runai-model-streamer")},
        "load_average": os.getloadavg(),
    }


def fmt_bytes(n):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000


def summarize(results, loaders, modes):
    rows = []
    for mode in modes:
        for name in loaders:
            runs = [r for r in results if r["loader"] == name and r["mode"] == mode and "seconds" in r]
            failed = [r for r in results if r["loader"] == name and r["mode"] == mode
                      and "error" in r]
            if not runs:
                if failed:
                    rows.append({"loader": name, "mode": mode, "error": failed[0]["error"]})
                continue
            gbps = [r["bytes"] / r["seconds"] / 1e9 for r in runs]
            rows.append({
                "loader": name, "mode": mode, "runs": len(runs),
                "gbps_median": statistics.median(gbps), "gbps_min": min(gbps), "gbps_max": max(gbps),
                "seconds_median": statistics.median(r["seconds"] for r in runs),
                "load_seconds_median": statistics.median(r["load_seconds"] for r in runs),
                "peak_rss_kb": statistics.median(r["peak_rss_kb"] for r in runs),
                "baseline_rss_kb": statistics.median(r["baseline_rss_kb"] for r in runs),
                "checksums": sorted({r["checksum"] for r in runs if r.get("tensors")}),
                "cached_before": statistics.median(r["cached_before"] for r in runs),
            })
    return rows


def markdown(rows, reference_checksum):
    out = ["| loader | mode | GB/s median (min–max) | s to all bytes read | s in the load call "
           "| peak RSS (after imports) | checksum |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['loader']} | {r['mode']} | failed: {r['error'][:80]} | | | | |")
            continue
        if r["loader"].startswith("limit"):
            check = "—"
        elif r["checksums"] == [reference_checksum]:
            check = "ok"
        else:
            check = "DIFFERS"
        out.append(
            f"| {r['loader']} | {r['mode']} | **{r['gbps_median']:.2f}** ({r['gbps_min']:.2f}–"
            f"{r['gbps_max']:.2f}) | {r['seconds_median']:.2f} | {r['load_seconds_median']:.2f} | "
            f"{fmt_bytes(r['peak_rss_kb'] * 1024)} ({fmt_bytes(r['baseline_rss_kb'] * 1024)}) | "
            f"{check} |")
    return "\n".join(out)


def svg_chart(rows, path):
    """Horizontal bars of median GB/s per loader, warm and cold side by side."""
    bars = [r for r in rows if "gbps_median" in r]
    if not bars:
        return
    width, label_w, bar_h, gap = 760, 300, 14, 6
    top = max(r["gbps_median"] for r in bars) or 1
    height = 30 + len(bars) * (bar_h + gap)
    colors = {"warm": "#d9822b", "cold": "#2b6cd9"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="4" y="14">GB/s to every byte read (median); orange warm, blue cold</text>']
    y = 24
    for r in bars:
        w = (width - label_w - 60) * r["gbps_median"] / top
        parts.append(f'<text x="4" y="{y + 11}">{r["loader"]} ({r["mode"]})</text>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h}" '
                     f'fill="{colors.get(r["mode"], "#888")}"/>')
        parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + 11}">{r["gbps_median"]:.2f}</text>')
        y += bar_h + gap
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", default=os.path.join(ROOT, "data", "default"))
    p.add_argument("--preset", default="default", help="preset to generate a missing checkpoint")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--modes", default="warm,cold")
    p.add_argument("--loaders", default=",".join(LOADERS),
                   help="comma-separated subset of: " + ", ".join(LOADERS))
    p.add_argument("--bin-dir", help="where the .bin copy lives (default: <checkpoint>-bin)")
    p.add_argument("--json", help="write every run and the summary here")
    p.add_argument("--svg", help="write a bar chart here")
    p.add_argument("--evict-also", default="",
                   help="cold runs also evict the .safetensors files of this directory (the "
                        "source of a FUSE mount the checkpoint is read through)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    checkpoint = os.path.abspath(args.checkpoint)
    bin_dir = os.path.abspath(args.bin_dir or checkpoint.rstrip("/") + "-bin")
    if args.child:
        child(args.child, checkpoint, bin_dir)
        return

    loaders = [name.strip() for name in args.loaders.split(",") if name.strip()]
    for name in loaders:
        if name not in LOADERS:
            raise SystemExit(f"unknown loader {name!r}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    ensure_checkpoint(checkpoint, args.preset)
    files = shard_files(checkpoint)
    bin_files = ensure_bin(checkpoint, bin_dir) if "torch.load .bin" in loaders else []
    env = environment()
    total = sum(os.path.getsize(f) for f in files)
    print(f"# {checkpoint}: {len(files)} files, {fmt_bytes(total)}; {args.runs} runs per loader "
          f"and mode after one warm-up, loaders alternating", file=sys.stderr)
    print(f"# {env['cpu']}, {env['cores']} cores, {env['memory_mib']} MiB, Linux "
          f"{env['kernel']}, Python {env['python']}; load average {env['load_average']}",
          file=sys.stderr)
    print("# " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()), file=sys.stderr)

    results = []
    for mode in modes:
        for run in range(args.runs + 1):  # run 0: warm-up, not counted
            for name in loaders:
                if mode == "cold" and name == "limit: first touch":
                    if run == 0:
                        continue
                paths = bin_files if name == "torch.load .bin" else files
                if mode == "cold" and args.evict_also:
                    evict(shard_files(args.evict_also))
                cached = evict(paths) if mode == "cold" else warm(paths, unless_cached=True)
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), checkpoint,
                                       "--bin-dir", bin_dir, "--child", name],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    r = {"loader": name, "mode": mode, "run": run,
                         "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
                else:
                    r = json.loads(proc.stdout.strip().splitlines()[-1])
                    r.update(loader=name, mode=mode, run=run, cached_before=cached)
                if run > 0:
                    results.append(r)
                line = (f"{mode} run {run}{' (warm-up)' if run == 0 else ''}: {name}: "
                        + (r["error"] if "error" in r else
                           f"{r['bytes'] / r['seconds'] / 1e9:.2f} GB/s, {r['seconds']:.2f} s, "
                           f"cached {cached:.0%}"))
                print(line, file=sys.stderr)
    env["load_average_end"] = os.getloadavg()
    rows = summarize(results, loaders, modes)
    sums = [c for r in rows if "checksums" in r and not r["loader"].startswith("limit")
            for c in r["checksums"]]
    reference = statistics.mode(sums) if sums else None
    print(markdown(rows, reference))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "checkpoint": checkpoint, "bytes": total,
                       "runs": results, "summary": rows}, f, indent=1)
    if args.svg:
        svg_chart(rows, args.svg)


if __name__ == "__main__":
    main()

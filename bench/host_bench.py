#!/usr/bin/env python3
"""Host (CPU) loading: tensorferry against its peers, in one run, on the same files.

Every loader runs in a fresh subprocess (fresh memory, its own peak RSS), times only the load
(imports excluded) and touches one byte of every 4 KiB page of every tensor, so lazy (mmap) loaders
are timed as their users pay for them (shared/BENCHMARKING.md, "What loaded means"). Loaders
alternate within each round; the median, min and max over --runs rounds are reported.

  .venv/bin/python bench/host_bench.py data/default --runs 5 [--cold] [--json out.json]

Peers: safetensors.torch.load_file, fastsafetensors (CPU, nogds), runai-model-streamer (CPU).
tensorferry: the CLI's `load` (engine auto and mmap) with --touch, timed as its `open_seconds +
wall_seconds` (Loader::Open, i.e. the index and every shard header, included, as every peer's clock
includes its own open).
--cold evicts the files (bench/_pagecache.py: fdatasync, POSIX_FADV_DONTNEED) before every load
and checks with mincore what is left: a row whose loads found more than 1% still cached is marked
with a warning (the table and the JSON); on tmpfs nothing can be evicted, which it says.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import _pagecache  # noqa: E402
CLI = os.environ.get("TENSORFERRY_CLI", os.path.join(ROOT, "build/release/bin/tensorferry"))

# Each peer: code run in a subprocess with FILES (list of paths) defined; it sets N (tensors) and
# BYTES after loading and touching everything between the two clock reads.
TOUCH = """
def touch(t):
    import torch
    if t.numel() == 0:
        return 0
    u = t.reshape(-1).view(torch.uint8)
    return int(u[::4096].sum())
"""

PEERS = {
    "safetensors.torch.load_file": """
from safetensors.torch import load_file
t0 = time.perf_counter()
N = BYTES = 0
for f in FILES:
    d = load_file(f)
    for t in d.values():
        touch(t); N += 1; BYTES += t.numel() * t.element_size()
T = time.perf_counter() - t0
""",
    "fastsafetensors (cpu)": """
from fastsafetensors import SafeTensorsFileLoader, SingleGroup
t0 = time.perf_counter()
loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
loader.add_filenames({0: FILES})
fb = loader.copy_files_to_device()
N = BYTES = 0
for key in list(fb.key_to_rank_lidx.keys()):
    t = fb.get_tensor(key)
    touch(t); N += 1; BYTES += t.numel() * t.element_size()
T = time.perf_counter() - t0
fb.close(); loader.close()
""",
    "runai-model-streamer (cpu)": """
from runai_model_streamer import SafetensorsStreamer
t0 = time.perf_counter()
N = BYTES = 0
with SafetensorsStreamer() as s:
    s.stream_files(FILES)
    for name, t in s.get_tensors():
        touch(t); N += 1; BYTES += t.numel() * t.element_size()
T = time.perf_counter() - t0
""",
}

HARNESS = """
import json, resource, sys, time
import torch  # imported before the baseline: the peak RSS reported is what loading added
FILES = json.loads(sys.argv[1])
{touch}
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
{body}
print(json.dumps({{"seconds": T, "tensors": N, "bytes": BYTES,
                  "peak_rss_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024}}))
"""


def shard_files(path):
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))


def warm(files):
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def run_peer(name, files):
    code = HARNESS.format(touch=TOUCH, body=PEERS[name])
    r = subprocess.run([sys.executable, "-c", code, json.dumps(files)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_tensorferry(path, engine):
    args = [CLI, "load", path, "--engine", engine, "--touch", "--no-checksum", "--json"]
    if engine == "mmap":
        args.append("--populate")
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    d = json.loads(r.stdout)
    # The whole load, open included (a CLI without open_seconds: wall_seconds alone).
    seconds = d.get("open_seconds", 0.0) + d["wall_seconds"]
    return {"seconds": seconds, "tensors": d["tensors"], "bytes": d["bytes"],
            "peak_rss_bytes": d["peak_rss_bytes"] - d["rss_before_bytes"]}


def positive_int(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--runs", type=positive_int, default=3)
    ap.add_argument("--cold", action="store_true", help="evict the files before every load")
    ap.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of the peers")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    files = shard_files(args.path)
    loaders = [("tensorferry (auto)", lambda: run_tensorferry(args.path, "auto")),
               ("tensorferry (mmap)", lambda: run_tensorferry(args.path, "mmap"))]
    for p in args.peers.split(","):
        if p:
            loaders.append((p, lambda p=p: run_peer(p, files)))
    results = {name: [] for name, _ in loaders}
    errors = {}
    left = {name: [] for name, _ in loaders}  # cold: the fraction cached after each eviction
    # tmpfs (ramfs): the pages are the files, nothing can be evicted.
    stuck = _pagecache.unevictable(files) if args.cold else None
    if not args.cold:
        warm(files)
    for _ in range(args.runs):
        for name, fn in loaders:
            if args.cold:
                # evict() as root would drop every cache of the machine, in vain, on tmpfs
                left[name].append(_pagecache.cached_fraction(files, 0.0) if stuck else
                                  _pagecache.evict(files, empty=0.0))
            r = fn()
            if "error" in r:
                errors[name] = r["error"]
                continue
            results[name].append(r)
    mode = "cold" if args.cold else "warm"
    warnings = {}
    if stuck:
        print(f"warning: --cold, but {stuck[0]} is on {stuck[1]}: eviction is impossible there "
              "(the pages are the file), every load below read from memory, not storage")
    for name, fractions in left.items():
        if fractions and max(fractions) > 0.01:
            warnings[name] = (f"{max(fractions):.0%} of the files still cached after eviction "
                              f"({sum(f > 0.01 for f in fractions)} of {len(fractions)} loads "
                              "over 1%): not a cold read" +
                              (f" ({stuck[1]}: eviction is impossible there)" if stuck else ""))
    rows = []
    print(f"| loader ({mode}, {len(files)} files) | GB/s median (min-max) | tensors/s median | "
          "peak RSS added |")
    print("|---|---|---|---|")
    for name, rs in results.items():
        mark = " (warning: not cold, see below)" if name in warnings else ""
        if not rs:
            print(f"| {name} | could not run: {errors.get(name, '?')} | | |")
            rows.append({"loader": name, "error": errors.get(name)})
            continue
        gbps = [r["bytes"] / r["seconds"] / 1e9 for r in rs]
        tps = [r["tensors"] / r["seconds"] for r in rs]
        rss = max(r["peak_rss_bytes"] for r in rs)
        print(f"| {name}{mark} | {statistics.median(gbps):.2f} ({min(gbps):.2f}-{max(gbps):.2f}) | "
              f"{statistics.median(tps):,.0f} | {rss / 1e9:.2f} GB |")
        row = {"loader": name, "mode": mode, "gb_per_s": gbps, "tensors_per_s": tps,
               "peak_rss_bytes": rss, "tensors": rs[0]["tensors"], "bytes": rs[0]["bytes"]}
        if args.cold:
            row["cached_after_evict"] = left[name]
        if name in warnings:
            row["warning"] = warnings[name]
        rows.append(row)
    for name, why in warnings.items():
        print(f"warning: {name}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

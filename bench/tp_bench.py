#!/usr/bin/env python3
"""Tensor-parallel loading benchmark (docs/benchmarks.md, "Tensor parallel").

Runs `tensorferry load --json` on a checkpoint: the full load, then every rank of world sizes 2, 4
and 8 with the builtin rules, for each gap setting (exact strides: --max-gap 0; the default 64KiB;
covering blocks: --max-gap 1GiB). Reports per configuration the median load time over --runs runs
and the bytes read per rank against the target (split tensors / world + replicated tensors).
Files are read warm (page cache) unless --cold evicts them (bench/_pagecache.py: fdatasync,
POSIX_FADV_DONTNEED) before every run and checks with mincore what is left: configurations whose
runs found more than 1% still cached are named in a warning after the table (on tmpfs nothing can
be evicted, which it says before and after the table). Times are the loads' own `seconds`
(Loader::Open not included: every row is tensorferry's, with the same open, so the "vs full load"
ratio compares the loads alone).

    .venv/bin/python bench/tp_bench.py data/default [--cli build/release/bin/tensorferry]
        [--runs 3] [--engine pread] [--worlds 2,4,8] [--gaps 0,64KiB,1GiB,auto] [--cold]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _pagecache  # noqa: E402

# --cold: the checkpoint's files and whether one is on tmpfs ((path, type) or None).
COLD = {"on": False, "files": [], "stuck": None}


def evict():
    """Drops the checkpoint's pages from the page cache (bench/_pagecache.py: fdatasync, then
    POSIX_FADV_DONTNEED), so the next run reads from storage; returns the fraction still cached
    (mincore). On tmpfs only measures it: nothing can be evicted there."""
    if COLD["stuck"]:
        return _pagecache.cached_fraction(COLD["files"], 0.0)
    return _pagecache.evict(COLD["files"], empty=0.0)


def run(cli, args):
    left = evict() if COLD["on"] else 0.0
    r = subprocess.run([cli, "load", *args, "--json", "--no-checksum"], capture_output=True,
                       text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"tensorferry load {' '.join(args)} failed: {r.stderr.strip()}")
    doc = json.loads(r.stdout)
    doc["cached_after_evict"] = left
    return doc


def positive_int(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def not_cold(label, rs, warnings):
    """With --cold, adds a warning for `label` when a run of `rs` found more than 1% of the
    checkpoint still cached after its eviction."""
    over = [r["cached_after_evict"] for r in rs if r["cached_after_evict"] > 0.01]
    if COLD["on"] and not COLD["stuck"] and over:  # tmpfs: one warning says it for every run
        warnings.append(f"{label}: {len(over)} of {len(rs)} runs found up to {max(over):.0%} of "
                        "the checkpoint still cached after eviction: not a cold read")


def split_and_replicated(cli, path):
    """(bytes of tensors the builtin rules split, bytes of replicated tensors), from inspect."""
    r = subprocess.run([cli, "inspect", path, "--json", "--all"], capture_output=True, text=True,
                       check=True)
    doc = json.loads(r.stdout)
    try:
        import tensorferry
        spec = tensorferry.ShardSpec.builtin()
        rule_for = spec.rule_for
    except ImportError:
        sys.exit("the tensorferry Python package is needed for the builtin rules "
                 "(scripts/install_python.sh)")
    split = replicated = 0
    for t in doc["tensors"]:
        n = t["bytes"] if "bytes" in t else t["size"]
        if "split" in rule_for(t["name"]):
            split += n
        else:
            replicated += n
    return split, replicated


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--cli", default="build/release/bin/tensorferry")
    ap.add_argument("--runs", type=positive_int, default=3)
    ap.add_argument("--engine", default="pread")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--gaps", default="0,64KiB,1GiB")
    ap.add_argument("--threads", default="")
    ap.add_argument("--cold", action="store_true",
                    help="evict the checkpoint from the page cache before every run")
    a = ap.parse_args()
    if a.cold:
        import glob
        COLD["on"] = True
        COLD["files"] = sorted(glob.glob(os.path.join(a.path, "*.safetensors"))) \
            if os.path.isdir(a.path) else [a.path]
        COLD["stuck"] = _pagecache.unevictable(COLD["files"])
    common = ["--engine", a.engine] + (["--threads", a.threads] if a.threads else [])
    split, replicated = split_and_replicated(a.cli, a.path)
    import platform
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"machine: {os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}")
    print(f"checkpoint {a.path}: {split / 1e9:.4f} GB split by the builtin rules, "
          f"{replicated / 1e6:.3f} MB replicated; engine {a.engine}; median of {a.runs} runs, "
          f"{'cold (evicted before each run)' if a.cold else 'warm page cache'}")
    if COLD["stuck"]:
        print(f"warning: --cold, but {COLD['stuck'][0]} is on {COLD['stuck'][1]}: eviction is "
              "impossible there (the pages are the file), every run reads from memory")
    warnings = []
    if not a.cold:
        run(a.cli, [a.path] + common)  # warm the page cache
    full = [run(a.cli, [a.path] + common) for _ in range(a.runs)]
    not_cold("full load", full, warnings)
    full_s = statistics.median(r["seconds"] for r in full)
    print(f"full load: {full[0]['bytes_read'] / 1e9:.3f} GB read, {full_s:.3f} s")
    print()
    print("| world | max gap | bytes read per rank (max) | target | max / target | "
          "time per rank (median over ranks) | slowest rank | vs full load |")
    print("|---|---|---|---|---|---|---|---|")
    for world in [int(w) for w in a.worlds.split(",")]:
        target = split / world + replicated
        for gap in a.gaps.split(","):
            reads, times, config_runs = [], [], []
            for rank in range(world):
                # "auto": no --max-gap (exact strides for cached files, 64KiB for the others)
                gap_args = [] if gap == "auto" else ["--max-gap", gap]
                rs = [run(a.cli, [a.path, "--tp-rank", str(rank), "--tp-size", str(world)] +
                          gap_args + common) for _ in range(a.runs)]
                reads.append(max(r["bytes_read"] for r in rs))
                config_runs += rs
                times.append(statistics.median(r["seconds"] for r in rs))
            print(f"| {world} | {gap} | {max(reads) / 1e9:.4f} GB | {target / 1e9:.4f} GB | "
                  f"{max(reads) / target:.4f} | {statistics.median(times):.3f} s | "
                  f"{max(times):.3f} s | {statistics.median(times) / full_s:.2f}x |")
            not_cold(f"world {world}, max gap {gap} (all ranks)", config_runs, warnings)
    if COLD["stuck"]:
        warnings.append(f"--cold on {COLD['stuck'][1]}: nothing was evicted, every row above is "
                        "a read from memory")
    for w in warnings:
        print(f"warning: {w}")


if __name__ == "__main__":
    main()

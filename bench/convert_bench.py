"""Conversion throughput, PyTorch checkpoint -> safetensors: `tensorferry convert` against
`torch.load` + `safetensors.torch.save_file`, same run, same source file, both warm in the page
cache, neither syncing to disk.

The source is a synthetic Llama-style checkpoint: `tensorferry gen --preset P` writes safetensors,
which are loaded and written back with `torch.save` as one pytorch_model.bin (zip format; legacy
with --legacy). Throughput is source bytes / wall seconds of the conversion (process start to exit
for the CLI; torch.load + save_file inside an already started Python for the baseline, so the
baseline is not charged for importing torch). Each conversion runs in its own process, whose peak
resident memory is reported too.

    .venv/bin/python bench/convert_bench.py --preset small [--repeat 3] [--legacy] [--work DIR]
"""
import argparse
import os
import platform
import shutil
import subprocess
import sys
import time

import torch
from safetensors import safe_open
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            mem_kb = int(f.readline().split()[1])
    except OSError:
        mem_kb = 0
    return (f"{platform.node()}: {os.cpu_count()} cores ({cpu}), {mem_kb / 2**20:.1f} GiB RAM, "
            f"Linux {platform.release()}, torch {torch.__version__}")


def warm(path):
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def make_source(cli, preset, work, legacy):
    src = os.path.join(work, f"pytorch_model{'_legacy' if legacy else ''}.bin")
    if os.path.exists(src):
        return src
    gen = os.path.join(work, "gen")
    shutil.rmtree(gen, ignore_errors=True)
    subprocess.run([cli, "gen", gen, "--preset", preset, "--no-sync"], check=True,
                   stdout=subprocess.DEVNULL)
    sd = {}
    for name in sorted(os.listdir(gen)):
        if name.endswith(".safetensors"):
            sd.update(load_file(os.path.join(gen, name)))
    torch.save(sd, src + ".tmp", _use_new_zipfile_serialization=not legacy)
    os.replace(src + ".tmp", src)
    shutil.rmtree(gen)
    return src


BASELINE = """
import sys, time, torch
from safetensors.torch import save_file
start = time.perf_counter()
sd = torch.load(sys.argv[1], weights_only=True)
save_file(sd, sys.argv[2], metadata={"format": "pt"})
print(time.perf_counter() - start)
"""


def run_measured(cmd):
    """Runs cmd in its own process: (wall seconds, peak RSS in bytes, stdout). GNU time reports
    the peak RSS: a child forked from this (large) Python would inherit its high-water mark."""
    start = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True)
    elapsed = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed with {r.returncode}: {r.stderr.decode()[-500:]}")
    return elapsed, int(r.stderr.decode().strip().splitlines()[-1]) * 1024, r.stdout


def time_cli(cli, src, dst):
    elapsed, rss, _ = run_measured([cli, "convert", src, dst, "--no-sync"])
    return elapsed, rss


def time_torch(src, dst):
    # Timed inside the process (torch's import is not charged); peak RSS is the process's.
    _, rss, out = run_measured([sys.executable, "-c", BASELINE, src, dst])
    return float(out.decode().strip()), rss


def same_tensors(a, b):
    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        if sorted(fa.keys()) != sorted(fb.keys()):
            return False
        return all(torch.equal(fa.get_tensor(k).view(torch.uint8), fb.get_tensor(k).view(torch.uint8))
                   for k in fa.keys())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small", "default", "large"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--legacy", action="store_true", help="legacy (non-zip) torch.save source")
    ap.add_argument("--work", default=os.path.join(ROOT, "data", "convert_bench"))
    ap.add_argument("--cli", default=os.path.join(ROOT, "build", "release", "bin", "tensorferry"))
    args = ap.parse_args()
    if "release" not in args.cli:
        print(f"warning: {args.cli} may not be an optimized build", file=sys.stderr)
    os.makedirs(os.path.join(args.work, args.preset), exist_ok=True)
    work = os.path.join(args.work, args.preset)
    src = make_source(args.cli, args.preset, work, args.legacy)
    size = os.path.getsize(src)
    print(machine())
    print(f"source: {src} ({size / 1e9:.3f} GB, {'legacy' if args.legacy else 'zip'} format), "
          f"{args.repeat} runs each, alternating, page cache warm, no fsync")
    ours_dst = os.path.join(work, "ours.safetensors")
    ref_dst = os.path.join(work, "reference.safetensors")
    ours, ref = [], []
    for _ in range(args.repeat):
        warm(src)
        ours.append(time_cli(args.cli, src, ours_dst))
        warm(src)
        ref.append(time_torch(src, ref_dst))
    if not same_tensors(ours_dst, ref_dst):
        print("error: the two outputs differ", file=sys.stderr)
        return 1
    for label, runs in (("tensorferry convert", ours), ("torch.load + save_file", ref)):
        times = sorted(t for t, _ in runs)
        best, median = times[0], times[len(times) // 2]
        rss = max(r for _, r in runs)
        print(f"{label:24s} best {best:6.3f} s = {size / best / 1e9:5.2f} GB/s   "
              f"median {median:6.3f} s = {size / median / 1e9:5.2f} GB/s   "
              f"peak RSS {rss / 1e6:7.1f} MB")
    print("runs (s): tensorferry " + ", ".join(f"{t:.3f}" for t, _ in ours)
          + "; torch " + ", ".join(f"{t:.3f}" for t, _ in ref))
    print("outputs hold identical tensors")
    os.remove(ours_dst)
    os.remove(ref_dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())

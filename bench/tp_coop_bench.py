#!/usr/bin/env python3
"""Tensor-parallel loading on one machine, in one run: N MPI ranks (tensorferry-mpi) loading the
same checkpoint in each mode, warm and cold, runs alternating between modes.

Modes (tensorferry-mpi load --mode):
  full         every rank reads every tensor whole (a TP job without sliced loading);
  sliced       every rank reads only its own slices from the files (the independent per-rank
               sliced path), when this build has it;
  cooperative  every byte is read once by one rank and the slices travel over MPI.
Reference in the same run: one process reading the whole checkpoint (mode full, 1 rank): what
the storage or the page cache gives one reader.

For each configuration: median, min and max of the wall time (common barrier to the last rank's
end) over --runs runs, and the bytes read from files by all ranks together.

    python3 bench/tp_coop_bench.py data/default --ranks 4 --runs 5 --cold-runs 3 --json out/tp.json
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_mpi(tool, np, path, mode, args, cold):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1")  # more ranks than cores: do not spin
    cmd = ["mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none", tool, "load", path,
           "--mode", mode, "--json", "--budget", args.budget, "--shard-rules", args.shard_rules]
    if args.engine:
        cmd += ["--engine", args.engine]
    if args.direct:
        cmd += ["--direct", args.direct]
    if cold:
        cmd.append("--cold")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr}{r.stdout}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    run = doc["runs"][0]
    return run["wall_seconds"], run["bytes_read_total"], run["per_rank"]


def supports_sliced(tool):
    r = subprocess.run([tool, "load", "--help"], capture_output=True, text=True,
                       env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                                OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    return "sliced" in r.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--cold-runs", type=int, default=3, help="0: no cold runs")
    p.add_argument("--budget", default="512MB")
    p.add_argument("--engine", default="")
    p.add_argument("--direct", default="", help="auto | on | off (on: every rank reads from "
                   "storage, as ranks on separate machines would; the page cache is not shared)")
    p.add_argument("--shard-rules", default="builtin")
    p.add_argument("--tool", default=os.path.join(ROOT, "build", "release", "bin", "tensorferry-mpi"))
    p.add_argument("--json", help="write every sample here")
    args = p.parse_args()
    if not shutil.which("mpirun"):
        raise SystemExit("mpirun not found (Debian: openmpi-bin)")
    modes = ["full"] + (["sliced"] if supports_sliced(args.tool) else []) + ["cooperative"]
    size = sum(os.path.getsize(os.path.join(args.path, f)) for f in os.listdir(args.path)
               if f.endswith(".safetensors")) if os.path.isdir(args.path) else os.path.getsize(args.path)
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, {platform.release()}; "
          f"{args.path}: {size / 1e9:.2f} GB; {args.ranks} ranks, budget {args.budget}, "
          f"shard rules {args.shard_rules}, direct {args.direct or 'default'}; modes {', '.join(modes)}", flush=True)
    samples = {}
    configs = [(False, args.runs)] + ([(True, args.cold_runs)] if args.cold_runs else [])
    for cold, runs in configs:
        label = "cold" if cold else "warm"
        if not cold and runs:  # warm-up: every file in the page cache
            run_mpi(args.tool, 1, args.path, "full", args, False)
        for i in range(runs):
            # Alternate the modes within each round of runs.
            for mode, np in [("reference: 1 rank, full", 1)] + [(m, args.ranks) for m in modes]:
                m = "full" if mode.startswith("reference") else mode
                wall, read, per_rank = run_mpi(args.tool, np, args.path, m, args, cold)
                samples.setdefault((label, mode), []).append(
                    {"wall": wall, "read": read, "per_rank": per_rank})
                print(f"  {label} run {i + 1} {mode}: {wall:.3f} s, read {read / 1e9:.2f} GB",
                      file=sys.stderr, flush=True)
    print(f"\n| page cache | mode | ranks | wall s (median) | min | max | GB read (all ranks) | "
          f"checkpoint GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for (label, mode), s in samples.items():
        walls = [x["wall"] for x in s]
        med = statistics.median(walls)
        np = 1 if mode.startswith("reference") else args.ranks
        print(f"| {label} | {mode} | {np} | {med:.3f} | {min(walls):.3f} | {max(walls):.3f} | "
              f"{s[0]['read'] / 1e9:.2f} | {size / med / 1e9:.2f} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({f"{k[0]}: {k[1]}": v for k, v in samples.items()}, f, indent=1)


if __name__ == "__main__":
    main()

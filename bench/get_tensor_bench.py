#!/usr/bin/env python3
"""Per-call cost of the drop-in API: safe_open(...).get_tensor(name) for every tensor of a file of
many small tensors, tensorferry against the safetensors package, alternated in one process, page
cache warm (each round reads the whole file; the first round of each warms it). A call is timed
with a read of each of its bytes (a sum over a uint8 view), so that a lazily mapped tensor pays
for its page faults as its user would.

    .venv/bin/python bench/get_tensor_bench.py                 # 3000 tensors of 16 F32, 7 rounds
    .venv/bin/python bench/get_tensor_bench.py --tensors 300 --elements 262144 --rounds 9

The file is written to --dir (default: a temporary directory) with safetensors.torch.save_file;
every tensor read by tensorferry is compared with the safetensors package's.
"""
import argparse
import os
import statistics
import tempfile
import time

import safetensors
import torch
from safetensors.torch import save_file

import tensorferry


def read_all(module, path):
    start = time.perf_counter()
    out = {}
    total = 0
    with module.safe_open(path, framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            total += int(t.view(torch.uint8).sum(dtype=torch.int64))
            out[name] = t
    return time.perf_counter() - start, out, total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=3000)
    ap.add_argument("--elements", type=int, default=16, help="F32 elements per tensor")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "many.safetensors")
        save_file({f"t{i}": torch.full((args.elements,), float(i)) for i in range(args.tensors)},
                  path)
        times = {"tensorferry": [], "safetensors": []}
        for _ in range(args.rounds):
            t_tf, got, sum_tf = read_all(tensorferry, path)
            t_st, want, sum_st = read_all(safetensors, path)
            assert sum_tf == sum_st
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
            times["tensorferry"].append(t_tf)
            times["safetensors"].append(t_st)
        mib = args.elements * 4 * args.tensors / 2**20
        print(f"{args.tensors} tensors of {args.elements} F32 ({mib:.2f} MiB), "
              f"{args.rounds} rounds, load average {os.getloadavg()[0]:.2f}")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:12s} median {med:.4f} s ({med / args.tensors * 1e6:.1f} us a call), "
                  f"min {min(ts):.4f} s, max {max(ts):.4f} s")


if __name__ == "__main__":
    main()

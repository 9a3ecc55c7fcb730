"""Header-parse benchmark: one safetensors file with many small tensors (MoE-style names), parsed by
tensorferry and by the reference implementation (huggingface/safetensors) in the same run.

    .venv/bin/python bench/parse_bench.py [--tensors 100000] [--iterations 11] [--build build/release]

tensorferry: `tf_header_parse_bench` (in process, after a warm-up): `parse` is ParseHeader over bytes in
memory, `open` is Checkpoint::Open (open + read header + parse + build the table).
reference: `safetensors.safe_open(path, "np")` and `keys()` (open + read header + parse + build),
timed in this Python process after a warm-up. The file is read once first (warm page cache).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import save_file


def make_file(path, count):
    tensors = {}
    layers = max(1, count // (3 * 64))
    i = 0
    layer = 0
    while i < count:
        for e in range(64):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if i == count:
                    break
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                tensors[name] = np.full((4, 4), i % 251, dtype=np.float16)
                i += 1
        layer += 1
    save_file(tensors, path, metadata={"format": "pt"})
    return layers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--iterations", type=int, default=11)
    ap.add_argument("--build", default="build/release")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    bench = os.path.join(args.build, "bin", "tf_header_parse_bench")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "many.safetensors")
        make_file(path, args.tensors)
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
        ours = json.loads(subprocess.check_output([bench, path, str(args.iterations)]))

        times = []
        for i in range(args.iterations + 1):
            t0 = time.perf_counter()
            with safe_open(path, "np") as f:
                n = len(f.keys())
            t1 = time.perf_counter()
            if i:
                times.append(t1 - t0)
        assert n == args.tensors
        ref = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}

    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "kernel": platform.release(), "python": platform.python_version(),
                    "safetensors": safetensors.__version__},
        "tensors": args.tensors, "header_bytes": ours["header_bytes"], "iterations": args.iterations,
        "tensorferry_parse": {k[6:]: v for k, v in ours.items() if k.startswith("parse_")},
        "tensorferry_open": {k[5:]: v for k, v in ours.items() if k.startswith("open_")},
        "reference_safe_open": dict(ref, tensors_per_s=args.tensors / ref["median_s"]),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.tensors} tensors, header {ours['header_bytes'] / 1e6:.1f} MB, "
          f"median of {args.iterations} runs (min-max):")
    rows = [("tensorferry ParseHeader (bytes in memory)", result["tensorferry_parse"]),
            ("tensorferry Checkpoint::Open (open+read+parse)", result["tensorferry_open"]),
            ("safetensors safe_open+keys (open+read+parse)", result["reference_safe_open"])]
    for label, r in rows:
        print(f"  {label:48s} {r['median_s'] * 1e3:8.1f} ms ({r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f})"
              f"  {r['tensors_per_s'] / 1e6:6.2f} M tensors/s")
    print(f"  speed-up of Checkpoint::Open over safe_open: "
          f"{result['reference_safe_open']['median_s'] / result['tensorferry_open']['median_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())

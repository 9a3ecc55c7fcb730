"""What checksum verification costs `Loader.load_into` (docs/integrity.md; figures in
docs/benchmarks.md, "Integrity checksums"): the whole checkpoint file into preallocated torch tensors
on the host, verify="off" and "on" alternating (the order flips every round), warm, medians over the
rounds after the first.

  .venv/bin/python bench/load_into_verify_bench.py FILE.safetensors [--rounds 7]
"""
import argparse
import statistics
import time

import torch

import tensorferry


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", help="one .safetensors file (with embedded checksums)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    with tensorferry.safe_open(args.path, framework="pt") as f:
        out = {k: torch.empty_like(f.get_tensor(k)) for k in f.keys()}
    nbytes = sum(t.numel() * t.element_size() for t in out.values())
    rates = {"off": [], "on": []}
    verified = 0
    for r in range(args.rounds):
        for verify in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
            with tensorferry.Loader(args.path, verify=verify) as loader:
                start = time.perf_counter()
                loader.load_into(out)
                seconds = time.perf_counter() - start
                stats = loader.stats
            if (stats.verified_tensors > 0) != (verify == "on"):
                raise SystemExit(f"verify={verify}: {stats.verified_tensors} tensors verified "
                                 "(does the file carry checksums?)")
            if verify == "on":
                verified = stats.verified_tensors
            if r > 0:
                rates[verify].append(nbytes / seconds / 1e9)
    for verify, got in rates.items():
        print(f"verify {verify:3} median {statistics.median(got):.2f} GB/s  (runs "
              f"{min(got):.2f}-{max(got):.2f})")
    cost = 1 - statistics.median(rates["on"]) / statistics.median(rates["off"])
    print(f"cost {100 * cost:+.1f}%  ({verified} tensors verified per load, {nbytes / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Opening a checkpoint of many shards in a store with a first-byte latency: the time before the
first byte of a load (Checkpoint::Open: one ranged GET per file) and the whole load, for two CLI
binaries side by side (for example the build before and after a change to how files are opened).

    .venv/bin/python bench/object_open_bench.py --cli-a /var/tmp/tensorferry-seq \\
        --cli-b build/release/bin/tensorferry --shards 64 --latency-ms 20 --repeats 3

What it does: writes a checkpoint of --shards shards with `tensorferry gen` (under --data), serves
it with nginx on loopback (tests/python/objstore_servers.py) behind tests/python/fault_proxy.py
delaying every request by --latency-ms (the time to first byte of a distant store: S3 answers in
tens of milliseconds), then runs, alternating the two binaries, `tensorferry inspect URL --json`
(the open alone) and `tensorferry load URL --json` (open and load); each run's wall time is the
process's. Prints medians and the machine's load before and after; --json writes them.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def timed(argv):
    start = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr[-800:]}")
    return wall, json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli-a", required=True, help="one tensorferry CLI (e.g. the build before)")
    ap.add_argument("--cli-b", required=True, help="the other (e.g. the build after)")
    ap.add_argument("--shards", type=int, default=64)
    ap.add_argument("--shard-size", default="300KB")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", default="/var/tmp/tf-open-bench")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    from fault_proxy import FaultProxy
    from objstore_servers import NginxHttp

    report = {"uptime_before": uptime(), "args": vars(args)}
    print(report["uptime_before"], flush=True)
    ckpt = os.path.join(args.data, f"ckpt-{args.shards}x{args.shard_size}")
    if not os.path.isdir(ckpt):
        os.makedirs(args.data, exist_ok=True)
        # A tiny-preset model with enough layers that --shard-size cuts it into --shards files.
        subprocess.run([args.cli_b, "gen", ckpt, "--preset", "tiny", "--layers",
                        str(args.shards * 4), "--shard-size", args.shard_size, "--no-sync"],
                       check=True, capture_output=True, text=True)
    shards = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in shards)
    print(f"checkpoint {ckpt}: {len(shards)} shards, {size / 1e6:.1f} MB", flush=True)
    rows = {}
    with NginxHttp() as nginx:
        nginx.copy_dir(ckpt, "ckpt")
        with FaultProxy("127.0.0.1", nginx.port, latency_s=args.latency_ms / 1000) as proxy:
            url = f"{proxy.url}/ckpt/model.safetensors.index.json"
            for i in range(args.repeats):
                order = [("a", args.cli_a), ("b", args.cli_b)]
                if i % 2:
                    order.reverse()
                for name, cli in order:
                    for what, cmd in (("open (inspect)", "inspect"), ("open + load", "load")):
                        wall, doc = timed([cli, cmd, url, "--json"])
                        rows.setdefault(f"{what} {name}", []).append(wall)
                        print(f"  round {i + 1} {name} {what:16s} {wall:7.3f} s", flush=True)
    report["checkpoint"] = {"path": ckpt, "shards": len(shards), "bytes": size}
    report["medians"] = {k: statistics.median(v) for k, v in rows.items()}
    report["runs"] = rows
    report["uptime_after"] = uptime()
    print(f"\nmedians of {args.repeats} (process wall time, s), a = {args.cli_a}, b = {args.cli_b}:")
    for what in ("open (inspect)", "open + load"):
        a, b = report["medians"][f"{what} a"], report["medians"][f"{what} b"]
        print(f"  {what:16s} a {a:7.3f}  b {b:7.3f}  a/b {a / b:5.2f}x")
    print(report["uptime_after"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

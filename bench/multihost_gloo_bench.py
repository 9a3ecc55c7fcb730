#!/usr/bin/env python3
"""The Python cooperative mode (Loader(process_group=...), torch.distributed over gloo) across the
multi-host rehearsal (scripts/multihost.sh), against the independent sliced load: the Python
counterpart of bench/multihost_coop.sh (issue 17; docs/benchmarks.md).

    .venv/bin/python bench/multihost_gloo_bench.py [--hosts 4] [--ranks-per-host 2] \\
        [--rate 200mbit] [--storage-rate 20mbps] [--ckpt data/small] [--repeats 3] \\
        [--budget 32MB] [--contenders sliced,all,auto]

Builds the rehearsal (links shaped to --rate, each host's disk reads throttled to
--storage-rate), stages the checkpoint on every host, and starts one Python process per rank
(`scripts/multihost.sh exec`), all of one torch.distributed (gloo) group. The processes run every
contender --repeats times, alternating (each repetition starts one contender later), each load
with O_DIRECT and every host's copy evicted from the page cache first (every read goes to the
throttled disk: cold, storage-bound), and the builtin shard rules:
  sliced   Loader(tp_rank, tp_size, shard_rules) without process_group: each rank its own slices;
  all      process_group=, coop_exchange="all": every tensor read once and exchanged;
  auto     process_group=, coop_exchange="auto" with coop_storage_rate/coop_network_rate set to
           the configured rates: the cost model's choice;
  measured the same without coop_network_rate: the plan made with the rate (and the time) of the
           network probe;
  none     process_group=, coop_exchange="none".
A load's time is the slowest rank's (all ranks start after a barrier). Prints one JSON line per
load and a summary (medians). Root only. Run it with nothing else on the machine.
"""
import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "multihost.sh")


def bytes_per_second(rate):
    """tc's spelling (20mbps: 20 MB/s, 200mbit: 25 MB/s) as bytes per second."""
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise SystemExit(f"cannot read rate {rate!r} (tc units: 20mbps, 200mbit)")
    n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return int(n / 8 if m.group(3) == "bit" else n)


def evict(path):
    """Drops the checkpoint's files under `path` from the page cache (posix_fadvise DONTNEED)."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def worker(args):
    """One rank: every contender, args.repeats times, alternating; rank 0 prints the results."""
    import torch
    import torch.distributed as dist

    import tensorferry
    rank, world = args.rank, args.world
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank,
                            world_size=world)
    pg = dist.new_group(list(range(world)))
    contenders = args.contenders.split(",")
    common = dict(tp_rank=rank, tp_size=world, shard_rules="builtin", direct="on",
                  engine=args.engine)
    for rep in range(args.repeats):
        for j in range(len(contenders)):
            name = contenders[(rep + j) % len(contenders)]
            kwargs = dict(common)
            if name != "sliced":
                kwargs.update(process_group=pg, budget=args.budget,
                              coop_exchange="auto" if name == "measured" else name,
                              coop_storage_rate=args.model_storage)
                if name != "measured":  # measured: the probe's rate
                    kwargs.update(coop_network_rate=args.model_network)
            evict(args.path)  # cold: this host's copy out of the page cache
            dist.barrier()
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            loader = tensorferry.Loader(args.path, **kwargs)
            got = loader.load()
            seconds = time.perf_counter() - start
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
            stats = loader.cooperative_stats if name != "sliced" else {}
            read = stats.get("bytes_read", loader.stats.bytes_read)
            loader.close()
            del got
            figures = torch.tensor([seconds, read, stats.get("bytes_sent", 0), cpu],
                                   dtype=torch.float64)
            slowest = figures.clone()
            dist.all_reduce(slowest[:1], op=dist.ReduceOp.MAX)
            # The slowest rank's time in the rounds' reads, the exchange and the local reads.
            parts = torch.tensor([stats.get(k, 0.0) for k in
                                  ("read_seconds", "exchange_seconds", "local_seconds",
                                   "network_seconds")],
                                 dtype=torch.float64)
            dist.all_reduce(parts, op=dist.ReduceOp.MAX)
            dist.all_reduce(figures[1:], op=dist.ReduceOp.SUM)
            if rank == 0:
                print(json.dumps({"contender": name, "repeat": rep + 1,
                                  "wall_seconds": round(slowest[0].item(), 3),
                                  "bytes_read_total": int(figures[1].item()),
                                  "bytes_sent_total": int(figures[2].item()),
                                  "cpu_seconds_total": round(figures[3].item(), 3),
                                  "exchanged_tensors": stats.get("exchanged_tensors"),
                                  "local_tensors": stats.get("local_tensors"),
                                  "hosts": stats.get("hosts"),
                                  "probe_seconds": stats.get("probe_seconds"),
                                  "slowest_read_exchange_local_network_seconds":
                                      [round(v, 3) for v in parts.tolist()],
                                  "measured_network_rate": stats.get("measured_network_rate"),
                                  "rounds": stats.get("rounds")}),
                      flush=True)
    dist.destroy_process_group()


def driver(args):
    prefix = args.prefix
    subprocess.run([SCRIPT, "down", "--prefix", prefix], capture_output=True)
    subprocess.run([SCRIPT, "up", "--prefix", prefix, "--hosts", str(args.hosts), "--rate",
                    args.rate, "--storage-rate", args.storage_rate], check=True)
    try:
        path = subprocess.run([SCRIPT, "stage", "--prefix", prefix, args.ckpt, "ckpt"],
                              check=True, capture_output=True, text=True).stdout.strip()
        os.sync()  # the staged copies written back, so that evicting them drops every page
        hosts = [f"h{i}" for i in range(1, args.hosts + 1)]
        status = subprocess.run([SCRIPT, "status", "--prefix", prefix], capture_output=True,
                                text=True).stdout
        master = re.search(r"^h1 ([0-9.]+) ", status, re.M)
        if master is None:
            raise SystemExit(f"multihost_gloo_bench: no address for h1 in: {status}")
        load = open("/proc/loadavg").read().split()[:3]
        print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} load average {load}; "
              f"{args.hosts} hosts x {args.ranks_per_host} ranks, link {args.rate}, storage "
              f"{args.storage_rate} per host, budget {args.budget}, engine "
              f"{args.engine or 'default'}, checkpoint {args.ckpt}",
              flush=True)
        world = args.hosts * args.ranks_per_host
        port = str(29000 + os.getpid() % 1000)
        procs = []
        for rank in range(world):
            host = hosts[rank // args.ranks_per_host]
            procs.append(subprocess.Popen(
                [SCRIPT, "exec", "--prefix", prefix, host, sys.executable, __file__, "--worker",
                 "--rank", str(rank), "--world", str(world), "--master", master.group(1),
                 "--port", port, "--path", path, "--repeats", str(args.repeats),
                 "--budget", args.budget, "--contenders", args.contenders,
                 "--model-storage", str(bytes_per_second(args.storage_rate)),
                 "--model-network", str(bytes_per_second(args.rate))]
                + (["--engine", args.engine] if args.engine else []),
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True))
        rows = []
        for line in procs[0].stdout:
            print(line, end="", flush=True)
            rows.append(json.loads(line))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        by = {}
        for r in rows:
            by.setdefault(r["contender"], []).append(r)
        base = statistics.median(r["wall_seconds"] for r in by.get("sliced", rows))
        for c, rs in by.items():
            med = statistics.median(r["wall_seconds"] for r in rs)
            print(json.dumps({"contender": c, "median_wall_seconds": med,
                              "runs": [r["wall_seconds"] for r in rs],
                              "speedup_vs_sliced": round(base / med, 2),
                              "bytes_read_total": rs[0]["bytes_read_total"],
                              "exchanged_tensors": rs[0]["exchanged_tensors"]}), flush=True)
    finally:
        subprocess.run([SCRIPT, "down", "--prefix", prefix], capture_output=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--storage-rate", default="20mbps")
    p.add_argument("--ckpt", default=os.path.join(ROOT, "data", "small"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget", default="32MB")
    p.add_argument("--contenders", default="sliced,all,auto")
    p.add_argument("--prefix", default="tfgloo")
    p.add_argument("--engine", default=None,
                   help="every load's engine (default: the Loader's choice; its auto may map the "
                        "files, and then O_DIRECT does not apply and the ranks of a host share "
                        "the page cache)")
    # Worker side (started by the driver in each host).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--port", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--model-storage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-network", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
    else:
        if os.getuid() != 0:
            raise SystemExit("multihost_gloo_bench: needs root (network namespaces, cgroups)")
        driver(args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Loading a model straight from an HTTP model hub, against downloading it first.

    .venv/bin/python bench/hub_bench.py                          # 2 GB checkpoint, 3 rounds
    .venv/bin/python bench/hub_bench.py --size 64MB --repeats 1 --resolver-delay 0.05

The hub is tests/python/hub_server.ModelHub on loopback, shaped like the Hugging Face Hub's file
endpoints: a resolver (`/<org>/<name>/resolve/main/<file>`, each answer delayed by
--resolver-delay seconds: a resolver across the internet) that sends each weight file to a
signed CDN link (nginx). The checkpoint is bench/object_store_bench.py's (generated once under
--data). Contenders, each run in a fresh process, the order rotating every round:
  raw curl (CDN links)         the limit: one curl, 8 ranged GETs of 32 MiB in flight, of every
                               file's CDN link straight to /dev/null (wall time; its RSS is
                               ru_maxrss, which includes the parent's at fork)
  hf_hub_download + load_file  what a user does today: huggingface_hub's hf_hub_download of the
                               index and every shard into a fresh cache folder (HF_ENDPOINT at the
                               hub; its Xet path off: the hub serves plain HTTP), then
                               safetensors.torch.load_file of each (the folder is removed after)
  tensorferry Loader           tensorferry.Loader(<hub>/<repo>/resolve/main).load(): straight
                               from the hub into memory, nothing written to disk
  tensorferry CLI --budget     `tensorferry load URL --budget 256M --json` (streaming, bounded)
  tensorferry CLI hf://        the same for `hf://<repo>` with HF_ENDPOINT at the hub and an empty
                               hub cache: the branch pinned to its commit (one API request), then
                               the same reads, the files kept in the hub cache as they stream
                               (object_hub_cache, the default); then "next start": the same
                               command again, reading that cache (the cache is emptied after)
  ... --object-hub-cache 0     the same streamed, nothing kept
  CLI before                   (with --cli-before PATH) another build of the CLI, the same way
Timed inside each child, opening included (imports and process start excluded; the CLIs:
open_seconds + wall_seconds - checksum_seconds, i.e. Loader::Open's index and shard-header reads
included as the Loader's and hf_hub_download's clocks include them, and the CRC32C pass its
checksum comparison needs left out as the others' CRCs are; curl: its process's wall time);
peak RSS is the child's VmHWM (the CLIs' own `peak_rss_bytes`); "resolver" is the requests the
hub's resolver (and its API) answered during the run.
Every load's tensors are compared (CRC32 of each tensor's bytes; the CLIs: their checksum against
each other) with the first run's.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def crcs(tensors):
    import torch
    return {name: zlib.crc32(t.reshape(-1).view(torch.uint8).numpy())
            for name, t in tensors.items()}


def child(spec):
    import torch  # noqa: F401  (imported before the clock for every contender)
    kind = spec["kind"]
    if kind == "hf":
        os.environ.update(HF_ENDPOINT=spec["endpoint"], HF_HUB_CACHE=spec["cache"],
                          HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        import huggingface_hub
        import safetensors.torch
        t0 = time.perf_counter()
        index = huggingface_hub.hf_hub_download(spec["repo"], "model.safetensors.index.json")
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        tensors = {}
        for name in files:
            path = huggingface_hub.hf_hub_download(spec["repo"], name)
            tensors.update(safetensors.torch.load_file(path))
        seconds = time.perf_counter() - t0
    else:
        import tensorferry
        t0 = time.perf_counter()
        with tensorferry.Loader(spec["url"]) as loader:
            tensors = loader.load()
        seconds = time.perf_counter() - t0
    # VmHWM, not ru_maxrss: that keeps the peak of the process before exec, i.e. of the parent
    # it was forked from (a Python that imported torch), which would hide the child's figure.
    from model_bench import _hwm
    print(json.dumps({"seconds": seconds, "crc": crcs(tensors), "peak_rss_bytes": _hwm()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2GB")
    ap.add_argument("--data", default="/var/tmp/tf-objstore-bench")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--resolver-delay", type=float, default=0.03)
    ap.add_argument("--cli-before", help="another tensorferry CLI to run the same way")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))

    import object_store_bench as osb
    from hub_server import ModelHub
    print("load before:", osb.uptime(), flush=True)
    cli = osb.find_cli(None)
    ckpt = osb.make_checkpoint(cli, osb.parse_size(args.size), args.data)
    total = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
                if f.endswith(".safetensors"))
    repo = "bench/" + os.path.basename(ckpt)
    work = tempfile.mkdtemp(prefix="tf-hub-bench-", dir="/var/tmp")
    with ModelHub(delay_s=args.resolver_delay) as hub:
        hub.add_repo(repo, ckpt)
        url = hub.repo_url(repo)
        me = [sys.executable, os.path.abspath(__file__), "--child"]
        contenders = [
            ("hf_hub_download + load_file",
             me + [json.dumps({"kind": "hf", "endpoint": hub.endpoint, "repo": repo,
                               "cache": os.path.join(work, "hf-cache")})]),
            ("tensorferry Loader", me + [json.dumps({"kind": "tf", "url": url})]),
            ("tensorferry CLI --budget 256M", [cli, "load", url, "--budget", "256M", "--json"]),
            ("tensorferry CLI hf:// --budget 256M",
             [cli, "load", f"hf://{repo}", "--budget", "256M", "--json"]),
            ("... --object-hub-cache 0",
             [cli, "load", f"hf://{repo}", "--budget", "256M", "--object-hub-cache", "0",
              "--json"]),
        ]
        next_start = "  next start (hub cache)"
        # hf:// contenders: the hub as HF_ENDPOINT, an empty hub cache.
        hf_env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": os.path.join(work, "empty-cache")}
        # The raw limit: the CDN links themselves, 8 ranged GETs of 32 MiB in flight (the
        # transport the CLI chooses for a store on this host), to /dev/null, by one curl.
        config = os.path.join(work, "curl.cfg")
        transfers = []
        for name in sorted(os.listdir(ckpt)):
            if not name.endswith(".safetensors"):
                continue
            size = os.path.getsize(os.path.join(ckpt, name))
            link = hub.link(hub._files[(repo, hub.commit, name)][1])
            for first in range(0, size, 32 << 20):
                last = min(size, first + (32 << 20)) - 1
                transfers.append(f'url = "{link}"\nrange = "{first}-{last}"\n'
                                 'output = "/dev/null"\nfail\n')
        with open(config, "w") as f:
            f.write("next\n".join(transfers))  # "next" between transfers, not after the last
        contenders.insert(0, ("raw curl (CDN links, 8 x 32 MiB)",
                              ["curl", "-sS", "--fail", "-Z", "--parallel-max", "8", "-K", config]))
        if args.cli_before:
            contenders.append(("CLI before --budget 256M",
                               [args.cli_before, "load", url, "--budget", "256M", "--json"]))
        results = {label: [] for label, _ in contenders}
        results[next_start] = []
        want_crc, want_checksum = None, None
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        for i in range(args.repeats):
            shift = i % len(contenders)
            order = contenders[shift:] + contenders[:shift]
            # The hub cache the kept hf:// load filled, read by the same command next.
            at = [label for label, _ in order].index("tensorferry CLI hf:// --budget 256M")
            order.insert(at + 1, (next_start, order[at][1]))
            for label, argv in order:
                hub.reset_counts()
                hf_path = any(a.startswith("hf://") for a in argv)
                r = osb.run_measured(argv, env=dict(env, **hf_env) if hf_path else env,
                                     timeout=1800)
                shutil.rmtree(os.path.join(work, "hf-cache"), ignore_errors=True)
                if label != "tensorferry CLI hf:// --budget 256M":
                    shutil.rmtree(hf_env["HF_HUB_CACHE"], ignore_errors=True)
                if r["rc"] != 0:
                    sys.exit(f"{label}: exit {r['rc']}: {r['stderr'][-2000:]}")
                if argv[0] == "curl":
                    out = {"seconds": r["wall"], "peak_rss_bytes": r["peak_rss"]}
                else:
                    out = json.loads([ln for ln in r["stdout"].splitlines() if ln.strip()][-1])
                    if "wall_seconds" in out:  # a CLI's `load --json`: its whole load, open too
                        out["seconds"] = osb.cli_seconds(out)
                if argv[0] == "curl":
                    pass  # bytes to nowhere: nothing to compare
                elif "crc" in out:
                    want_crc = out["crc"] if want_crc is None else want_crc
                    if out["crc"] != want_crc:
                        sys.exit(f"{label}: tensors differ from the first load's")
                else:
                    want_checksum = out["checksum"] if want_checksum is None else want_checksum
                    if out["checksum"] != want_checksum:
                        sys.exit(f"{label}: checksum {out['checksum']} != {want_checksum}")
                resolver = sum(hub.resolves.values()) + hub.api_count()
                row = {"seconds": out["seconds"], "gb_per_s": total / out["seconds"] / 1e9,
                       "peak_rss_mib": out["peak_rss_bytes"] / (1 << 20), "resolver": resolver,
                       "requests": out.get("remote_requests")}
                results[label].append(row)
                print(f"round {i + 1} {label:30s} {row['seconds']:7.2f} s {row['gb_per_s']:6.2f} "
                      f"GB/s  peak RSS {row['peak_rss_mib']:7.0f} MiB  resolver {resolver}",
                      flush=True)
    shutil.rmtree(work, ignore_errors=True)
    files = len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")])
    print(f"\n{total / 1e9:.2f} GB in {files} files, resolver delay "
          f"{args.resolver_delay * 1000:.0f} ms, medians of {args.repeats}:")
    print(f"{'contender':32s} {'s':>7s} {'GB/s':>6s} {'peak RSS MiB':>12s} {'resolver':>8s}")
    summary = {}
    for label, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows)
               for k in ("seconds", "gb_per_s", "peak_rss_mib", "resolver")}
        summary[label] = {"median": med, "runs": rows}
        print(f"{label:32s} {med['seconds']:7.2f} {med['gb_per_s']:6.2f} "
              f"{med['peak_rss_mib']:12.0f} {med['resolver']:8.0f}")
    print("load after:", osb.uptime())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": total, "resolver_delay_s": args.resolver_delay,
                       "results": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

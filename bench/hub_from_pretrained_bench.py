#!/usr/bin/env python3
"""transformers' from_pretrained of a model named by its hub id, not cached yet: transformers alone
(it downloads every file into the hub cache, then loads), inside tensorferry.transformers.loading()
(the id read as its hf:// path: streamed from the hub while kept in the hub cache), and
loading(hub="download") (transformers' download, then tensorferry's reads).

    .venv/bin/python bench/hub_from_pretrained_bench.py                  # 2 GB Llama, 3 rounds
    .venv/bin/python bench/hub_from_pretrained_bench.py --size 64MB --repeats 1

The checkpoint: bench/object_store_bench.py's `tensorferry gen` Llama layout (reused under --data)
with a config.json matching it (bench/model_bench.py's config_of), published as bench/model on
the loopback hub of tests/python/hub_server.py (HF_ENDPOINT; --resolver-delay per answer, nginx as
the CDN). Each run: a fresh process, an empty hub cache (HF_HUB_CACHE), from_pretrained(
"bench/model", dtype=bfloat16) then one read of every parameter, timed from before the call
(imports excluded); peak RSS of the process; a checksum of every parameter, which must agree.
Contenders alternate, the order rotating every round; medians.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

REPO = "bench/model"
MODES = ["transformers", "tensorferry loading()", "tensorferry loading(hub=\"download\")"]

CHILD = r'''
import hashlib, json, resource, sys, time
import torch, transformers
mode = sys.argv[1]
t0 = time.perf_counter()
if mode == "transformers":
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16)
else:
    import tensorferry.transformers as tft
    with tft.loading(hub="download" if "download" in mode else "stream"):
        model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2],
                                                                  dtype=torch.bfloat16)
digest = hashlib.sha256()
for name, p in sorted(model.named_parameters()):
    digest.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
seconds = time.perf_counter() - t0
print("RESULT " + json.dumps({"seconds": seconds, "digest": digest.hexdigest(),
      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2GB", help="checkpoint size (default 2GB)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--resolver-delay", type=float, default=0.03,
                    help="seconds the hub waits before each answer (default 0.03)")
    ap.add_argument("--data", default="/var/tmp/tf-objstore-bench",
                    help="where the checkpoint lives")
    ap.add_argument("--cli", default=None, help="the tensorferry CLI (default: build/release)")
    args = ap.parse_args()

    from hub_server import ModelHub
    from model_bench import config_of
    from object_store_bench import find_cli, make_checkpoint, parse_size, uptime
    load_before = uptime()
    ckpt = make_checkpoint(find_cli(args.cli), parse_size(args.size), args.data)
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        config = config_of(ckpt)
        config.dtype = "bfloat16"
        config.save_pretrained(ckpt)
    nbytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
                 if f.endswith(".safetensors"))
    print(f"# {ckpt}: {nbytes / 1e9:.2f} GB; load {load_before}", flush=True)
    work = tempfile.mkdtemp(prefix="hub-fp-bench-", dir=args.data)
    cache = os.path.join(work, "hub-cache")
    rows = {m: [] for m in MODES}
    with ModelHub(delay_s=args.resolver_delay) as hub:
        hub.add_repo(REPO, ckpt)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("HF_", "TRANSFORMERS_OFFLINE", "TENSORFERRY_"))}
        env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=cache, HF_HUB_DISABLE_XET="1",
                   TOKENIZERS_PARALLELISM="false")
        for r in range(args.repeats):
            for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                shutil.rmtree(cache, ignore_errors=True)
                os.sync()
                time.sleep(1)
                p = subprocess.run([sys.executable, "-c", CHILD, mode, REPO], env=env,
                                   capture_output=True, text=True, timeout=1800)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                if p.returncode != 0 or not lines:
                    print(f"round {r + 1}: {mode}: FAILED\n{p.stderr[-3000:]}", flush=True)
                    continue
                out = json.loads(lines[-1][len("RESULT "):])
                rows[mode].append(out)
                print(f"round {r + 1}: {mode:40s} {out['seconds']:6.2f} s, peak RSS "
                      f"{out['peak_rss_mib']:.0f} MiB", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    digests = {x["digest"] for rs in rows.values() for x in rs}
    base = statistics.median(x["seconds"] for x in rows[MODES[0]]) if rows[MODES[0]] else None
    print(f"\n{'contender':40s} {'s (median)':>10s} {'vs transformers':>16s} {'peak RSS':>10s}")
    for mode, rs in rows.items():
        if not rs:
            continue
        s = statistics.median(x["seconds"] for x in rs)
        ratio = f"{base / s:.2f}x" if base else ""
        print(f"{mode:40s} {s:10.2f} {ratio:>16s} "
              f"{statistics.median(x['peak_rss_mib'] for x in rs):8.0f} MiB   runs "
              f"{[round(x['seconds'], 2) for x in rs]}")
    print(f"\nparameters identical across contenders: {len(digests) == 1}")
    print(f"load before {load_before}; after {uptime()}")
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())

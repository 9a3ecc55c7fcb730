#!/usr/bin/env python3
"""vLLM loading a model whose weights are in S3 (SeaweedFS on loopback): vLLM's own object-storage
path (`--model s3://... --load-format runai_streamer`, runai-model-streamer) against the tensorferry
plugin (`--load-format tensorferry`, `{"weights": "s3://..."}`), same server, same run; vLLM's
default loader over a local copy of the same files as the reference.

    .venv/bin/python bench/vllm_object_store_bench.py                  # 2 GB checkpoint, 3 rounds
    .venv/bin/python bench/vllm_object_store_bench.py --size 64MB --repeats 1 --json /tmp/v.json

What it does:
  1. the checkpoint: `tensorferry gen` (bench/object_store_bench.py's Llama layout, reused under
     --data) and a config.json matching it (bench/model_bench.py's config_of), in a folder of its
     own (the tensorferry plugin's --model) and beside the weights in the bucket (what vLLM pulls
     for an s3:// --model);
  2. SeaweedFS (tests/python/objstore_servers.py), the checkpoint uploaded to
     s3://tensorferry/<name>/;
  3. --repeats rounds, the contenders alternating (the order rotates every round), each in a fresh
     process of .venv-vllm's Python (the real vLLM of requirements-vllm.txt, its CPU platform, the
     tensorferry package of .venv on PYTHONPATH as in tests/python/test_vllm.py): vLLM's
     `get_model_loader(...).load_model(...)`, timed (building the model's parameters and filling
     them: what a worker does before it serves), and its load_weights part on its own (the
     weights read and fed to the model: what differs between loaders); every parameter's bytes
     are hashed afterwards (untimed) and must be the same for every contender;
  4. a table of medians and a JSON file (--json), with the machine's load before and after.

The contenders: "vLLM runai_streamer (s3)", "tensorferry plugin (s3)" (its defaults: checksums
embedded by `tensorferry gen` are checked), "tensorferry plugin (s3; verify off)", and the
reference "vLLM default loader (local; warm)". vLLM's model is never run (its PyPI wheel has no
CPU kernels: docs/models.md).

With --hub, the model is served by its hub id from a model hub on loopback instead
(tests/python/hub_server.py as HF_ENDPOINT, --resolver-delay per answer), each run with an empty
hub cache (what a server's first start does when the model is not cached yet): "vLLM default
loader (hub id)" (vLLM's download of the weights into the hub cache, then its load),
"tensorferry plugin (hub id)" (the `hub` option's default: streamed as hf://<id> while kept in
the hub cache), "tensorferry plugin (hub id; nothing kept)" (streamed, object_hub_cache off),
"tensorferry plugin (hub id; hub=download)" (vLLM's download, then tensorferry's load), and the
reference "vLLM default loader (local; warm)". The timed part includes each loader's download.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VLLM_PYTHON = os.environ.get("TENSORFERRY_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin",
                                                                         "python")
CONTENDERS = ["vLLM runai_streamer (s3)", "tensorferry plugin (s3)",
              "tensorferry plugin (s3; verify off)", "vLLM default loader (local; warm)"]
HUB_CONTENDERS = ["vLLM default loader (hub id)", "tensorferry plugin (hub id)",
                  "tensorferry plugin (hub id; nothing kept)",
                  "tensorferry plugin (hub id; hub=download)", "vLLM default loader (local; warm)"]
HUB_REPO = "bench/model"


# --- the child: one load in .venv-vllm ------------------------------------------------------------


def child(spec):
    import hashlib

    import torch
    import vllm_scenarios as vs
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    vs.without_missing_cpu_kernels()
    vs.init_distributed(spec["config_dir"], 0, 1, spec["port"])
    config = vs.vllm_config(spec["model"], spec["load_format"], spec.get("extra"))
    with set_current_vllm_config(config):
        loader = get_model_loader(config.load_config)
        # The weights' part of load_model, timed on its own (load_model also builds the model).
        weights = [0.0]
        load_weights = loader.load_weights

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return load_weights(*a, **kw)
            finally:
                weights[0] += time.perf_counter() - t0
        loader.load_weights = timed
        start = time.perf_counter()
        model = loader.load_model(vllm_config=config, model_config=config.model_config)
        seconds = time.perf_counter() - start
    digest = hashlib.sha256()
    nbytes = 0
    for name, p in sorted(model.named_parameters()):
        raw = p.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest.update(name.encode())
        digest.update(raw.tobytes())
        nbytes += raw.size
    out = {"seconds": weights[0], "load_model_seconds": seconds, "param_bytes": nbytes,
           "digest": digest.hexdigest()}
    stats = getattr(loader, "stats", None)
    if isinstance(stats, dict):
        out["stats"] = stats
    return out


# --- the parent ----------------------------------------------------------------------------------


def overlay(work):
    """A PYTHONPATH folder with the tensorferry package of .venv and its entry points, for
    .venv-vllm (tests/python/test_vllm.py's _overlay)."""
    import pathlib

    from test_vllm import _overlay

    class Factory:
        def mktemp(self, name):
            path = pathlib.Path(tempfile.mkdtemp(prefix=name + "-", dir=work))
            return path

    return _overlay(Factory())[0]


def measured(argv, env, timeout=1800):
    from object_store_bench import run_measured
    return run_measured(argv, env=env, timeout=timeout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2GB", help="checkpoint size (default 2GB)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--data", default="/var/tmp/tf-objstore-bench",
                    help="where the checkpoint and the server's data live")
    ap.add_argument("--cli", default=None, help="the tensorferry CLI (default: build/release)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--contenders", default=None,
                    help="comma-separated subset of: " + ", ".join(CONTENDERS) + " (with --hub: "
                    + ", ".join(HUB_CONTENDERS) + ")")
    ap.add_argument("--hub", action="store_true",
                    help="serve the model by its hub id from a model hub on loopback")
    ap.add_argument("--resolver-delay", type=float, default=0.03,
                    help="with --hub: seconds the hub waits before each answer (default 0.03)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child(json.loads(args.child))
        print("\nRESULT " + json.dumps(result), flush=True)
        os._exit(0)  # vLLM's distributed state has no clean shutdown

    from model_bench import config_of
    from object_store_bench import find_cli, make_checkpoint, parse_size, uptime
    from objstore_servers import SeaweedS3
    from test_vllm import _env

    if not os.path.exists(VLLM_PYTHON):
        sys.exit(f"{VLLM_PYTHON} is missing: run scripts/install_vllm.sh")
    known = HUB_CONTENDERS if args.hub else CONTENDERS
    chosen = [c.strip() for c in (args.contenders or ",".join(known)).split(",") if c.strip()]
    unknown = [c for c in chosen if c not in known]
    if unknown:
        sys.exit(f"unknown contenders {unknown}; known: {known}")
    load_before = uptime()
    size = parse_size(args.size)
    ckpt = make_checkpoint(find_cli(args.cli), size, args.data)
    config_dir = ckpt + "-config"
    if not os.path.exists(os.path.join(config_dir, "config.json")):
        config = config_of(ckpt)
        config.dtype = "bfloat16"
        config.save_pretrained(config_dir)
    work = tempfile.mkdtemp(prefix="vllm-bench-", dir=args.data)
    path = overlay(work)
    files = sorted(f for f in os.listdir(ckpt) if not f.startswith("."))
    tensor_bytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in files
                       if f.endswith(".safetensors"))
    name = os.path.basename(ckpt)
    print(f"# {ckpt}: {tensor_bytes / 1e9:.2f} GB of safetensors; load {load_before}", flush=True)

    # The reference and the hub read the local files: config.json beside them.
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        os.link(os.path.join(config_dir, "config.json"), os.path.join(ckpt, "config.json"))
    if args.hub:
        rows, digests = run_hub(args, ckpt, config_dir, path, work, chosen, tensor_bytes)
        return report(args, ckpt, tensor_bytes, rows, digests, load_before)

    with SeaweedS3(parent_dir=args.data) as server:
        bucket = server.BUCKET
        for f in files:
            server.upload(bucket, f"{name}/{f}", os.path.join(ckpt, f))
        server.upload(bucket, f"{name}/config.json", os.path.join(config_dir, "config.json"))
        url = server.url(name)
        env = _env(path)
        env.update(server.env(), RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
                   VLLM_LOGGING_LEVEL="ERROR")
        env.pop("TENSORFERRY_VERIFY", None)
        specs = {
            "vLLM runai_streamer (s3)": dict(model=url, load_format="runai_streamer"),
            "tensorferry plugin (s3)": dict(model=config_dir, load_format="tensorferry",
                                            extra={"weights": url}),
            "tensorferry plugin (s3; verify off)": dict(model=config_dir,
                                                        load_format="tensorferry",
                                                        extra={"weights": url}, verify="off"),
            "vLLM default loader (local; warm)": dict(model=ckpt, load_format="safetensors"),
        }
        rows, digests = rounds(args, chosen, specs, config_dir, tensor_bytes,
                               lambda c: dict(env))
    return report(args, ckpt, tensor_bytes, rows, digests, load_before)


def rounds(args, chosen, specs, config_dir, tensor_bytes, env_of):
    """--repeats rounds of `chosen`, alternating, each in a child process: (rows, digests)."""
    from objstore_servers import free_port
    rows = {c: [] for c in chosen}
    digests = {}
    for r in range(args.repeats):
        order = chosen[r % len(chosen):] + chosen[:r % len(chosen)]
        for c in order:
            spec = dict(specs[c], config_dir=config_dir, port=free_port())
            child_env = env_of(c)
            if spec.pop("verify", None) == "off":
                child_env["TENSORFERRY_VERIFY"] = "off"
            argv = [VLLM_PYTHON, os.path.abspath(__file__), "--child", json.dumps(spec)]
            m = measured(argv, child_env)
            lines = [ln for ln in m["stdout"].splitlines() if ln.startswith("RESULT ")]
            if m["rc"] != 0 or not lines:
                print(f"round {r + 1}: {c}: FAILED (exit {m['rc']})\n{m['stderr'][-2000:]}"
                      f"\n{m['stdout'][-2000:]}", flush=True)
                continue
            res = json.loads(lines[-1][len("RESULT "):])
            res["peak_rss"] = m["peak_rss"]
            rows[c].append(res)
            digests.setdefault(res["digest"], []).append(c)
            print(f"round {r + 1}: {c}: load_weights {res['seconds']:.2f} s "
                  f"({tensor_bytes / 1e9 / res['seconds']:.2f} GB/s), load_model "
                  f"{res['load_model_seconds']:.2f} s, peak RSS "
                  f"{res['peak_rss'] / 2**20:.0f} MiB", flush=True)
    return rows, digests


def run_hub(args, ckpt, config_dir, path, work, chosen, tensor_bytes):
    """The --hub contenders: the checkpoint (and its config.json) published as HUB_REPO on a
    model hub on loopback; each run with an empty hub cache."""
    import shutil

    from hub_server import ModelHub
    from test_vllm import _env
    specs = {
        "vLLM default loader (hub id)": dict(model=HUB_REPO, load_format="safetensors"),
        "tensorferry plugin (hub id)": dict(model=HUB_REPO, load_format="tensorferry"),
        "tensorferry plugin (hub id; nothing kept)": dict(
            model=HUB_REPO, load_format="tensorferry",
            extra={"storage_options": {"object_hub_cache": False}}),
        "tensorferry plugin (hub id; hub=download)": dict(model=HUB_REPO,
                                                          load_format="tensorferry",
                                                          extra={"hub": "download"}),
        "vLLM default loader (local; warm)": dict(model=ckpt, load_format="safetensors"),
    }
    cache = os.path.join(work, "hub-cache")
    with ModelHub(delay_s=args.resolver_delay) as hub:
        hub.add_repo(HUB_REPO, ckpt)
        env = _env(path)
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TENSORFERRY_VERIFY"):
            env.pop(name, None)
        env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=cache, VLLM_LOGGING_LEVEL="ERROR",
                   HF_HUB_DISABLE_XET="1")

        def env_of(contender):
            shutil.rmtree(cache, ignore_errors=True)
            os.sync()
            return dict(env)
        rows, digests = rounds(args, chosen, specs, config_dir, tensor_bytes, env_of)
    shutil.rmtree(cache, ignore_errors=True)
    return rows, digests


def report(args, ckpt, tensor_bytes, rows, digests, load_before):
    from object_store_bench import uptime
    same = len(digests) == 1
    summary = {}
    for c, rs in rows.items():
        if not rs:
            continue
        secs = statistics.median(x["seconds"] for x in rs)
        summary[c] = {"seconds": secs, "runs": [x["seconds"] for x in rs],
                      "load_model_seconds": statistics.median(x["load_model_seconds"]
                                                              for x in rs),
                      "gbps": tensor_bytes / 1e9 / secs,
                      "peak_rss_mib": statistics.median(x["peak_rss"] for x in rs) / 2**20}
    base_name = "vLLM default loader (hub id)" if args.hub else "vLLM runai_streamer (s3)"
    base = summary.get(base_name, {}).get("seconds")
    print(f"\n{'contender':42} {'load_weights s':>14} {'GB/s':>6} {'vs ' + base_name[:6]:>9} "
          f"{'load_model s':>12} {'peak RSS':>10}")
    for c, s in summary.items():
        ratio = f"{base / s['seconds']:.2f}x" if base else ""
        print(f"{c:42} {s['seconds']:14.2f} {s['gbps']:6.2f} {ratio:>9} "
              f"{s['load_model_seconds']:12.2f} {s['peak_rss_mib']:8.0f} MiB")
    print(f"\nparameters identical across contenders: {same}"
          + ("" if same else f" ({digests})"))
    load_after = uptime()
    print(f"load before {load_before}; after {load_after}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"checkpoint": ckpt, "tensor_bytes": tensor_bytes, "rows": rows,
                       "summary": summary, "identical": same, "load_before": load_before,
                       "load_after": load_after}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

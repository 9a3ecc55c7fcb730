#!/usr/bin/env python3
"""gs:// against s3:// on the same server: what Google Cloud Storage's credentials cost a load.

    .venv/bin/python bench/gcs_bench.py                        # 2 GB checkpoint, 5 rounds
    .venv/bin/python bench/gcs_bench.py --size 64MB --repeats 1

GCS itself cannot be reached from the test machines, so the store is SeaweedFS on loopback (the
checkpoint of bench/object_store_bench.py, generated once under --data) and the contenders differ
only in how they name and sign the objects:
  s3 SigV4             s3://BUCKET/...  with the admin keys (Signature V4), straight to SeaweedFS
  gs HMAC              gs://BUCKET/...  with the same keys as GCS HMAC keys, straight to SeaweedFS
  s3 SigV4 via proxy   s3:// through tests/python/fault_proxy.py (no rules): the proxy's own cost
  gs token via proxy   gs:// of the public bucket with an OAuth token from a metadata server (a
                       loopback one of this script), through the proxy's bearer gate
Each round runs every contender once in a fresh process (the order rotating), timing
tensorferry.Loader(url).load() inside the child (imports and process start excluded); the table
has the median GB/s and the requests each made. Every load's tensors are compared (CRC32 of all
bytes) with the first contender's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def child(spec):
    """Runs in the child process: one load, its time, requests and CRC32."""
    import torch

    import tensorferry
    for k, v in spec.get("env", {}).items():
        os.environ[k] = v
    t0 = time.perf_counter()
    with tensorferry.Loader(spec["url"], storage_options=spec["options"]) as loader:
        tensors = loader.load()
        stats = loader.stats
    seconds = time.perf_counter() - t0
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].reshape(-1).view(torch.uint8).numpy(), crc)
    print(json.dumps({"seconds": seconds, "requests": stats.remote_requests,
                      "crc32": crc}))


class MetadataServer:
    """The metadata server's token URL on loopback: one token, valid for an hour."""

    TOKEN = "ya29.bench-token"

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                body = json.dumps({"access_token": MetadataServer.TOKEN, "expires_in": 3600,
                                   "token_type": "Bearer"}).encode()
                self.send_response(200 if self.headers.get("Metadata-Flavor") == "Google"
                                   else 403)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.host = f"127.0.0.1:{self.httpd.server_port}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="2GB")
    ap.add_argument("--data", default="/var/tmp/tf-objstore-bench")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))

    import object_store_bench as osb
    from fault_proxy import FaultProxy
    from objstore_servers import SeaweedS3
    print("load before:", os.getloadavg(), flush=True)
    cli = os.environ.get("TENSORFERRY_CLI") or os.path.join(ROOT, "build", "release", "bin",
                                                            "tensorferry")
    ckpt = osb.make_checkpoint(cli, osb.parse_size(args.size), args.data)
    total = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
                if f.endswith(".safetensors"))
    name = os.path.basename(ckpt)
    with SeaweedS3(parent_dir="/var/tmp") as s3:
        for bucket in (s3.BUCKET, s3.PUBLIC_BUCKET):
            s3.upload_dir(bucket, name, ckpt)
        meta = MetadataServer()
        host, port = s3.endpoint[len("http://"):].rsplit(":", 1)
        with FaultProxy(host, int(port)) as plain, \
                FaultProxy(host, int(port), bearer=lambda t: t == MetadataServer.TOKEN) as gate:
            keys = {"s3_access_key_id": s3.ADMIN_KEY[0], "s3_secret_access_key": s3.ADMIN_KEY[1],
                    "s3_region": s3.REGION}
            contenders = [
                ("s3 SigV4", {"url": f"s3://{s3.BUCKET}/{name}/",
                              "options": {"s3_endpoint": s3.endpoint, **keys}}),
                ("gs HMAC", {"url": f"gs://{s3.BUCKET}/{name}/",
                             "options": {"s3_endpoint": s3.endpoint, **keys}}),
                ("s3 SigV4 via proxy", {"url": f"s3://{s3.BUCKET}/{name}/",
                                        "options": {"s3_endpoint": plain.url, **keys}}),
                ("gs token via proxy", {"url": f"gs://{s3.PUBLIC_BUCKET}/{name}/",
                                        "options": {"s3_endpoint": gate.url},
                                        "env": {"GCE_METADATA_HOST": meta.host}}),
            ]
            results = {c: [] for c, _ in contenders}
            want = None
            for i in range(args.repeats):
                shift = i % len(contenders)
                for label, spec in contenders[shift:] + contenders[:shift]:
                    env = {k: v for k, v in os.environ.items()
                           if not k.startswith(("AWS_", "GOOGLE_", "GCE_"))}
                    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                        json.dumps(spec)], capture_output=True, text=True,
                                       env=env, timeout=600)
                    if r.returncode != 0:
                        sys.exit(f"{label}: {r.stderr.strip()[-2000:]}")
                    out = json.loads(r.stdout.strip().splitlines()[-1])
                    want = out["crc32"] if want is None else want
                    if out["crc32"] != want:
                        sys.exit(f"{label}: CRC32 {out['crc32']:#x} != {want:#x}")
                    out["gb_per_s"] = total / out["seconds"] / 1e9
                    results[label].append(out)
                    print(f"round {i + 1} {label:20s} {out['gb_per_s']:6.2f} GB/s "
                          f"({out['requests']} requests)", flush=True)
            assert gate.stats()["unauthorized"] == 0
    print(f"\n{total / 1e9:.2f} GB in {name}, medians of {args.repeats}:")
    report = {"bytes": total, "checkpoint": ckpt, "repeats": args.repeats, "contenders": {}}
    for label, runs in results.items():
        gbps = statistics.median(r["gb_per_s"] for r in runs)
        requests = statistics.median(r["requests"] for r in runs)
        report["contenders"][label] = {"gb_per_s": gbps, "requests": requests,
                                       "runs": [r["gb_per_s"] for r in runs]}
        print(f"| {label} | {gbps:.2f} GB/s | {requests:.0f} requests |")
    print("load after:", os.getloadavg(), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

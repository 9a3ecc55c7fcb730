#!/usr/bin/env python3
"""Loading a checkpoint from S3 (SeaweedFS on loopback): tensorferry against the best raw ranged-GET
throughput, runai-model-streamer's S3 path, and boto3 download + safetensors.torch.load_file, all
pointed at the same server in the same run (the Targets of issue 13).

    .venv/bin/python bench/object_store_bench.py                      # 2 GB checkpoint, 3 repeats
    .venv/bin/python bench/object_store_bench.py --size 64MB --repeats 1 --json /tmp/os.json

What it does, in order:
  1. machine load (uptime) and the checkpoint: a synthetic Llama-layout checkpoint of at least
     --size, sharded with an index, written once by `tensorferry gen` under --data (reused after);
  2. SeaweedFS (`weed mini`, tests/python/objstore_servers.py) with its data under /var/tmp, and
     the checkpoint uploaded to s3://tensorferry/<name>/;
  3. the raw limit: parallel ranged GETs of every object to nowhere, by curl (one process, libcurl's
     multi interface, `--aws-sigv4`) and by a Python pool of http.client connections, over a grid of
     concurrencies and part sizes; the best of all is "best raw ranged-GET throughput";
  4. --repeats rounds, the contenders alternating (the order rotates every round): raw (its best
     setting), boto3 + safetensors, runai-model-streamer, tensorferry CLI, tensorferry Python
     (Loader.load, load_file per shard); medians are reported;
  5. tensorferry with --budget 256M (streaming), and tensor parallelism world 4: each rank's bytes
     transferred (from `tensorferry load --json`) against its exact share (a local load of the same
     rank with --max-gap 0), and the same world cooperatively (tensorferry-mpi --mode cooperative
     under mpirun, the ranks splitting the reads); then a load through tests/python/fault_proxy.py resetting 1 response
     in 20 mid-body, whose checksum must match a clean load's; then the local cache
     (--object-cache-dir): first start, later starts with the copies in the page cache and on
     cold disk, against a streaming load and a cold load of the local checkpoint;
  6. with the contender "from_pretrained": transformers' from_pretrained of the checkpoint (a
     config.json matching it is written beside it) as a user does it today (boto3 downloads every
     object, then from_pretrained of the folder) and from the bucket's URL inside
     tensorferry.transformers.loading(); both touch every parameter page and report a CRC32 of
     the parameters, which must agree;
  7. a table, a JSON file (--json), machine load again.

Every contender runs in a subprocess of its own; its peak RSS is the child's ru_maxrss (os.wait4).
GB/s is checkpoint bytes (1e9) over the load time, measured one of two ways (the table's "timed"
column and the JSON's "timing" say which, TIMING below what each means):
  in-proc  inside the process, from before the open (the index GET and one GET per shard header:
           the CLI's open_seconds, a Python loader's constructor) to the last tensor in memory;
           process start and imports excluded. The CLI: open_seconds + wall_seconds (less
           checksum_seconds, its CRC32C pass, where it checksums: no other contender hashes).
           Every contender but curl;
  process  the process's wall time, seen from the parent: curl (nothing to time inside it; its
           start, a few ms, is included). The local cache's table is all process wall time too.
The tensorferry contenders run only if they work: a failure is reported (its stderr tail) and the
other contenders go on.
"""
import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

MB = 1000 * 1000
MiB = 1 << 20
BUDGET = "256M"
RSS_SLACK = 64 * MiB
TP_WORLD = 4
# How a contender's time is measured (the module's docstring says more).
TIMING = {"in-proc": "inside the process, open included (the CLI: open_seconds + wall_seconds "
                     "- checksum_seconds); process start and imports excluded",
          "process": "the whole process's wall time, from the parent (curl)"}


def parse_size(text):
    """'2GB', '64MB', '256M', '8MiB', '1000' -> bytes, as the CLI reads a size: K, M, G, T, P, E
    (with or without B) decimal (256M = 256,000,000), KiB, MiB, ... (or Ki, Mi, ...) binary."""
    t = str(text).strip().upper().replace(" ", "")
    number = t.rstrip("KMGTPEIB")
    suffix = t[len(number):]
    base, power = 1, 0
    if suffix not in ("", "B"):
        power = "KMGTPE".find(suffix[0]) + 1
        rest = suffix[1:]
        binary = rest.startswith("I")
        rest = rest[1:] if binary else rest
        if not power or rest not in ("", "B"):
            raise ValueError(f"cannot read the size {text!r}")
        base = 1024 if binary else 1000
    if "." in number:
        return round(float(number) * base ** power)
    return int(number) * base ** power


BUDGET_BYTES = parse_size(BUDGET)  # the budget the CLI is given, read as it reads it


def cli_seconds(stats):
    """The load time of a `tensorferry load --json` document, as a contender that opens as it
    loads is timed: open_seconds (Loader::Open: the index and every shard header; describing the
    selection) + wall_seconds (the load), less checksum_seconds (the CLI's CRC32C pass over the
    tensors, which no peer's clock holds; 0 with --no-checksum). A CLI without open_seconds
    counts 0 for it."""
    return (stats.get("open_seconds", 0.0) + stats["wall_seconds"] -
            stats.get("checksum_seconds", 0.0))


def uptime():
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError as e:
        return f"(uptime: {e})"


def find_cli(arg):
    for path in (arg, os.environ.get("TENSORFERRY_CLI"),
                 os.path.join(ROOT, "build", "release", "bin", "tensorferry"),
                 os.path.join(ROOT, "build", "release", "tools", "tensorferry", "tensorferry")):
        if path and os.access(path, os.X_OK):
            return path
    return None


# --- the checkpoint ---------------------------------------------------------------------------

def _llama_bytes(layers, hidden, inter, heads, kv_heads, vocab):
    """Bytes of a BF16 Llama-layout checkpoint as `tensorferry gen` writes it (untied head)."""
    kv = hidden // heads * kv_heads
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    return 2 * (layers * layer + 2 * vocab * hidden + hidden)


def gen_args(size):
    """`tensorferry gen` options giving at least `size` bytes in a few shards."""
    if size >= 1 << 30:
        dims = dict(hidden=2048, inter=8192, heads=16, kv_heads=4, vocab=32000)
    else:
        dims = dict(hidden=512, inter=2048, heads=8, kv_heads=2, vocab=8000)
    layers = 1
    while _llama_bytes(layers, **dims) < size:
        layers += 1
    shard = max(1 << 20, size // 4)
    return ["--layers", str(layers), "--hidden", str(dims["hidden"]),
            "--intermediate", str(dims["inter"]), "--heads", str(dims["heads"]),
            "--kv-heads", str(dims["kv_heads"]), "--vocab", str(dims["vocab"]),
            "--shard-size", str(shard), "--no-sync"]


def make_checkpoint(cli, size, data_root):
    """The checkpoint directory for `size` under data_root, generated when missing."""
    name = f"llama-{size // MB}MB"
    out = os.path.join(data_root, name)
    marker = os.path.join(out, ".complete")
    if os.path.exists(marker):
        return out
    if cli is None:
        sys.exit("no tensorferry CLI to generate the checkpoint: build it "
                 "(scripts/build.sh release) or set TENSORFERRY_CLI")
    os.makedirs(data_root, exist_ok=True)
    subprocess.run([cli, "gen", out] + gen_args(size), check=True, stdout=subprocess.DEVNULL)
    open(marker, "w").close()
    return out


def checkpoint_files(path):
    return sorted(f for f in os.listdir(path) if not f.startswith("."))


# --- children: one contender, one run; print one JSON line -------------------------------------

def _signed_headers(spec, key, first, last):
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
    req = AWSRequest(method="GET", url=f"{spec['endpoint']}/{spec['bucket']}/{key}",
                     headers={"Range": f"bytes={first}-{last}"})
    S3SigV4Auth(Credentials(spec["access_key"], spec["secret_key"]), "s3",
                spec["region"]).add_auth(req)
    return dict(req.headers.items())


def child_raw_python(spec):
    """Ranged GETs of every part of every object by `concurrency` threads, each with one
    keep-alive http.client connection, read into a reused buffer (the bytes go nowhere)."""
    import http.client
    import threading
    host, port = spec["endpoint"][len("http://"):].rsplit(":", 1)
    part = spec["part_size"]
    tasks = [(k, off, min(off + part, size) - 1) for k, size in spec["objects"]
             for off in range(0, size, part)]
    lock = threading.Lock()
    done = [0]
    errors = []

    def worker():
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        buf = memoryview(bytearray(part))
        while True:
            with lock:
                if not tasks or errors:
                    return
                key, first, last = tasks.pop()
            conn.request("GET", f"/{spec['bucket']}/{key}",
                         headers=_signed_headers(spec, key, first, last))
            r = conn.getresponse()
            if r.status != 206:
                errors.append(f"{key} {first}-{last}: HTTP {r.status} {r.read()[:200]!r}")
                return
            got = 0
            while True:  # the body is at most one part: readinto stops at its end
                n = r.readinto(buf)
                if not n:
                    break
                got += n
            if got != last - first + 1:
                errors.append(f"{key} {first}-{last}: {got} bytes")
                return
            with lock:
                done[0] += got

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(spec["concurrency"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(errors[0])
    return {"seconds": seconds, "bytes": done[0]}


def _boto3_client(spec):
    """A boto3 S3 client of the bench's server (path-style, 32 pooled connections)."""
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=spec["endpoint"], region_name=spec["region"],
                        aws_access_key_id=spec["access_key"],
                        aws_secret_access_key=spec["secret_key"],
                        config=Config(s3={"addressing_style": "path"}, max_pool_connections=32))


def _download_all(s3, spec, folder):
    """boto3 download_file of every object of the checkpoint into `folder` (by base name)."""
    for key, _ in spec["objects"]:
        s3.download_file(spec["bucket"], key, os.path.join(folder, os.path.basename(key)))


def child_boto3(spec):
    """boto3 download_file of every object to a temp dir (on --data's disk), then
    safetensors.torch.load_file of each shard, one byte of every page touched (its tensors map
    the file: without that, nothing would be in memory yet)."""
    import shutil

    import safetensors.torch
    import torch
    s3 = _boto3_client(spec)
    tmp = tempfile.mkdtemp(prefix="tf-os-boto3-", dir=spec["scratch"])
    try:
        start = time.perf_counter()
        _download_all(s3, spec, tmp)
        downloaded = time.perf_counter()
        nbytes = 0
        tensors = []
        for name in sorted(os.listdir(tmp)):
            if name.endswith(".safetensors"):
                loaded = safetensors.torch.load_file(os.path.join(tmp, name))
                for t in loaded.values():  # its tensors map the file lazily: fault every page in
                    if t.numel():
                        int(t.reshape(-1).view(torch.uint8)[::4096].sum())
                    nbytes += t.numel() * t.element_size()
                tensors.append(loaded)
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"seconds": seconds, "download_seconds": downloaded - start, "tensor_bytes": nbytes}


def child_runai(spec):
    """runai-model-streamer's SafetensorsStreamer on the s3:// URLs of the shards (endpoint and
    keys from AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID / ..., path-style addressing)."""
    from runai_model_streamer import SafetensorsStreamer
    urls = [f"s3://{spec['bucket']}/{k}" for k, _ in spec["objects"] if k.endswith(".safetensors")]
    nbytes = 0
    start = time.perf_counter()
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(urls)
        for _, t in streamer.get_tensors():
            nbytes += t.numel() * t.element_size()
    return {"seconds": time.perf_counter() - start, "tensor_bytes": nbytes}


def child_tf_loader(spec):
    """tensorferry.Loader(s3://bucket/prefix/).load()."""
    import torch  # noqa: F401  (the framework its tensors are, imported before the clock as
    # every other contender's: `import tensorferry` does not import torch, Loader.load would)

    import tensorferry
    start = time.perf_counter()
    tensors = tensorferry.Loader(spec["url"]).load()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tensor_bytes": sum(t.numel() * t.element_size()
                                                    for t in tensors.values())}


def child_tf_load_file(spec):
    """tensorferry.torch.load_file(s3://bucket/prefix/<shard>) for every shard."""
    import tensorferry.torch
    nbytes = 0
    keep = []
    start = time.perf_counter()
    for key, _ in spec["objects"]:
        if key.endswith(".safetensors"):
            tensors = tensorferry.torch.load_file(f"s3://{spec['bucket']}/{key}")
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
            keep.append(tensors)
    return {"seconds": time.perf_counter() - start, "tensor_bytes": nbytes}


def _from_pretrained(path, **kwargs):
    """transformers' AutoModelForCausalLM.from_pretrained(path, dtype=bfloat16) (its modules
    imported before), one byte of every page of every parameter touched (a model that maps its
    files is read at first use); (model, the parameters' bytes, CRC32 of all their bytes)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kwargs)
    nbytes = 0
    for p in model.parameters():
        if p.numel():
            int(p.detach().reshape(-1).view(torch.uint8)[::4096].sum())
        nbytes += p.numel() * p.element_size()
    return model, nbytes


def _parameters_crc(model):
    import zlib

    import torch
    crc = 0
    for _, p in sorted(model.state_dict().items()):
        crc = zlib.crc32(p.detach().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def _import_transformers():
    import torch  # noqa: F401
    import transformers
    import transformers.core_model_loading  # noqa: F401  imported before the clock starts
    import transformers.models.llama.modeling_llama  # noqa: F401
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def child_fp_download(spec):
    """What a transformers user does today: boto3 download_file of every object of the model
    (weights, index, config.json) into a temp dir on --data's disk, then from_pretrained of it."""
    import shutil

    _import_transformers()
    s3 = _boto3_client(spec)
    tmp = tempfile.mkdtemp(prefix="tf-os-fp-", dir=spec["scratch"])
    try:
        start = time.perf_counter()
        _download_all(s3, spec, tmp)
        downloaded = time.perf_counter()
        model, nbytes = _from_pretrained(tmp)
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"seconds": seconds, "download_seconds": downloaded - start, "tensor_bytes": nbytes,
            "crc32": _parameters_crc(model)}


def child_fp_tensorferry(spec):
    """from_pretrained("s3://bucket/prefix/") inside tensorferry.transformers.loading()."""
    _import_transformers()
    import tensorferry.transformers
    start = time.perf_counter()
    with tensorferry.transformers.loading():
        model, nbytes = _from_pretrained(spec["url"])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tensor_bytes": nbytes, "crc32": _parameters_crc(model)}


CHILDREN = {"raw-python": child_raw_python, "boto3+safetensors": child_boto3,
            "runai-model-streamer": child_runai, "tensorferry Loader.load": child_tf_loader,
            "tensorferry load_file": child_tf_load_file,
            "from_pretrained: boto3 download + transformers": child_fp_download,
            "from_pretrained: tensorferry s3://": child_fp_tensorferry}
FROM_PRETRAINED = [n for n in CHILDREN if n.startswith("from_pretrained")]


def child_main(name, spec_json):
    spec = json.loads(spec_json)
    print(json.dumps(CHILDREN[name](spec)), flush=True)


# --- the parent: run children, measure ---------------------------------------------------------

def run_measured(argv, env=None, timeout=1800):
    """Runs argv; returns rc, wall seconds, peak RSS bytes (this child's ru_maxrss), stdout, stderr
    tail. The child's output goes through files (no pipe can fill up while we wait)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, stdin=subprocess.DEVNULL)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.01)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return {"rc": proc.returncode, "wall": wall, "peak_rss": usage.ru_maxrss * 1024,
                "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")[-3000:]}


class Bench:
    def __init__(self, args, server, ckpt, prefix, objects):
        self.args, self.server, self.ckpt = args, server, ckpt
        self.prefix, self.objects = prefix, objects
        self.total = sum(size for _, size in objects)
        self.tensor_bytes = sum(size for k, size in objects if k.endswith(".safetensors"))
        self.cli = find_cli(args.cli)
        self.env = dict(os.environ, **server.env(), RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0")
        self.results = {}
        self.disabled = {}

    def spec(self, **extra):
        s = self.server
        return dict(endpoint=s.endpoint, bucket=s.BUCKET, region=s.REGION,
                    access_key=s.ADMIN_KEY[0], secret_key=s.ADMIN_KEY[1], objects=self.objects,
                    url=f"s3://{s.BUCKET}/{self.prefix}/", scratch=self.args.data, **extra)

    def run_child(self, name, **extra):
        argv = [sys.executable, os.path.abspath(__file__), "--child", name,
                "--spec", json.dumps(self.spec(**extra))]
        r = run_measured(argv, self.env)
        if r["rc"] == 0:
            r.update(json.loads(r["stdout"].strip().splitlines()[-1]))
        r["timing"] = "in-proc"
        return r

    def run_curl(self, concurrency, part):
        """One curl process, every part of every object as its own transfer (--parallel)."""
        s = self.server
        lines = []
        for key, size in self.objects:
            for off in range(0, size, part):
                lines += [f'url = "{s.endpoint}/{s.BUCKET}/{key}"',
                          f'range = "{off}-{min(off + part, size) - 1}"', 'output = "/dev/null"',
                          f'aws-sigv4 = "aws:amz:{s.REGION}:s3"',
                          f'user = "{s.ADMIN_KEY[0]}:{s.ADMIN_KEY[1]}"', "fail", "next"]
        with tempfile.NamedTemporaryFile("w", suffix=".curl", delete=False) as cfg:
            cfg.write("\n".join(lines[:-1]) + "\n")
        try:
            r = run_measured(["curl", "--silent", "--show-error", "--parallel",
                              "--parallel-max", str(concurrency), "--config", cfg.name])
        finally:
            os.unlink(cfg.name)
        r["seconds"] = r["wall"]
        r["timing"] = "process"
        return r

    def run_cli(self, *extra):
        if self.cli is None:
            return {"rc": 127, "stderr": "no tensorferry CLI (set TENSORFERRY_CLI or --cli)",
                    "wall": 0, "peak_rss": 0}
        url = f"s3://{self.server.BUCKET}/{self.prefix}/"
        r = run_measured([self.cli, "load", url, "--json"] + list(extra), self.env)
        if r["rc"] == 0:
            try:
                stats = json.loads(r["stdout"])
            except ValueError:
                r["rc"], r["stderr"] = -1, "no JSON on stdout: " + r["stdout"][-500:]
                return r
            r["stats"] = stats
            r["seconds"] = cli_seconds(stats)
            r["timing"] = "in-proc"
        return r

    def record(self, name, r, nbytes=None):
        """Adds one run of `name`; a failed run disables the contender (reported once)."""
        if r["rc"] != 0:
            self.disabled[name] = f"exit {r['rc']}: {r['stderr'].strip()[-1500:]}"
            print(f"  {name}: FAILED ({last_line(r['stderr'])})", flush=True)
            return
        gbps = (nbytes or self.total) / 1e9 / r["seconds"]
        row = {"seconds": r["seconds"], "gb_per_s": gbps, "peak_rss": r["peak_rss"],
               "wall": r["wall"]}
        row.update({k: r[k] for k in ("stats", "download_seconds", "crc32", "timing") if k in r})
        self.results.setdefault(name, []).append(row)
        print(f"  {name:28s} {gbps:6.2f} GB/s  {r['seconds']:7.2f} s  "
              f"peak RSS {r['peak_rss'] / MiB:7.0f} MiB", flush=True)

    # -- phases -----------------------------------------------------------------------------------
    def raw_sweep(self):
        """Every raw method at every (concurrency, part size), once; the best setting of each."""
        best, sweep = {}, []
        for conc in self.args.raw_concurrency:
            for part in self.args.raw_part_sizes:
                for method in ("raw-curl", "raw-python"):
                    if method == "raw-curl":
                        r = self.run_curl(conc, part)
                    else:
                        r = self.run_child("raw-python", concurrency=conc, part_size=part)
                    if r["rc"] != 0:
                        print(f"  {method} c={conc} part={part // MiB}MiB: FAILED "
                              f"{r['stderr'][-300:]}", flush=True)
                        continue
                    gbps = self.total / 1e9 / r["seconds"]
                    sweep.append({"method": method, "concurrency": conc, "part_size": part,
                                  "gb_per_s": gbps})
                    print(f"  {method:10s} c={conc:3d} part={part // MiB:4d} MiB  "
                          f"{gbps:6.2f} GB/s", flush=True)
                    if gbps > best.get(method, {"gb_per_s": 0})["gb_per_s"]:
                        best[method] = sweep[-1]
        return best, sweep

    def contenders(self, best_raw):
        """(name, run) pairs of one round; run() returns a run_measured-like dict."""
        out = []
        if "raw-curl" in best_raw:
            b = best_raw["raw-curl"]
            out.append(("raw curl", lambda: self.run_curl(b["concurrency"], b["part_size"])))
        if "raw-python" in best_raw:
            b = best_raw["raw-python"]
            out.append(("raw python", lambda: self.run_child(
                "raw-python", concurrency=b["concurrency"], part_size=b["part_size"])))
        # The CLI at the raw curl's best transport setting (its concurrency and part size; the
        # defaults are 8 GETs of 32 MiB for a store on this host, as here, 32 of 8 MiB for a remote
        # one), with its checks (the generated checkpoint embeds checksums) and without them (the
        # raw contenders compute nothing): what the transport costs against what hashing costs.
        matched = []
        if "raw-curl" in best_raw:
            b = best_raw["raw-curl"]
            setting = ["--object-concurrency", str(b["concurrency"]),
                       "--object-part-size", f"{b['part_size'] // MiB}MiB"]
            matched = [
                (f"tensorferry CLI --budget {BUDGET} raw's setting",
                 lambda: self.run_cli("--budget", BUDGET, "--no-checksum", *setting)),
                (f"tensorferry CLI --budget {BUDGET} raw's setting, verify off",
                 lambda: self.run_cli("--budget", BUDGET, "--no-checksum", "--verify", "off",
                                      *setting))]
        out += [("boto3+safetensors", lambda: self.run_child("boto3+safetensors")),
                ("runai-model-streamer", lambda: self.run_child("runai-model-streamer")),
                # Throughput runs skip the CLI's CRC32C pass (the raw contenders compute nothing
                # either); byte-exactness is checked by the faults run against a clean load.
                ("tensorferry CLI", lambda: self.run_cli("--no-checksum")),
                (f"tensorferry CLI --budget {BUDGET}",
                 lambda: self.run_cli("--budget", BUDGET, "--no-checksum")),
                *matched,
                ("tensorferry Loader.load", lambda: self.run_child("tensorferry Loader.load")),
                ("tensorferry load_file", lambda: self.run_child("tensorferry load_file"))]
        if "from_pretrained" in self.args.contenders:
            out += [(name, functools.partial(self.run_child, name)) for name in FROM_PRETRAINED]
        return [c for c in out if c[0] in self.args.contenders or
                c[0].split(" --")[0] in self.args.contenders or
                (c[0].startswith("raw") and "raw" in self.args.contenders) or
                (c[0] in FROM_PRETRAINED and "from_pretrained" in self.args.contenders)]

    def rounds(self, best_raw):
        order = self.contenders(best_raw)
        if not order:  # only "tp" or "faults" asked for
            return
        for i in range(self.args.repeats):
            print(f"round {i + 1}/{self.args.repeats}", flush=True)
            shift = i % len(order)
            for name, run in order[shift:] + order[:shift]:
                if name in self.disabled:
                    continue
                self.record(name, run())

    def tensor_parallel(self):
        """Each rank of TP_WORLD: bytes transferred from S3 (remote_bytes) against its exact share
        (a local load of the same rank with --max-gap 0), with the default plan (strided slices
        coalesced across gaps up to 64 KiB, as for cold local files) and, for rank 0, with exact
        strides (--max-gap 0: one request per row piece of every strided slice)."""
        ranks = []
        for rank in range(TP_WORLD):
            tp = ["--tp-rank", str(rank), "--tp-size", str(TP_WORLD)]
            local = run_measured([self.cli, "load", self.ckpt, "--json", "--max-gap", "0"] + tp)
            exact = json.loads(local["stdout"])["bytes_read"] if local["rc"] == 0 else None
            row = {"rank": rank, "exact": exact}
            modes = [("default", [])] + ([("max_gap_0", ["--max-gap", "0"])] if rank == 0 else [])
            for mode, extra in modes:
                r = self.run_cli(*(tp + extra))
                if r["rc"] != 0:
                    self.disabled["tensorferry TP"] = f"exit {r['rc']}: {r['stderr'].strip()[-1500:]}"
                    print(f"  TP rank {rank} {mode}: FAILED ({last_line(r['stderr'])})", flush=True)
                    return ranks
                key, moved = transferred(r["stats"])
                row[mode] = {"transferred": moved, "stats_key": key,
                             "requests": r["stats"].get("remote_requests"),
                             "ratio": moved / exact if moved and exact else None,
                             "seconds": r["seconds"], "peak_rss": r["peak_rss"]}
                print(f"  TP rank {rank}/{TP_WORLD} {mode:9s}: {moved} bytes transferred ({key}) "
                      f"in {row[mode]['requests']} requests, {r['seconds']:.2f} s; exact share "
                      f"{exact} (x{row[mode]['ratio'] or 0:.3f})", flush=True)
            row["ratio"] = row["default"]["ratio"]
            ranks.append(row)
        self.cooperative_tp(ranks)
        return ranks

    def cooperative_tp(self, ranks):
        """The same world through `tensorferry-mpi load --mode cooperative` (the cost model's
        choice, --exchange auto): each rank's bytes transferred against the same exact share,
        into ranks[r]["cooperative"]. Skipped (with a line saying why) without mpirun or the
        binary."""
        import shutil
        mpi = os.path.join(os.path.dirname(self.cli), "tensorferry-mpi")
        if not shutil.which("mpirun") or not os.access(mpi, os.X_OK):
            print(f"  TP cooperative: skipped (no mpirun or no {mpi})", flush=True)
            return
        url = f"s3://{self.server.BUCKET}/{self.prefix}/"
        env = dict(self.env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_btl_vader_single_copy_mechanism="none")
        r = run_measured(["mpirun", "--oversubscribe", "-np", str(TP_WORLD), mpi, "load", url,
                          "--mode", "cooperative", "--json"], env)
        try:
            doc = json.loads(r["stdout"]) if r["rc"] == 0 else None
        except ValueError:
            doc = None
        if doc is None:
            print(f"  TP cooperative: FAILED ({last_line(r['stderr'])})", flush=True)
            return
        run = doc["runs"][0]
        for x in run["per_rank"]:
            row = ranks[x["rank"]]
            moved = x["remote_bytes"]
            row["cooperative"] = {"transferred": moved, "requests": x["remote_requests"],
                                  "ratio": moved / row["exact"] if row["exact"] else None,
                                  "seconds": run["wall_seconds"]}
            print(f"  TP rank {x['rank']}/{TP_WORLD} cooperative: {moved} bytes transferred in "
                  f"{x['remote_requests']} requests, {run['wall_seconds']:.2f} s (all ranks); "
                  f"exact share {row['exact']} (x{row['cooperative']['ratio'] or 0:.3f})",
                  flush=True)

    def cache(self):
        """The local cache (--object-cache-dir): per round, alternating with a streaming load
        (no cache), the first start (an empty cache: the load reads through the downloads), a second start
        with the copies in the page cache, a second start with them evicted from it (cold local
        disk), and, as the disk's reference, a cold load of the local checkpoint itself. Each
        run's checksum must be the streaming load's."""
        import shutil

        from _pagecache import evict
        cache_dir = os.path.join(self.args.data, "object-cache")
        rows = {}

        def blob_paths():
            d = os.path.join(cache_dir, "blobs")
            return [os.path.join(d, f) for f in os.listdir(d) if not f.endswith(".json")]

        def run(name, *extra):
            r = self.run_cli(*extra)
            if r["rc"] != 0:
                print(f"  cache {name}: FAILED ({last_line(r['stderr'])})", flush=True)
                return None
            st = r["stats"]
            gbps = self.tensor_bytes / 1e9 / r["wall"]
            row = {"wall": r["wall"], "gb_per_s": gbps, "checksum": st.get("checksum"),
                   "cache_hits": st.get("cache_hits"), "cache_fills": st.get("cache_fills"),
                   "remote_bytes": st.get("remote_bytes"), "peak_rss": r["peak_rss"],
                   "load_seconds": st.get("seconds")}
            rows.setdefault(name, []).append(row)
            print(f"  cache {name:34s} {r['wall']:7.2f} s (process, load "
                  f"{row['load_seconds'] or 0:.2f} s)  {gbps:6.2f} GB/s  "
                  f"fills {row['cache_fills']} hits {row['cache_hits']} remote bytes "
                  f"{row['remote_bytes']}", flush=True)
            return row

        local_files = [os.path.join(self.ckpt, f) for f in os.listdir(self.ckpt)]
        for i in range(self.args.repeats):
            print(f"cache round {i + 1}/{self.args.repeats}", flush=True)
            shutil.rmtree(cache_dir, ignore_errors=True)
            stream = run("streaming (no cache)")
            fill = run("first start (load through the download)", "--object-cache-dir", cache_dir)
            warm = run("later start, copies in page cache", "--object-cache-dir", cache_dir)
            evict(blob_paths())
            cold = run("later start, cold local disk", "--object-cache-dir", cache_dir)
            evict(local_files)
            r = run_measured([self.cli, "load", self.ckpt, "--json"])
            if r["rc"] == 0:
                st = json.loads(r["stdout"])
                rows.setdefault("local checkpoint, cold (reference)", []).append(
                    {"wall": r["wall"], "gb_per_s": self.tensor_bytes / 1e9 / r["wall"],
                     "checksum": st.get("checksum"), "peak_rss": r["peak_rss"]})
                print(f"  cache {'local checkpoint, cold (reference)':34s} {r['wall']:7.2f} s",
                      flush=True)
            want = stream and stream["checksum"]
            for row in (fill, warm, cold):
                if row is not None and row["checksum"] != want:
                    print(f"  cache: CHECKSUM MISMATCH {row['checksum']} != {want}", flush=True)
                    row["mismatch"] = True
        shutil.rmtree(cache_dir, ignore_errors=True)
        return {name: {"runs": len(rs), "seconds": statistics.median(x["wall"] for x in rs),
                       "gb_per_s": statistics.median(x["gb_per_s"] for x in rs),
                       "seconds_all": [round(x["wall"], 2) for x in rs],
                       "load_seconds_all": [round(x.get("load_seconds") or 0, 2) for x in rs],
                       "byte_exact": not any(x.get("mismatch") for x in rs)}
                for name, rs in rows.items()}

    def faults(self):
        """tensorferry CLI through the fault proxy, a reset mid-body in 1 of 20 responses: the
        load must complete with the checksum of a load without faults."""
        from fault_proxy import FaultProxy, Rule
        clean = self.run_cli()
        host, port = self.server.endpoint[len("http://"):].rsplit(":", 1)
        with FaultProxy(host, int(port), [Rule("reset_mid_body", every=20)]) as proxy:
            env = dict(self.env, **self.server.env(endpoint=proxy.url))
            url = f"s3://{self.server.BUCKET}/{self.prefix}/"
            r = run_measured([self.cli, "load", url, "--json"], env)
            st = proxy.stats()
        out = {"rc": r["rc"], "responses": st["responses"], "resets": st["faults_total"]}
        if r["rc"] != 0 or clean["rc"] != 0:
            out["error"] = last_line(r["stderr"] if r["rc"] else clean["stderr"])
            print(f"  faults: FAILED ({out['error']})", flush=True)
            return out
        stats = json.loads(r["stdout"])
        want = json.loads(clean["stdout"]).get("checksum")
        out.update(checksum=stats.get("checksum"), want=want,
                   byte_exact=stats.get("checksum") == want and want is not None,
                   retries=stats.get("remote_retries"), seconds=stats.get("wall_seconds"))
        print(f"  faults: {st['faults_total']} resets in {st['responses']} responses, "
              f"byte-exact: {out['byte_exact']}, retries {out['retries']}", flush=True)
        return out


def last_line(text):
    """The last non-empty line of a stderr (the error itself, for a traceback)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:400] if lines else "(no output)"


def transferred(stats):
    """(key, value) of the bytes-over-the-network counter in `tensorferry load --json`."""
    for key in ("remote_bytes", "bytes_transferred", "transferred_bytes", "network_bytes",
                "http_bytes", "bytes_received", "object_bytes", "bytes_read"):
        if key in stats:
            return key, stats[key]
    for key, value in stats.items():
        if "transfer" in key and isinstance(value, (int, float)):
            return key, value
    return None, None


def median_row(rows):
    crcs = {r["crc32"] for r in rows if "crc32" in r}
    return {"runs": len(rows), "timing": rows[0].get("timing"),
            "gb_per_s": statistics.median(r["gb_per_s"] for r in rows),
            **({"crc32": sorted(crcs)} if crcs else {}),
            "seconds": statistics.median(r["seconds"] for r in rows),
            "peak_rss": max(r["peak_rss"] for r in rows),
            "gb_per_s_all": [round(r["gb_per_s"], 3) for r in rows]}


def targets(summary, best_raw_gbps, tp, faults):
    """The issue's targets, each True/False/None (None: not measured)."""
    def gbps(name):
        return summary[name]["gb_per_s"] if name in summary else None
    tf = gbps("tensorferry CLI")
    out = {}
    out["tensorferry >= 90% of best raw"] = (tf >= 0.9 * best_raw_gbps
                                             if tf and best_raw_gbps else None)
    for name in (f"tensorferry CLI --budget {BUDGET}",
                 f"tensorferry CLI --budget {BUDGET} raw's setting"):
        got = gbps(name)
        out[f"{name} >= 90% of best raw"] = (got >= 0.9 * best_raw_gbps
                                             if got and best_raw_gbps else None)
    for peer in ("runai-model-streamer", "boto3+safetensors"):
        out[f"tensorferry ahead of {peer}"] = tf > gbps(peer) if tf and gbps(peer) else None
    budget = summary.get(f"tensorferry CLI --budget {BUDGET}")
    out[f"peak RSS <= {BUDGET} + 64MiB with --budget {BUDGET}"] = (
        budget["peak_rss"] <= BUDGET_BYTES + RSS_SLACK if budget else None)
    ok = [t["ratio"] <= 1.01 for t in tp if t.get("ratio") is not None]
    out["TP world 4: each rank <= its share + 1% (default plan)"] = (
        all(ok) if ok and len(ok) == TP_WORLD else None)
    exact = [t["max_gap_0"]["ratio"] <= 1.01 for t in tp
             if t.get("max_gap_0", {}).get("ratio") is not None]
    out["TP world 4: rank 0 <= its share + 1% (--max-gap 0)"] = all(exact) if exact else None
    coop = [t["cooperative"]["ratio"] <= 1.01 for t in tp
            if t.get("cooperative", {}).get("ratio") is not None]
    out["TP world 4: each rank <= its share + 1% (cooperative)"] = (
        all(coop) if coop and len(coop) == TP_WORLD else None)
    out["reset in 1 of 20 responses: load byte-exact"] = (faults or {}).get("byte_exact")
    return out


def print_table(summary, best_raw_gbps):
    w = max([36] + [len(name) for name in summary])
    print(f"\n{'contender':{w}s} {'GB/s':>7s} {'% raw':>6s} {'s':>7s} {'peak RSS MiB':>13s} "
          f"{'timed':>7s}  runs")
    for name, row in summary.items():
        pct = 100 * row["gb_per_s"] / best_raw_gbps if best_raw_gbps else float("nan")
        print(f"{name:{w}s} {row['gb_per_s']:7.2f} {pct:6.0f} {row['seconds']:7.2f} "
              f"{row['peak_rss'] / MiB:13.0f} {row.get('timing') or '?':>7s}  "
              f"{row['gb_per_s_all']}")
    for key in sorted({row.get("timing") for row in summary.values()} & set(TIMING)):
        print(f"timed {key}: {TIMING[key]}")


def run_bench(args):
    from objstore_servers import SeaweedS3
    report = {"uptime_before": uptime(), "args": {k: v for k, v in vars(args).items()
                                                  if k not in ("child", "spec")}}
    print(report["uptime_before"], flush=True)
    cli = find_cli(args.cli)
    ckpt = make_checkpoint(cli, args.size, args.data)
    prefix = os.path.basename(ckpt)
    if "from_pretrained" in args.contenders and \
            not os.path.exists(os.path.join(ckpt, "config.json")):
        from model_bench import config_of  # a LlamaConfig matching the checkpoint's tensors
        config_of(ckpt).save_pretrained(ckpt)
    with SeaweedS3(parent_dir=args.data) as server:
        print(f"SeaweedFS at {server.endpoint} (start {server.start_seconds:.2f} s)", flush=True)
        t0 = time.perf_counter()
        keys = server.upload_dir(server.BUCKET, prefix, ckpt)
        sizes = {k: os.path.getsize(os.path.join(ckpt, k[len(prefix) + 1:])) for k in keys}
        objects = [[k, sizes[k]] for k in keys]
        print(f"uploaded {len(keys)} objects, {sum(sizes.values()) / 1e9:.2f} GB in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        bench = Bench(args, server, ckpt, prefix, objects)
        print("raw ranged GETs, every setting once:", flush=True)
        best_raw, sweep = bench.raw_sweep() if "raw" in args.contenders else ({}, [])
        bench.rounds(best_raw)
        tp = bench.tensor_parallel() if "tp" in args.contenders and cli else []
        faults = bench.faults() if "faults" in args.contenders and cli else None
        cache = bench.cache() if "cache" in args.contenders and cli else None
    summary = {name: median_row(rows) for name, rows in bench.results.items()}
    raw_medians = [summary[n]["gb_per_s"] for n in ("raw curl", "raw python") if n in summary]
    best_raw_gbps = max(raw_medians) if raw_medians else None
    report.update({"checkpoint": ckpt, "bytes": bench.total, "objects": objects, "cli": cli,
                   "seaweedfs_start_seconds": server.start_seconds, "raw_sweep": sweep,
                   "best_raw_setting": best_raw, "best_raw_gb_per_s": best_raw_gbps,
                   "timing": TIMING, "budget_bytes": BUDGET_BYTES,
                   "summary": summary, "runs": bench.results, "failed": bench.disabled,
                   "tensor_parallel": tp, "faults": faults, "cache": cache,
                   "targets": targets(summary, best_raw_gbps, tp, faults),
                   "uptime_after": uptime()})
    print_table(summary, best_raw_gbps)
    crcs = {n: summary[n]["crc32"] for n in FROM_PRETRAINED if n in summary}
    if crcs:
        same = len({c for v in crcs.values() for c in v}) == 1
        report["from_pretrained_identical"] = same
        print(f"from_pretrained: parameters identical in every run: {same} {crcs}")
    if cache:
        print("\nlocal cache (--object-cache-dir), process wall time, median:")
        for name, row in cache.items():
            print(f"  {name:40s} {row['seconds']:7.2f} s  {row['gb_per_s']:6.2f} GB/s  "
                  f"runs {row['seconds_all']}  byte-exact {row['byte_exact']}")
    for name, why in bench.disabled.items():
        print(f"FAILED {name}: {last_line(why)}")
    for name, ok in report["targets"].items():
        print(f"target: {name}: {'not measured' if ok is None else ('met' if ok else 'MISSED')}")
    print(report["uptime_after"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return report


ALL = ["raw", "boto3+safetensors", "runai-model-streamer", "tensorferry CLI",
       "tensorferry Loader.load", "tensorferry load_file", "tp", "faults", "cache",
       "from_pretrained"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2GB", type=parse_size,
                    help="checkpoint size at least (default 2GB; 64MB to try the harness)")
    ap.add_argument("--data", default="/var/tmp/tf-objstore-bench",
                    help="checkpoints, SeaweedFS data and scratch (not /tmp: often RAM)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cli", help="tensorferry CLI (default $TENSORFERRY_CLI, build/release/...)")
    ap.add_argument("--contenders", default=",".join(ALL),
                    type=lambda s: [c.strip() for c in s.split(",") if c.strip()],
                    help=f"comma-separated subset of: {','.join(ALL)}")
    ap.add_argument("--raw-concurrency", default="4,8,16,32",
                    type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--raw-part-sizes", default="8MiB,32MiB",
                    type=lambda s: [parse_size(x) for x in s.split(",")])
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(args.child, args.spec)
    run_bench(args)


if __name__ == "__main__":
    main()

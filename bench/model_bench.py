#!/usr/bin/env python3
"""A model, not a state dict, two flows (issue 14's targets), each contender in the same run:

--flow dispatch (default): transformers' LlamaForCausalLM built on the meta device from a config
matching the checkpoint (accelerate's init_empty_weights), then filled by
tensorferry.torch.load_checkpoint_and_dispatch and by accelerate.load_checkpoint_and_dispatch, with
the same device map and dtype.

--flow from_pretrained: transformers' AutoModelForCausalLM.from_pretrained(path, dtype=...) as is
("transformers") and inside tensorferry.transformers.loading(to_device=False) ("tensorferry": the
files mapped); with --to-device also inside loading(to_device=True) ("tf-to-device", a device map
onto one GPU: the checkpoint read straight into tensors on it, as loading() does by default when
it fits; its child reports the seconds of that read, "read"); the config.json
(matching the checkpoint) is written beside the files when absent. transformers' modules are
imported before the clock starts (both pay the same import time).

    .venv/bin/python bench/model_bench.py                       # data/default, 3 repeats
    .venv/bin/python bench/model_bench.py data/small --repeats 5 --json /tmp/model.json
    .venv/bin/python bench/model_bench.py /var/tmp/model-default --flow from_pretrained

The checkpoint is made with `tensorferry gen DIR --metadata format=pt` when absent (accelerate
refuses safetensors files without that metadata). Each contender runs in a child process of its
own, alternating, so that page cache and allocator state are alike: the model is built on the meta
device (untimed), then the call is timed until it returns and every page of every parameter
has been touched once (a model backed by a file mapping is read at first use; "call" is the
call alone). Peak RSS is the child's
VmHWM when the call returned minus its RSS before the call, beside the model's bytes; the parameters of the
two results are compared (checksum of every parameter's bytes) and must agree.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(ROOT, "build", "release", "bin", "tensorferry")


def config_of(path):
    """A LlamaConfig whose parameters are exactly the checkpoint's tensors."""
    import tensorferry
    from transformers import LlamaConfig
    with tensorferry.Loader(path) as loader:
        shapes = {o.name: list(o.shape) for o in loader._describe()}
    vocab, hidden = shapes["model.embed_tokens.weight"]
    inter = shapes["model.layers.0.mlp.gate_proj.weight"][0]
    layers = 1 + max(int(n.split(".")[2]) for n in shapes if n.startswith("model.layers."))
    q = shapes["model.layers.0.self_attn.q_proj.weight"][0]
    kv = shapes["model.layers.0.self_attn.k_proj.weight"][0]
    # The largest usual head size that divides the projections (small presets have narrow ones).
    head_dim = next((d for d in (128, 64, 32, 16, 8, 4, 2) if q % d == 0 and kv % d == 0), 1)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=q // head_dim,
                       num_key_value_heads=kv // head_dim, head_dim=head_dim,
                       tie_word_embeddings="lm_head.weight" not in shapes)


def child(args):
    if args.flow == "from_pretrained":
        return child_from_pretrained(args)
    import torch
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM
    config = config_of(args.path)
    with init_empty_weights():
        model = LlamaForCausalLM(config)
    dtype = getattr(torch, args.dtype)
    device = DeviceMemory(args)
    rss0 = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    start = time.perf_counter()
    with device:
        if args.child == "tensorferry":  # (its import timed, as it always was)
            import tensorferry.torch
            load = tensorferry.torch.load_checkpoint_and_dispatch
        else:
            import accelerate
            load = accelerate.load_checkpoint_and_dispatch
        model = load(model, args.path, device_map=args.device_map, dtype=dtype,
                     no_split_module_classes=["LlamaDecoderLayer"])
        if device.sampler is not None:
            torch.cuda.synchronize()
    report(model, start, rss0, device.used)


def child_from_pretrained(args):
    import torch
    import transformers
    import transformers.core_model_loading  # noqa: F401  imported before the clock starts
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM
    import tensorferry.transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    # On a GPU, both load straight to it (device_map); on the CPU the call stays as users write it.
    kwargs = {} if args.device_map == {"": "cpu"} else {"device_map": args.device_map}
    read = []  # tf-to-device: the seconds of the read onto the device
    if args.child == "tf-to-device":
        original = tensorferry.transformers._DeviceRead._read

        def timed(self):
            t0 = time.perf_counter()
            try:
                return original(self)
            finally:
                read.append(time.perf_counter() - t0)

        tensorferry.transformers._DeviceRead._read = timed
    device = DeviceMemory(args)
    profile = None
    if args.profile:
        import cProfile
        profile = cProfile.Profile()
    rss0 = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    with device:
        if args.child in ("tensorferry", "tf-to-device"):
            with tensorferry.transformers.loading(to_device=args.child == "tf-to-device"):
                model = AutoModelForCausalLM.from_pretrained(args.path, dtype=dtype, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(args.path, dtype=dtype, **kwargs)
        if device.sampler is not None:
            torch.cuda.synchronize()
    if profile is not None:
        profile.disable()
        import pstats
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(args.profile)
    report(model, start, rss0, device.used, {"read_seconds": sum(read)} if read else {})


def on_gpu(args):
    """True when the device map sends the model to a GPU (then the child samples its memory)."""
    where = args.device_map.get("", "") if isinstance(args.device_map, dict) else args.device_map
    return str(where).startswith("cuda") or where in ("auto", "balanced", "balanced_low_0",
                                                      "sequential")


class DeviceMemory:
    """Around the timed call on a GPU: the most device memory in use beyond what was in use
    before (cudaMemGetInfo sampled every millisecond by gpu_bench.MinFree, which sees every
    allocation, torch's and the loader's own), so the model's bytes plus what the loader held
    beside them. A no-op on the CPU."""

    def __init__(self, args):
        self.used = 0
        self.sampler = None
        import torch
        if on_gpu(args) and torch.cuda.is_available():
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from gpu_bench import MinFree
            torch.cuda.init()  # the context before the clock starts, as the host side's imports
            self.free0 = torch.cuda.mem_get_info()[0]
            self.sampler = MinFree(torch)

    def __enter__(self):
        if self.sampler is not None:
            self.sampler.__enter__()
        return self

    def __exit__(self, *exc):
        if self.sampler is not None:
            self.sampler.__exit__(*exc)
            self.used = max(0, self.free0 - self.sampler.lowest)


def report(model, start, rss0, device_used=0, extra=None):
    import torch
    seconds = time.perf_counter() - start
    # Ready means in memory: touch one byte of every page of every tensor (a loader may hand out
    # views of a file mapping whose pages are read at first use).
    for p in model.state_dict().values():
        if p.numel():
            int(p.reshape(-1).view(torch.uint8)[::4096].sum())
    touched = time.perf_counter() - start
    peak = _hwm()  # before the checksum below allocates anything
    device_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values()
                       if p.device.type == "cuda")
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    checksum = 0
    for name, p in sorted(model.state_dict().items()):
        checksum = (checksum * 1_000_003 + int(p.reshape(-1).view(torch.uint8)
                                              .sum(dtype=torch.int64))) % (1 << 61)
    print(json.dumps({"seconds": touched, "call_seconds": seconds, "bytes": nbytes, "checksum": checksum,
                      "rss_before": rss0, "peak_rss": peak, "device_bytes": device_bytes,
                      "peak_device_used": device_used, **(extra or {})}))


def _hwm():
    """The process's peak RSS so far (VmHWM), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?", default="data/default")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device-map", default="cpu",
                   help="a device ('cpu', 'cuda') or a strategy ('auto', 'sequential'); with "
                        "--flow from_pretrained, passed as from_pretrained's device_map unless "
                        "'cpu'")
    p.add_argument("--modes", default="warm,cold",
                   help="warm: files read through first; cold: evicted (posix_fadvise) first")
    p.add_argument("--flow", choices=("dispatch", "from_pretrained"), default="dispatch")
    p.add_argument("--to-device", action="store_true",
                   help="--flow from_pretrained: also loading(to_device=True) (tf-to-device)")
    p.add_argument("--json")
    p.add_argument("--child", help="run one contender in this process and print its JSON line "
                   "(tensorferry, tf-to-device, transformers; accelerate with --flow dispatch)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="with --child and --flow from_pretrained: cProfile the call, the top N "
                        "functions by cumulative time on stderr")
    args = p.parse_args()
    if args.child:
        if args.device_map not in ("auto", "balanced", "balanced_low_0", "sequential"):
            args.device_map = {"": args.device_map}
        child(args)
        return
    if not os.path.exists(os.path.join(args.path, "model.safetensors.index.json")):
        preset = os.path.basename(args.path.rstrip("/"))
        preset = preset if preset in ("tiny", "small", "default", "large") else "default"
        subprocess.run([CLI, "gen", args.path, "--preset", preset, "--metadata", "format=pt"],
                       check=True)
    if args.flow == "from_pretrained" and not os.path.exists(os.path.join(args.path, "config.json")):
        config = config_of(args.path)
        config.dtype = args.dtype
        config.save_pretrained(args.path)
    print(f"# {args.path}; flow {args.flow}; dtype {args.dtype}; device_map {args.device_map}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _pagecache import evict, warm
    files = [os.path.join(args.path, f) for f in sorted(os.listdir(args.path))
             if f.endswith(".safetensors")]
    results = {}
    for mode in args.modes.split(","):
        results[mode] = measure(args, mode, files, evict, warm)
    result = {"path": args.path, "flow": args.flow, "dtype": args.dtype,
              "device_map": args.device_map,
              "modes": results, "load_after": os.getloadavg()[0]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    sums = {t["checksum"] for m in results.values() for ts in m.values() for t in ts}
    if len(sums) != 1:
        sys.exit("parameters differ between the contenders")


def measure(args, mode, files, evict, warm):
    other = "transformers" if args.flow == "from_pretrained" else "accelerate"
    names = ["tensorferry", other]
    if args.to_device and args.flow == "from_pretrained":
        names.insert(1, "tf-to-device")
    runs = {n: [] for n in names}
    for r in range(args.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            left = evict(files, empty=0.0) if mode == "cold" else warm(files, empty=0.0)
            # Fresh children: the peak RSS of each is its own (resource.RUSAGE_CHILDREN would
            # mix them), taken from /proc by the child itself before and after the call.
            t = run_child_rss(args, name)
            runs[name].append(t)
            device = ""
            if t.get("device_bytes"):
                device = (f"  on the GPU {t['device_bytes'] / 2**20:.0f} MiB, peak device memory"
                          f" beside it +{max(0, t['peak_device_used'] - t['device_bytes']) / 2**20:.0f}"
                          " MiB")
            if "read_seconds" in t:
                device += f"  (read onto the device {t['read_seconds']:.2f} s)"
            print(f"  {mode} round {r + 1} {name:12s} (cached {left:.0%}) {t['seconds']:7.2f} s (call {t['call_seconds']:.2f} s)  "
                  f"{t['bytes'] / t['seconds'] / 1e9:5.2f} GB/s  peak RSS +"
                  f"{(t['maxrss'] - t['rss_before']) / 2**20:7.0f} MiB{device}", flush=True)
    print(f"{mode}: {'contender':14s} {'s':>7s} {'GB/s':>6s} {'peak RSS over start':>20s}  "
          "model bytes")
    for name, ts in runs.items():
        s = statistics.median(t["seconds"] for t in ts)
        rss = statistics.median(t["maxrss"] - t["rss_before"] for t in ts)
        print(f"{mode}: {name:14s} {s:7.2f} {ts[0]['bytes'] / s / 1e9:6.2f} {rss / 2**20:16.0f} MiB"
              f"  {ts[0]['bytes'] / 2**20:.0f} MiB")
    same = len({t["checksum"] for ts in runs.values() for t in ts}) == 1
    for name in names:
        if name == other:
            continue
        ratio = (statistics.median(t["seconds"] for t in runs[other]) /
                 statistics.median(t["seconds"] for t in runs[name]))
        print(f"{mode}: {name} is {ratio:.2f}x {other}; parameters "
              f"{'identical' if same else 'DIFFER'}; load {os.getloadavg()[0]:.2f}", flush=True)
    return runs


def run_child_rss(args, name):
    cmd = [sys.executable, os.path.abspath(__file__), args.path, "--child", name,
           "--dtype", args.dtype, "--device-map", args.device_map, "--flow", args.flow]
    # communicate() drains stdout and stderr together: a child that fills one pipe while the
    # other is read cannot block.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"{name} failed: {err.strip().splitlines()[-1] if err.strip() else '?'}")
    got = json.loads(out.strip().splitlines()[-1])
    got["maxrss"] = got["peak_rss"]  # VmHWM when the call returned (not the check after it)
    return got


if __name__ == "__main__":
    main()

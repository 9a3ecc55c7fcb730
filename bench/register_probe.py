"""Could the device pipeline copy straight from page-cache pages? A probe for the next GPU session.

The staged path moves each byte through host memory three times (page cache -> pinned slot by the
read, slot -> device by DMA; docs/benchmarks.md, "Second GPU session") and levels off near half
the pinned host-to-device bandwidth on the lent VMs. Registering the page cache's own pages with
CUDA (cudaHostRegister with cudaHostRegisterReadOnly on a read-only mapping of the file) would let
the copy engine read them where they are: one pass instead of three, if registering is fast.
This measures, on one warm file, before anything is built on it:

  pinned        torch's pinned buffer -> device (the limit)
  staged        tensorferry.Loader(file, device="cuda").load_into (the staging ring, today)
  register      cudaHostRegister of the whole mapping, one copy, cudaHostUnregister: each timed
  chunked       per chunk: register chunk k+1 while chunk k's copy runs, unregister at the end

and checks that the device bytes equal the file's (a sample of slices). Alternating, medians of
--repeats; each round's figures are printed as it ends (a run cut off keeps them). Needs torch
with CUDA (torch.cuda.cudart() for cudaHostRegister).

    python bench/register_probe.py data/gpu_check/model-00001-of-00009.safetensors
"""
import argparse
import mmap
import statistics
import time
import warnings

MiB = 1 << 20
REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file")
    p.add_argument("--chunk", type=int, default=64, help="MiB per registered chunk (chunked)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import numpy as np
    import torch
    import tensorferry

    if not torch.cuda.is_available():
        raise SystemExit("register_probe: needs torch with a usable CUDA device")
    cudart = torch.cuda.cudart()
    with open(args.file, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    host = np.frombuffer(mm, dtype=np.uint8)
    n = host.size
    base = host.ctypes.data
    host.sum(dtype=np.uint64)  # warm: every page in the page cache and mapped
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not writable": the copy only reads it
        host_t = torch.from_numpy(host)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(host_t)
    chunk = args.chunk * MiB
    print(f"# {args.file}: {n / 1e9:.2f} GB, {torch.cuda.get_device_name()}, chunks of "
          f"{args.chunk} MiB, repeats {args.repeats}", flush=True)

    def check(what):
        torch.cuda.synchronize()
        for start in (0, n // 3, n // 2, max(0, n - (1 << 20))):
            end = min(n, start + (1 << 20))
            if not torch.equal(dev[start:end].cpu(), host_t[start:end]):
                raise SystemExit(f"{what}: device bytes [{start}, {end}) differ from the file's")
        dev.fill_(0)
        torch.cuda.synchronize()

    def register(ptr, size):
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(ptr, size, REGISTER_READ_ONLY)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister({size} bytes): error {int(err)} ({err})")
        return time.perf_counter() - t0

    def unregister(ptr):
        t0 = time.perf_counter()
        err = cudart.cudaHostUnregister(ptr)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostUnregister: error {int(err)} ({err})")
        return time.perf_counter() - t0

    def run_pinned():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
        return {"total": time.perf_counter() - t0}

    with tensorferry.Loader(args.file) as probe:  # the staged row's destinations, made once
        fw = probe._fw
        dests = {o.name: torch.empty(tuple(o.shape), dtype=fw.dtype(o.dtype, o.name),
                                     device="cuda") for o in probe._describe()}

    def run_staged():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with tensorferry.Loader(args.file, device="cuda") as loader:
            loader.load_into(dests)
        torch.cuda.synchronize()
        return {"total": time.perf_counter() - t0}

    def run_register():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reg = register(base, n)
        t1 = time.perf_counter()
        ok = host_t.is_pinned()
        dev.copy_(host_t, non_blocking=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        unreg = unregister(base)
        total = time.perf_counter() - t0
        check("register")
        return {"total": total, "register": reg, "copy": t2 - t1, "unregister": unreg,
                "pinned_seen": ok}

    def run_chunked():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        reg = 0.0
        starts = list(range(0, n, chunk))
        for start in starts:
            size = min(chunk, n - start)
            reg += register(base + start, size)
            # Queued behind the previous chunks' copies: the next registration overlaps them.
            dev[start:start + size].copy_(host_t[start:start + size], non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        unreg = sum(unregister(base + start) for start in starts)
        total = time.perf_counter() - t0
        check("chunked")
        return {"total": total, "register": reg, "until_copied": t1 - t0, "unregister": unreg}

    contenders = {"pinned": run_pinned, "staged": run_staged, "register": run_register,
                  "chunked": run_chunked}
    runs = {k: [] for k in contenders}
    for r in range(args.repeats + 1):  # the first round warms up; not counted
        parts = []
        for name, fn in contenders.items():
            try:
                got = fn()
            except RuntimeError as e:
                print(f"{name}: {e}", flush=True)
                got = None
            if got is not None:
                parts.append(f"{name} {n / got['total'] / 1e9:.2f}")
                if r > 0:
                    runs[name].append(got)
        print(f"round {r}{' (warm-up, not counted)' if r == 0 else ''}, GB/s: "
              f"{', '.join(parts) or 'none'}", flush=True)
    for name, rs in runs.items():
        if not rs:
            print(f"{name:9s} no result")
            continue
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "pinned_seen"}
        parts = "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items() if k != "total")
        seen = f"  is_pinned {rs[0]['pinned_seen']}" if "pinned_seen" in rs[0] else ""
        print(f"{name:9s} {n / med['total'] / 1e9:6.2f} GB/s  total {med['total'] * 1e3:.1f} ms"
              f"  {parts}{seen}")
    del host_t, host
    try:
        mm.close()
    except BufferError:
        pass  # a view is still alive; the process ends anyway


if __name__ == "__main__":
    main()

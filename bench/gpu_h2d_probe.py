#!/usr/bin/env python3
"""Where the warm storage-to-GPU limit of a machine lies: the host-side copies a staged load makes
against host-to-device DMA straight out of the page cache.

    .venv/bin/python bench/gpu_h2d_probe.py data/gpu_check [--json probe.json] [--quick]

A staged load copies every byte twice in host memory before the DMA reads it a third time
(page cache -> pinned slot by pread, then the copy engine reads the slot). This probe measures, on
the checkpoint's files held warm in the page cache, in one process:

  memcpy      host memory bandwidth: torch's multithreaded copy, pinned to pinned (1 GiB)
  pinned h2d  pinned host memory to device, one 1 GiB copy (the PCIe limit)
  pread       page cache -> pinned buffers by os.preadv, 8 MiB reads, T threads (the staged path's
              host half)
  pageable    cudaMemcpyAsync from the files' plain mappings (unregistered; the driver stages)
  register    the files mapped (PROT_READ, MAP_SHARED) and each window of S bytes
              cudaHostRegister'ed read-only (cudaHostRegisterReadOnly), copied to the device
              from the mapping itself, then unregistered: T threads, each with its own stream;
              the time of registering, copying and unregistering is reported per byte
Every figure is GB/s over the bytes moved, the median of --repeats passes over all files.
Device memory: one buffer the size of the largest file per thread (reused).
"""
import argparse
import concurrent.futures as cf
import contextlib
import ctypes
import glob
import json
import mmap
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pagecache import warm  # noqa: E402

MiB = 1 << 20


def files_of(path):
    return [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))


def cudart_path():
    with open("/proc/self/maps") as f:
        for line in f:
            if "libcudart.so" in line:
                return line.split()[-1]
    raise SystemExit("gpu_h2d_probe: libcudart is not loaded after torch.cuda.init()")


class Cuda:
    def __init__(self):
        lib = ctypes.CDLL(cudart_path())
        vp, sz, ui = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        lib.cudaHostRegister.argtypes = [vp, sz, ui]
        lib.cudaHostUnregister.argtypes = [vp]
        lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        lib.cudaStreamSynchronize.argtypes = [vp]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                               ctypes.c_int]
        self.lib = lib

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.cudaGetErrorString(rc).decode()} ({rc})")

    def attribute(self, attr):
        v = ctypes.c_int(-1)
        rc = self.lib.cudaDeviceGetAttribute(ctypes.byref(v), attr, 0)
        return v.value if rc == 0 else f"error {rc}"


libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class Mapped:
    """The files mapped read-only, shared."""

    def __init__(self, files):
        self.maps = []
        for f in files:
            size = os.path.getsize(f)
            fd = os.open(f, os.O_RDONLY)
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            os.close(fd)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap", f)
            self.maps.append((addr, size))

    def close(self):
        for addr, size in self.maps:
            libc.munmap(addr, size)


def windows(sizes, window):
    """(file index, offset, length) of every window, files in turn."""
    out = []
    for i, size in enumerate(sizes):
        off = 0
        while off < size:
            n = min(window, size - off)
            out.append((i, off, n))
            off += n
    return out


class Slots:
    """Indices 0..n-1 lent to worker threads one at a time: each thread's buffer (and stream)."""

    def __init__(self, n):
        self._lock = threading.Lock()
        self._free = list(range(n))

    @contextlib.contextmanager
    def take(self):
        with self._lock:
            k = self._free.pop()
        try:
            yield k
        finally:
            with self._lock:
                self._free.append(k)


def median_rate(fn, nbytes, repeats):
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        extra = fn()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates), rates, extra


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="fewer configurations")
    args = p.parse_args()
    import torch
    torch.cuda.init()
    torch.empty(1, device="cuda")
    cuda = Cuda()
    files = files_of(args.path)
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    cached = warm(files)
    threads = min(16, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    res = {"path": args.path, "bytes": total, "device": torch.cuda.get_device_name(0),
           "cached_fraction": cached, "cpus": os.cpu_count(), "results": []}
    # cudaDevAttrHostRegisterSupported 99, cudaDevAttrHostRegisterReadOnlySupported 113,
    # cudaDevAttrPageableMemoryAccessUsesHostPageTables 100
    res["attr_host_register"] = cuda.attribute(99)
    res["attr_host_register_read_only"] = cuda.attribute(113)
    res["attr_pageable_uses_host_page_tables"] = cuda.attribute(100)
    print(f"# {args.path}: {len(files)} files, {total / 1e9:.2f} GB, {cached:.1%} cached; "
          f"{res['device']}; {os.cpu_count()} cpus; host register {res['attr_host_register']}, "
          f"read-only {res['attr_host_register_read_only']}", flush=True)

    def report(name, gbps, rates, **kw):
        line = f"{name:44s} {gbps:7.2f} GB/s  (runs {', '.join(f'{r:.2f}' for r in rates)})"
        if kw:
            line += "  " + " ".join(f"{k}={v}" for k, v in kw.items())
        print(line, flush=True)
        res["results"].append({"name": name, "gb_per_s": gbps, "runs": rates, **kw})

    # 1. host memory bandwidth and the PCIe limit
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
    b = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(2)
    g, r, _ = median_rate(lambda: b.copy_(a), n, args.repeats)
    report(f"memcpy pinned->pinned ({threads} threads)", g, r)
    torch.set_num_threads(1)
    g, r, _ = median_rate(lambda: b.copy_(a), n, args.repeats)
    report("memcpy pinned->pinned (1 thread)", g, r)
    torch.set_num_threads(threads)
    d = torch.empty(n, dtype=torch.uint8, device="cuda")

    def h2d():
        d.copy_(a, non_blocking=True)
        torch.cuda.synchronize()
    g, r, _ = median_rate(h2d, n, args.repeats)
    report("pinned h2d (1 GiB)", g, r)
    del b, d

    # 2. page cache -> pinned by pread, 8 MiB reads
    chunk = 8 * MiB
    work = windows(sizes, chunk)
    for t in ([8, 16] if args.quick else [1, 4, 8, 16]):
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(t)]
        views = [memoryview(x.numpy()) for x in bufs]
        fds = [os.open(f, os.O_RDONLY) for f in files]
        slots = Slots(t)

        def one(w):
            with slots.take() as k:
                i, off, ln = w
                got = os.preadv(fds[i], [views[k][:ln]], off)
                if got != ln:
                    raise OSError(f"short read {got} of {ln}")

        def run():
            with cf.ThreadPoolExecutor(t) as ex:
                list(ex.map(one, work))
        g, r, _ = median_rate(run, total, args.repeats)
        report(f"pread page cache->pinned ({t} threads)", g, r)
        for fd in fds:
            os.close(fd)
        del bufs, views

    # 3. device copies from the mappings: pageable (unregistered) and registered windows
    m = Mapped(files)
    max_window = 256 * MiB
    streams = [torch.cuda.Stream() for _ in range(16)]
    dev = [torch.empty(max_window, dtype=torch.uint8, device="cuda") for _ in range(16)]

    def device_pass(t, window, register, flags=8):
        work = windows(sizes, window)
        stats = {"register_s": 0.0, "copy_s": 0.0, "unregister_s": 0.0}
        slots = Slots(t)
        stats_lock = threading.Lock()

        def one(w):
            with slots.take() as k:
                i, off, ln = w
                addr = m.maps[i][0] + off
                s = streams[k].cuda_stream
                t0 = time.perf_counter()
                if register:
                    cuda.check(cuda.lib.cudaHostRegister(addr, ln, flags), "cudaHostRegister")
                t1 = time.perf_counter()
                cuda.check(cuda.lib.cudaMemcpyAsync(dev[k].data_ptr(), addr, ln, 1, s),
                           "cudaMemcpyAsync")
                cuda.check(cuda.lib.cudaStreamSynchronize(s), "cudaStreamSynchronize")
                t2 = time.perf_counter()
                if register:
                    cuda.check(cuda.lib.cudaHostUnregister(addr), "cudaHostUnregister")
                t3 = time.perf_counter()
                with stats_lock:
                    stats["register_s"] += t1 - t0
                    stats["copy_s"] += t2 - t1
                    stats["unregister_s"] += t3 - t2

        with cf.ThreadPoolExecutor(t) as ex:
            list(ex.map(one, work))
        return stats

    configs = []
    if args.quick:
        configs = [(1, 64 * MiB, False), (8, 64 * MiB, False),
                   (1, 64 * MiB, True), (4, 64 * MiB, True), (8, 64 * MiB, True)]
    else:
        for t in (1, 8):
            configs.append((t, 64 * MiB, False))
        for window in (16 * MiB, 64 * MiB, 256 * MiB):
            for t in (1, 8):
                configs.append((t, window, True))
        configs += [(4, 64 * MiB, True), (16, 64 * MiB, True)]
    for t, window, register in configs:
        name = (f"{'registered' if register else 'pageable'} mapping->device "
                f"({t} threads, {window // MiB} MiB)")
        try:
            g, r, st = median_rate(lambda: device_pass(t, window, register), total, args.repeats)
        except Exception as e:  # noqa: BLE001: a probe reports and goes on
            print(f"{name:44s} failed: {e}", flush=True)
            res["results"].append({"name": name, "error": str(e)})
            continue
        # per-thread seconds per GB of each step (summed over threads, divided by threads)
        per = {k: round(v / t / (total / 1e9), 4) for k, v in st.items()}
        report(name, g, r, **{f"{k}_per_GB": v for k, v in per.items()})
    m.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""device= in safe_open, load_file and Loader (docs/gpu.md, docs/python.md).

Without a GPU (CI): the error paths, and, against the fake CUDA runtime of the C++ tests
(libtensorferry_fake_cudart.so, selected with TENSORFERRY_CUDA_RUNTIME in a child process, since
the runtime is chosen once per process), what the core exports for a CUDA load: DLPack arrays whose
device is (kDLCUDA, index), whose bytes (copied back through the runtime) are the file's, and whose
device buffer is freed when the last array goes. With a GPU and a CUDA build of torch, the tests
marked `gpu` check real torch CUDA tensors against safetensors.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import ROOT, reference_slice

FAKE = os.environ.get("TENSORFERRY_FAKE_CUDA") or os.path.join(
    ROOT, "build", "release", "lib", "libtensorferry_fake_cudart.so")


def _torch_cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


gpu = pytest.mark.skipif(not _torch_cuda(), reason="needs torch with a CUDA device")
needs_fake = pytest.mark.skipif(not os.path.exists(FAKE),
                                reason=f"fake CUDA runtime not built ({FAKE})")


_PRELUDE = """
import json as _json, os as _os
def emit(obj):
    with open(_os.environ["TF_TEST_OUT"], "w") as _f:
        _f.write(_json.dumps(obj))
"""


def _run(code, env_extra):
    """Runs `code` in a child Python with `env_extra`; returns what it passed to emit() (written
    to a file: large results never depend on pipe buffering)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        env = dict(os.environ)
        env.update(env_extra)
        env["TF_TEST_OUT"] = out
        r = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert os.path.exists(out), f"the child emitted nothing; stderr: {r.stderr[-1000:]}"
        with open(out) as f:
            return json.load(f)


def _fake_env():
    return {"TENSORFERRY_CUDA_RUNTIME": FAKE, "TENSORFERRY_CUFILE_LIBRARY": FAKE}


@needs_fake
@pytest.mark.parametrize("gds", ["off", "auto"])
def test_core_exports_cuda_dlpack_arrays_with_the_file_bytes(tiny_checkpoint, gds):
    out = _run(f"""
        import ctypes, json, gc
        import tensorferry._core as core
        fake = ctypes.CDLL({FAKE!r})  # the same library the runtime search loads: shared state
        stats = (ctypes.c_uint64 * 32)()
        def device_bytes():
            fake.tf_fake_cuda_stats(stats)
            return stats[0]  # device_bytes_in_use
        ckpt = {tiny_checkpoint!r}
        r = core.Reader(ckpt, False, {{"device": "cuda:0", "gds": {gds!r},
                                       "staging_bytes": 1 << 20, "staging_slot": 1 << 18}})
        triples = r.load(None, 2)
        devices = sorted({{a.__dlpack_device__() for _, _, a in triples}})
        got = {{name: core.copy_to_host(a).hex() for name, _, a in triples}}
        held = device_bytes()
        st = r.stats()
        r.close()
        del r
        held_after_close = device_bytes()
        del triples
        gc.collect()
        emit({{"devices": devices, "got": got, "held": held,
              "held_after_close": held_after_close, "after": device_bytes(),
              "live": core.live_buffers()[0], "stats": st}})
    """, _fake_env())
    assert out["devices"] == [[2, 0]]  # kDLCUDA, device 0
    # The bytes in (fake) device memory are the file's, tensor by tensor.
    from safetensors import safe_open as st_open
    import glob
    want = {}
    for f in sorted(glob.glob(os.path.join(tiny_checkpoint, "*.safetensors"))):
        with st_open(f, "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k).contiguous().reshape(-1)
                import torch
                want[k] = t.view(torch.uint8).numpy().tobytes().hex() if t.numel() else ""
    assert out["got"] == want
    st = out["stats"]
    assert st["device"] == "cuda:0"
    assert st["device_bytes"] == sum(len(v) // 2 for v in want.values())
    assert st["staged_bytes"] + st["gds_bytes"] == st["device_bytes"]
    # Slots of 256 KiB pinned as the load needs them: at least one, at most the 1 MiB ring.
    assert 1 << 18 <= st["pinned_bytes"] <= 1 << 20 and st["pinned_bytes"] % (1 << 18) == 0
    assert out["held"] >= st["device_bytes"]
    # The arrays co-own the device buffer: closing the reader frees nothing, dropping them all
    # frees it.
    assert out["held_after_close"] == out["held"]
    assert out["after"] == 0
    assert out["live"] == 0


@needs_fake
def test_closed_loaders_leave_their_staging_ring_for_the_next(tiny_checkpoint):
    out = _run(f"""
        import ctypes, glob, os
        import tensorferry
        import tensorferry._core as core
        fake = ctypes.CDLL({FAKE!r})
        stats = (ctypes.c_uint64 * 32)()
        def pinned_live():
            fake.tf_fake_cuda_stats(stats)
            return stats[6]  # pinned_allocations_live
        opts = {{"device": "cuda:0", "gds": "off", "staging_bytes": 1 << 20,
                 "staging_slot": 1 << 18}}
        files = sorted(glob.glob(os.path.join({tiny_checkpoint!r}, "*.safetensors")))
        seen = []
        for f in files:  # a Reader per file, as load_file per shard
            r = core.Reader(f, True, opts)
            seen.append((pinned_live(), tensorferry.idle_staging_bytes()))
            r.load(None, 2)
            r.close()
        idle = tensorferry.idle_staging_bytes()
        released = tensorferry.release_idle_staging()
        r = core.Reader(files[0], True, dict(opts, keep_staging=False))
        r.load(None, 2)
        r.close()
        emit({{"seen": seen, "idle": idle, "released": released,
              "after": pinned_live(), "idle_after": tensorferry.idle_staging_bytes()}})
    """, _fake_env())
    seen = out["seen"]
    assert len(seen) >= 2
    # After the first Reader, each one takes the ring the last one left: nothing is idle while
    # it is open, and the ring keeps the slots the first load pinned.
    assert all(idle == 0 for _, idle in seen)
    assert all(live == seen[1][0] for live, _ in seen[1:])
    assert out["idle"] >= 1 << 18 and out["released"] == 1
    # keep_staging=False: the Reader frees its ring when it closes.
    assert out["after"] == 0 and out["idle_after"] == 0


@needs_fake
def test_loader_device_map_and_budget_against_the_fake(tiny_checkpoint):
    out = _run(f"""
        import json
        import tensorferry._core as core
        r = core.Reader({tiny_checkpoint!r}, False, {{
            "device": "cpu", "placement": [("model.layers.0", "cuda:0"), ("lm_head", "cuda:0")],
            "device_budget": 1 << 20, "staging_bytes": 1 << 20, "staging_slot": 1 << 18,
            "engine": "pread"}})
        where = {{}}
        for name, _, a in r.load(None, 2):
            where[name] = a.__dlpack_device__()
        stats = r.stats()
        batches = []
        it = r.iterate(None, 2)
        while (got := it.next()) is not None:
            index, count, nbytes, triples, device = got
            batches.append([device, sorted({{a.__dlpack_device__() for _, _, a in triples}})])
            del triples, got
        emit({{"where": where, "stats": stats, "options": r.options(), "batches": batches}})
    """, _fake_env())
    for name, dev in out["where"].items():
        on_gpu = name.startswith("model.layers.0.") or name.startswith("lm_head")
        assert dev == ([2, 0] if on_gpu else [1, 0]), name
    assert out["stats"]["device"] == "mixed"
    # Streamed: the host batch first, then the device's; each batch on one device, as it says.
    assert [b[0] for b in out["batches"]] == ["cpu", "cuda:0"]
    assert out["batches"][0][1] == [[1, 0]] and out["batches"][1][1] == [[2, 0]]
    assert out["stats"]["peak_device_bytes"] <= 1 << 20
    assert out["options"]["device_budget"] == 1 << 20


def test_no_cuda_runtime_is_a_clear_cuda_not_found_error(tiny_checkpoint):
    out = _run(f"""
        import json, tensorferry
        from tensorferry import safe_open, CudaNotFoundError, UnsupportedError
        files = sorted(__import__("glob").glob({tiny_checkpoint!r} + "/*.safetensors"))
        try:
            safe_open(files[0], "pt", device="cuda:0")
        except CudaNotFoundError as e:
            emit({{"message": str(e), "code": e.code,
                  "unsupported": isinstance(e, UnsupportedError),
                  "runtime": isinstance(e, RuntimeError)}})
    """, {"TENSORFERRY_CUDA_RUNTIME": "/nonexistent/libcudart.so.13"})
    assert "CUDA runtime (libcudart) not found" in out["message"]
    assert "/nonexistent/libcudart.so.13" in out["message"]
    assert out["code"] == "cuda_not_found"
    assert out["unsupported"] and out["runtime"]


@needs_fake
def test_missing_device_names_the_index(tiny_checkpoint):
    out = _run(f"""
        import json
        import tensorferry
        try:
            tensorferry.Loader({tiny_checkpoint!r}, device="cuda:3")
        except tensorferry.CudaNotFoundError as e:
            emit({{"message": str(e)}})
    """, _fake_env())
    assert "CUDA device 3 does not exist (1 device)" in out["message"]


def test_numpy_has_no_cuda(tiny_checkpoint):
    import tensorferry
    with pytest.raises(tensorferry.SafetensorError, match="numpy arrays live on the cpu"):
        tensorferry.Loader(tiny_checkpoint, device="cuda", framework="np")


@pytest.mark.skipif(_torch_cuda(), reason="checks the error where CUDA is not usable")
def test_without_a_gpu_device_cuda_raises_cuda_not_found(tiny_checkpoint):
    import glob
    import tensorferry
    from tensorferry.torch import load_file
    f = sorted(glob.glob(os.path.join(tiny_checkpoint, "*.safetensors")))[0]
    with pytest.raises(tensorferry.CudaNotFoundError) as e:
        load_file(f, device="cuda")
    # No runtime, or a runtime without a usable device (a driver too old for it, none at all).
    assert e.value.code in ("cuda_not_found", "cuda_no_device"), (e.value.code, str(e.value))
    assert str(e.value), "the error says why" 


# --- real GPU (skipped without one) ------------------------------------------------------------

@gpu
@pytest.mark.parametrize("gds", ["off", "auto"])
@pytest.mark.parametrize("staging", ["default", "4KiB slots"])
def test_gpu_load_file_matches_safetensors(tiny_checkpoint, gds, staging, monkeypatch):
    import glob
    import torch
    from safetensors.torch import load_file as st_load
    from tensorferry.torch import load_file
    if staging != "default":  # tensors larger than a slot, a ring that wraps many times per file
        monkeypatch.setenv("TENSORFERRY_STAGING_SLOT", "4KiB")
        monkeypatch.setenv("TENSORFERRY_STAGING_BYTES", "16KiB")
    os.environ["TENSORFERRY_GDS"] = gds
    try:
        for f in sorted(glob.glob(os.path.join(tiny_checkpoint, "*.safetensors"))):
            got = load_file(f, device="cuda:0")
            want = st_load(f, device="cuda:0")
            assert list(got) == list(want)
            for k in want:
                assert got[k].device == torch.device("cuda", 0)
                assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
                assert torch.equal(got[k], want[k]), k
    finally:
        del os.environ["TENSORFERRY_GDS"]


@gpu
def test_gpu_load_file_tensors_are_torchs_and_the_staging_ring_is_kept(tiny_checkpoint):
    import glob
    import torch
    import tensorferry
    from tensorferry.torch import load_file
    f = sorted(glob.glob(os.path.join(tiny_checkpoint, "*.safetensors")))[0]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    got = load_file(f, device="cuda:0")
    nbytes = sum(t.numel() * t.element_size() for t in got.values())
    # Allocated by torch (its caching allocator counts them), as safetensors' tensors are.
    assert torch.cuda.memory_allocated() - before >= nbytes > 0
    # The Loader's staging ring stays pinned for the next call (keep_staging).
    assert tensorferry.idle_staging_bytes() > 0
    del got
    assert torch.cuda.memory_allocated() == before
    with tensorferry.safe_open(f, "pt", device="cuda:0") as h:  # one tensor: the same
        name = max(h.keys(), key=lambda k: h.get_slice(k).get_shape())
        one = h.get_tensor(name)
        assert one.is_cuda and torch.cuda.memory_allocated() - before >= one.numel() > 0
    del one
    assert torch.cuda.memory_allocated() == before
    assert tensorferry.release_idle_staging() >= 1
    assert tensorferry.idle_staging_bytes() == 0


@gpu
def test_gpu_loader_shares_and_frees_the_device_buffer(tiny_checkpoint):
    import gc
    import torch
    import tensorferry
    from conftest import live_buffers
    gc.collect()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    with tensorferry.Loader(tiny_checkpoint, device="cuda", device_budget="64MB") as loader:
        tensors = loader.load()
        assert loader.stats.device == "cuda:0"
        assert loader.stats.peak_device_bytes <= 64 << 20
    assert all(t.is_cuda for t in tensors.values())
    assert live_buffers()[0] > 0
    del tensors
    assert live_buffers()[0] == 0
    torch.cuda.synchronize()
    # Our cudaMalloc is outside torch's caching allocator: the memory goes back to the device.
    assert torch.cuda.mem_get_info()[0] >= free0 - (2 << 20)


@gpu
def test_gpu_safe_open_get_tensor_and_slice(tiny_checkpoint):
    import glob
    import torch
    from safetensors import safe_open as st_open
    from tensorferry import safe_open
    f = sorted(glob.glob(os.path.join(tiny_checkpoint, "*.safetensors")))[0]
    with safe_open(f, "pt", device="cuda:0") as a, st_open(f, "pt", device="cuda:0") as b:
        for k in b.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k))
            assert a.get_tensor(k).device == torch.device("cuda", 0)
            if b.get_slice(k).get_shape():
                assert torch.equal(a.get_slice(k)[:1], b.get_slice(k)[:1])


# --- caller-provided destinations (host here; CUDA ones go through the same call) ----------------

def test_load_into_caller_arrays_checks_capacity_and_dtype(tiny_checkpoint):
    import tensorferry
    import torch
    from safetensors.torch import load_file as st_load
    import glob
    want = {}
    for f in sorted(glob.glob(os.path.join(tiny_checkpoint, "*.safetensors"))):
        want.update(st_load(f))
    names = [n for n in want if want[n].numel()][:4]
    with tensorferry.Loader(tiny_checkpoint) as loader:
        dst = {n: torch.full_like(want[n], 0) for n in names}
        loader.load_into(dst)
        for n in names:
            assert torch.equal(dst[n], want[n]), n
        assert loader.stats.tensors == len(names)
        # A larger destination: the tail is left untouched.
        n = names[0]
        big = torch.full((want[n].numel() + 3,), 7, dtype=want[n].dtype)
        loader.load_into({n: big[:want[n].numel()].view(want[n].shape)})
        assert torch.equal(big[want[n].numel():], torch.full((3,), 7, dtype=want[n].dtype))
        small = torch.empty(max(want[n].numel() - 1, 0), dtype=want[n].dtype)
        with pytest.raises(tensorferry.InvalidArgumentError, match=f'tensor "{n}" needs'):
            loader.load_into({n: small})
        with pytest.raises(tensorferry.InvalidArgumentError, match="in the file"):
            loader.load_into({n: torch.empty(want[n].shape, dtype=torch.float64)})
        with pytest.raises(tensorferry.SafetensorError):
            loader.load_into({"no.such.tensor": small})



def test_load_into_takes_arrays_and_tensors_whatever_the_framework(tmp_path):
    """A destination's own kind decides its dtype: NumPy arrays into a torch Loader, torch
    tensors into a NumPy one."""
    import tensorferry
    import tensorferry.numpy
    import torch
    path = str(tmp_path / "m.safetensors")
    want = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensorferry.numpy.save_file({"w": want}, path)
    for framework, dst in (("pt", np.zeros((4, 6), np.float32)),
                           ("np", torch.zeros((4, 6), dtype=torch.float32))):
        with tensorferry.Loader(path, framework=framework) as loader:
            loader.load_into({"w": dst})
        assert np.array_equal(np.asarray(dst), want), framework


@needs_fake
def test_loader_budget_is_the_device_budget_for_a_gpu_loader(tiny_checkpoint):
    out = _run(f"""
        import json, tensorferry
        with tensorferry.Loader({tiny_checkpoint!r}, device="cuda:0", budget="1MB") as a, \\
                tensorferry.Loader({tiny_checkpoint!r}, device="cuda:0", budget="1MB",
                                   device_budget="2MB") as b:
            emit({{"a": a.options, "b": b.options}})
    """, _fake_env())
    assert out["a"]["device"] == "cuda:0"
    assert out["a"]["device_budget"] == 1000000 and out["a"]["budget"] == 0
    assert out["b"]["device_budget"] == 2000000 and out["b"]["budget"] == 1000000


def test_tensorferry_device_variable_does_not_move_python_loads(tiny_checkpoint):
    # The Python APIs' device= defaults to the host; TENSORFERRY_DEVICE seeds only the C++/CLI
    # defaults, so it must not send a plain load_file to a GPU.
    out = _run(f"""
        import glob, tensorferry
        from tensorferry.torch import load_file
        f = sorted(glob.glob({tiny_checkpoint!r} + "/*.safetensors"))[0]
        t = load_file(f)
        with tensorferry.Loader({tiny_checkpoint!r}) as loader:
            got = loader.load()
            opts = loader.options
        emit({{"n": len(got), "tensors": len(t), "device": opts["device"],
              "types": sorted({{x.device.type for x in list(got.values()) + list(t.values())}})}})
    """, {"TENSORFERRY_DEVICE": "cuda:0", "TENSORFERRY_CUDA_RUNTIME": "/nonexistent/libcudart.so"})
    assert out["device"] == "cpu" and out["n"] > 0 and out["tensors"] > 0
    assert out["types"] == ["cpu"]


def test_an_invalid_tensorferry_device_is_refused_by_python_too(tiny_checkpoint):
    # Its value is not used there, but a typo in it is not let through quietly (as documented in
    # docs/runtime_settings.md): the error names the variable.
    out = _run(f"""
        import tensorferry
        try:
            tensorferry.Loader({tiny_checkpoint!r})
            emit({{"raised": None}})
        except tensorferry.InvalidArgumentError as e:
            emit({{"raised": str(e)}})
    """, {"TENSORFERRY_DEVICE": "cuda:zero"})
    assert out["raised"] and 'TENSORFERRY_DEVICE="cuda:zero"' in out["raised"], out


# --- tensor parallelism on the device (docs/gpu.md, "Tensor-parallel slices") ---------------

_TP_RULES = {"rules": [
    {"pattern": "rows.weight", "split": 0},
    {"pattern": "cols.weight", "split": 1},
    {"pattern": "deep.weight", "split": 2},
    {"pattern": "qkv.weight", "split": 0, "parts": [24, 8, 8]},
    {"pattern": "c_attn.weight", "split": 1, "equal_parts": 3},
    {"pattern": "*.bias", "replicate": True},
]}


def _tp_checkpoint(tmp_path):
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(7)
    tensors = {
        "rows.weight": torch.randn(37, 29, generator=g).to(torch.bfloat16),
        "cols.weight": torch.randn(24, 131, generator=g),
        "deep.weight": torch.randn(5, 9, 67, generator=g).to(torch.float16),
        "qkv.weight": torch.randn(40, 12, generator=g).to(torch.bfloat16),
        "c_attn.weight": torch.randn(10, 51, generator=g),
        "out.bias": torch.randn(24, generator=g),
    }
    path = str(tmp_path / "tp.safetensors")
    save_file(tensors, path)
    return path, tensors


@needs_fake
def test_tp_slices_land_on_the_device_byte_exact(tmp_path):
    """device="cuda" with tp_rank/tp_size: each rank's slices, copied back from (fake) device
    memory, equal torch.tensor_split of the full tensors and the host sliced load, for world sizes
    1, 2, 3, 4 and 8, through the core Reader and through tensorferry.Loader's options."""
    import torch
    path, tensors = _tp_checkpoint(tmp_path)
    out = _run(f"""
        import tensorferry, tensorferry._core as core
        rules = tensorferry.shard_spec({_TP_RULES!r})
        got = {{}}
        for world in (1, 2, 3, 4, 8):
            for rank in range(world):
                opts = {{"tp_rank": rank, "tp_size": world, "shard_rules": rules,
                         "staging_bytes": 1 << 16, "staging_slot": 1 << 13, "engine": "pread"}}
                dev = core.Reader({path!r}, False, dict(opts, device="cuda:0", gds="off"))
                host = core.Reader({path!r}, False, dict(opts, device="cpu"))
                d = {{n: (a.__dlpack_device__(), core.copy_to_host(a).hex())
                      for n, _, a in dev.load(None, 2)}}
                h = {{n: core.copy_to_host(a).hex() for n, _, a in host.load(None, 2)}}
                got[f"{{rank}}/{{world}}"] = {{"dev": d, "host": h, "stats": dev.stats()}}
                dev.close(); host.close()
        # tensorferry.Loader(device="cuda:0", tp_rank=, tp_size=): the options reach the core
        # and its reader loads the device slices (torch itself cannot wrap the fake's memory).
        with tensorferry.Loader({path!r}, device="cuda:0", tp_rank=1, tp_size=3,
                                shard_rules={_TP_RULES!r}) as loader:
            opts = {{k: loader.options[k] for k in ("device", "tp_rank", "tp_size")}}
            via_loader = {{n: core.copy_to_host(a).hex()
                           for n, _, a in loader._reader.load(None, 2)}}
        emit({{"got": got, "options": opts, "via_loader": via_loader}})
    """, _fake_env())
    rules = {"rows.weight": {"split": 0}, "cols.weight": {"split": 1},
             "deep.weight": {"split": 2}, "qkv.weight": {"split": 0, "parts": [24, 8, 8]},
             "c_attn.weight": {"split": 1, "equal_parts": 3}, "out.bias": {"replicate": True}}

    def hexbytes(t):
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()

    for key, entry in out["got"].items():
        rank, world = map(int, key.split("/"))
        assert set(entry["dev"]) == set(tensors), key
        want_total = 0
        for name, full in tensors.items():
            want = hexbytes(reference_slice(full, rules[name], rank, world))
            device, got = entry["dev"][name]
            assert device == [2, 0], (key, name)
            assert got == want, (key, name)
            assert entry["host"][name] == want, (key, name)
            want_total += len(want) // 2
        st = entry["stats"]
        assert st["device"] == "cuda:0" and st["device_bytes"] == want_total, key
    assert out["options"]["device"] == "cuda:0"
    assert out["options"]["tp_rank"] == 1 and out["options"]["tp_size"] == 3
    for name, full in tensors.items():
        assert out["via_loader"][name] == hexbytes(reference_slice(full, rules[name], 1, 3)), name


@gpu
def test_gpu_tp_load_file_matches_tensor_split(tmp_path):
    import torch
    from tensorferry.torch import load_file
    path, tensors = _tp_checkpoint(tmp_path)
    rules = {"rows.weight": {"split": 0}, "cols.weight": {"split": 1},
             "deep.weight": {"split": 2}, "qkv.weight": {"split": 0, "parts": [24, 8, 8]},
             "c_attn.weight": {"split": 1, "equal_parts": 3}, "out.bias": {"replicate": True}}
    for world in (1, 2, 3, 4, 8):
        for rank in range(world):
            got = load_file(path, device="cuda:0", tp_rank=rank, tp_size=world,
                            shard_rules=_TP_RULES)
            for name, full in tensors.items():
                want = reference_slice(full, rules[name], rank, world).to("cuda:0")
                assert got[name].device == torch.device("cuda", 0)
                assert torch.equal(got[name], want), (name, rank, world)

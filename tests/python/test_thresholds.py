"""Differential tests on both sides of every internal size threshold (issue 11).

A bug once slipped through because every test tensor was smaller than the sizes at which the code
switches paths (safe_open.get_tensor used another path from 2 x chunk_size on). Here each public
read call is compared byte for byte (type, dtype, shape and bytes) with the reference `safetensors`
package on tensors whose sizes and file offsets sit just below, at and just above:

  threshold                       value here                     where it matters
  ------------------------------  -----------------------------  ---------------------------------
  page / O_DIRECT alignment       4096 (sizes 4095/4096/4097,    direct="on", task ends, chunk
                                  offsets aligned and not)       clamp (chunk_size < 4096 -> 4096)
  chunk size                      64 KiB (Loader chunk_size=),   read tasks, staging-slot rows
                                  8 MiB (the default)
  2 x chunk size                  128 KiB (TENSORFERRY_CHUNK_    safe_open.get_tensor: heap read
                                  SIZE), 16 MiB (the default)    below, the Loader from it on
  budget / 2 and budget           1 MiB and 2 MiB budgets        batch sizes, oversized tensors,
                                                                 load() under a budget
  huge page                       2 MiB                          host batch buffers (THP rounding)
  staging slot                    64 KiB, 8 MiB (default)        device loads (fake CUDA runtime
                                                                 in a child process; real GPU)
  shard max gap / segment align   64 KiB / 256 KiB               tensor-parallel strided reads

Files are written by hand (write_file) so tensor offsets are chosen, not left to the writer's
sort: most start off any 4 KiB boundary, some exactly on one. The files mix dtypes (F32, BF16,
F16, F64, I8, U8, I16, I32, I64, BOOL; the small one also a scalar and an empty tensor); a 2-file
checkpoint with an index (written by safetensors) covers multi-file loads and the builtin shard
rules. Data is random bytes (NaN patterns included): comparisons are on bytes, never on float
values.
"""
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import safetensors
import safetensors.numpy as ref_np
import safetensors.torch as ref_pt
import torch
from conftest import ROOT, reference_slice

import tensorferry
import tensorferry.numpy as tf_np
import tensorferry.torch as tf_pt

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4096  # O_DIRECT alignment, kMinChunkSize
CHUNK = 64 * KiB  # the small chunk_size= given to Loaders (and TENSORFERRY_CHUNK_SIZE)
BUDGET = 1 * MiB  # budgets of 1 MiB and 2 MiB cross budget/2 and budget on the b.* and h.* tensors
HUGE = 2 * MiB  # transparent huge page: host buffers from 2 MiB on are rounded to whole ones
DEFAULT_CHUNK = 8 * MiB  # LoadOptions::chunk_size and ::staging_slot defaults
MAX_GAP = 64 * KiB  # default shard_max_gap

# safetensors dtype -> (numpy dtype of the raw data, torch dtype)
DTYPES = {
    "BOOL": (np.bool_, torch.bool), "U8": (np.uint8, torch.uint8), "I8": (np.int8, torch.int8),
    "I16": (np.int16, torch.int16), "I32": (np.int32, torch.int32),
    "I64": (np.int64, torch.int64), "F16": (np.float16, torch.float16),
    "BF16": (None, torch.bfloat16), "F32": (np.float32, torch.float32),
    "F64": (np.float64, torch.float64),
}
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "F16": 2, "BF16": 2,
            "F32": 4, "F64": 8}

ALIGN = "align-4096"  # write_file marker: the next tensor starts on a 4 KiB boundary of the file


# --- files ----------------------------------------------------------------------------------------

def write_file(path, entries, data_start, metadata=None, seed=0):
    """Writes a safetensors file with tensors in exactly this order, the data starting at byte
    `data_start` of the file (the header is padded with spaces, which the format allows).

    entries: (name, dtype, shape) or ALIGN. Multi-byte tensors are kept at offsets that are
    multiples of 8 (as every writer does) with a U8 "pad.N" tensor where needed; ALIGN inserts one
    that brings the next tensor to a multiple of 4096 of the file. Returns {name: (dtype, shape,
    absolute offset, nbytes)} in file order."""
    assert data_start % 8 == 0
    rng = np.random.default_rng(seed)
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    layout = {}
    blobs = []
    rel = 0
    pads = 0

    def add(name, dtype, shape):
        nonlocal rel
        n = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype] if shape else ITEMSIZE[dtype]
        if dtype == "BOOL":
            raw = rng.integers(0, 2, size=n, dtype=np.uint8)
        else:
            raw = rng.integers(0, 256, size=n, dtype=np.uint8)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [rel, rel + n]}
        layout[name] = (dtype, tuple(shape), data_start + rel, n)
        blobs.append(raw)
        rel += n

    def pad(n):
        nonlocal pads
        if n:
            add(f"pad.{pads}", "U8", (n,))
            pads += 1

    for entry in entries:
        if entry == ALIGN:
            pad(-(data_start + rel) % PAGE)
            continue
        name, dtype, shape = entry
        if ITEMSIZE[dtype] > 1:
            pad(-(data_start + rel) % 8)
        add(name, dtype, shape)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert 8 + len(text) <= data_start, "header larger than the room left for it"
    text += b" " * (data_start - 8 - len(text))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for raw in blobs:
            f.write(raw.tobytes())
    return layout


def _u8(name, n):
    return (name, "U8", (n,))


# Threshold-crossing tensors of moderate size (about 15 MiB in all): cheap to load many times.
SMALL_ENTRIES = [
    _u8("a.head", 3),  # everything after starts off any 8-byte boundary of the data
    ("s.f64_scalar", "F64", ()),
    ("s.f32_empty", "F32", (0, 4)),
    ("s.bool", "BOOL", (37, 3)),
    ("s.i8", "I8", (5, 7)),
    ("s.i16", "I16", (3, 5)),
    ("s.i32", "I32", (2, 9)),
    ("s.i64", "I64", (11,)),
    # 4 KiB: sizes 4095/4096/4097 at unaligned offsets, then aligned ones
    _u8("p.u8_4095", PAGE - 1),
    _u8("p.u8_4096", PAGE),
    _u8("p.u8_4097", PAGE + 1),
    ALIGN,
    ("p.f32_4096_aligned", "F32", (1024,)),
    ("p.bf16_4094", "BF16", (2047,)),
    ("p.f16_4098", "F16", (2049,)),
    ALIGN,
    _u8("p.u8_4097_aligned", PAGE + 1),
    ("p.i8_4096", "I8", (64, 64)),
    # 2 x the smallest chunk (4 KiB after clamping): get_tensor's switch at 8 KiB
    _u8("p.u8_8191", 2 * PAGE - 1),
    ("p.f32_8192", "F32", (2 * PAGE // 4,)),
    _u8("p.u8_8193", 2 * PAGE + 1),
    # the small chunk (64 KiB)
    _u8("c.u8_65535", CHUNK - 1),
    ("c.f32_65536", "F32", (128, 128)),
    _u8("c.u8_65537", CHUNK + 1),
    ALIGN,
    ("c.bf16_65536_aligned", "BF16", (256, 128)),
    # 2 x the small chunk (128 KiB): get_tensor's switch under TENSORFERRY_CHUNK_SIZE=64KiB
    _u8("c2.u8_131071", 2 * CHUNK - 1),
    ("c2.f32_131072", "F32", (256, 128)),
    ("c2.f16_131074", "F16", (2 * CHUNK // 2 + 1,)),
    # budget / 2 and budget for BUDGET = 1 MiB (and budget / 2 for 2 MiB)
    _u8("b.u8_524287", BUDGET // 2 - 1),
    ("b.f16_524288", "F16", (512, 512)),
    _u8("b.u8_524289", BUDGET // 2 + 1),
    _u8("b.u8_1048575", BUDGET - 1),
    ("b.bf16_1048576", "BF16", (512, 1024)),
    _u8("b.u8_1048577", BUDGET + 1),
    # the huge page (2 MiB), which is also the 2 MiB budget
    ("h.f32_2097148", "F32", (HUGE // 4 - 1,)),
    ("h.f32_2097152", "F32", (512, 1024)),
    ("h.f64_2097160", "F64", (HUGE // 8 + 1,)),
    _u8("h.u8_2097151", HUGE - 1),
    ALIGN,
    _u8("h.u8_2097153_aligned", HUGE + 1),
    ("z.bool_tail", "BOOL", (PAGE + 1,)),
]

# The default chunk (8 MiB) and get_tensor's switch at 2 x 8 MiB = 16 MiB (about 72 MiB in all).
# No BF16: numpy's load_file reads the whole file.
BIG_ENTRIES = [
    _u8("a.head", 5),
    ("s.i32", "I32", (3, 3)),
    _u8("k.u8_8388607", DEFAULT_CHUNK - 1),
    ("k.f32_8388608", "F32", (2048, 1024)),
    _u8("k.u8_8388609", DEFAULT_CHUNK + 1),
    ("m.f32_16777212", "F32", (4 * MiB - 1,)),  # 16 MiB - 4: one pread into a heap block
    ("m.f32_16777216", "F32", (1024, 4096)),  # 16 MiB: the Loader path
    ("m.f16_16777218", "F16", (8 * MiB + 1,)),  # just above
    ("z.bool", "BOOL", (7,)),
]

# Tensor-parallel slices: 2-D (and one 3-D) tensors only, so that "split 1" applies to all.
TP_ENTRIES = [
    _u8("a.head", 3),  # pad.* tensors (1-D) are replicated by every rule set below
    ("t.rows_f32", "F32", (37, 1000)),  # 148000 B > 2 x CHUNK; row 4000 B
    ("t.wide_f32", "F32", (8, 32768)),  # rows of 128 KiB: world 2 -> pieces and gaps of 64 KiB
    ("t.seg_f16", "F16", (4, 262147)),  # world 2 -> pieces of ~256 KiB (segment alignment)
    ("t.odd_u8", "U8", (7, 4097)),
    ("t.f16_3d", "F16", (6, 10, 131)),
    ("t.i8", "I8", (16, 4095)),
    ("t.bool", "BOOL", (5, 33)),
    ALIGN,
    ("t.f64_aligned", "F64", (12, 2049)),
    ("t.i64", "I64", (9, 7)),
]


def builtin_llama():
    """(shard file name, [(name, dtype, shape)]) of a 2-file checkpoint with LLaMA names."""
    return [
        ("model-00001-of-00002.safetensors", [
            ("model.embed_tokens.weight", "BF16", (300, 256)),  # 150 KiB > 2 x CHUNK
            ("model.layers.0.self_attn.q_proj.weight", "F32", (256, 256)),  # 256 KiB
            ("model.layers.0.self_attn.o_proj.weight", "F32", (256, 257)),  # split 1, uneven
            ("model.layers.0.input_layernorm.weight", "F32", (256,)),
        ]),
        ("model-00002-of-00002.safetensors", [
            ("model.layers.1.mlp.down_proj.weight", "F16", (256, 1025)),  # > BUDGET / 2
            ("model.layers.1.mlp.up_proj.weight", "F16", (1024, 256)),  # = BUDGET / 2
            ("model.layers.1.mlp.gate_proj.weight", "F16", (1023, 256)),  # < BUDGET / 2
            ("model.norm.weight", "F32", (256,)),
            ("lm_head.weight", "BF16", (300, 256)),
        ]),
    ]


def _torch_random(dtype, shape, rng):
    n = int(np.prod(shape)) if shape else 1
    if dtype == "BOOL":
        raw = rng.integers(0, 2, size=n, dtype=np.uint8)
    else:
        raw = rng.integers(0, 256, size=n * ITEMSIZE[dtype], dtype=np.uint8)
    return torch.from_numpy(raw).view(DTYPES[dtype][1]).reshape(shape).clone()


class Ckpt:
    """A written checkpoint and what the reference reads from it."""

    def __init__(self, path, layout, files):
        self.path = path
        self.layout = layout  # name -> (dtype, shape, absolute offset, nbytes), file order
        self.files = files  # the .safetensors files, in order
        self.names = list(layout)
        self.pt = {}
        for f in files:
            self.pt.update(ref_pt.load_file(f))
        self.np_names = [n for n in self.names if layout[n][0] != "BF16"]

    def np(self):
        out = {}
        for f in self.files:
            with safetensors.safe_open(f, "np") as h:
                for n in h.offset_keys():
                    if h.get_slice(n).get_dtype() != "BF16":
                        out[n] = h.get_tensor(n)
        return out

    def nbytes(self, names):
        return sum(self.layout[n][3] for n in names)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("thr") / "small.safetensors")
    layout = write_file(path, SMALL_ENTRIES, data_start=2 * PAGE + 24, seed=1,
                        metadata={"what": "thresholds", "chunk": str(CHUNK)})
    c = Ckpt(path, layout, [path])
    offsets = [off for _, _, off, n in layout.values() if n]
    assert any(o % PAGE for o in offsets) and any(o % PAGE == 0 for o in offsets)
    return c


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("thr") / "big.safetensors")
    layout = write_file(path, BIG_ENTRIES, data_start=PAGE + 40, seed=2, metadata={"m": "big"})
    assert all(off % PAGE for _, _, off, n in layout.values() if n)
    return Ckpt(path, layout, [path])


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("thr") / "tp.safetensors")
    layout = write_file(path, TP_ENTRIES, data_start=PAGE + 16, seed=3)
    return Ckpt(path, layout, [path])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Two shard files written by safetensors.torch.save_file plus model.safetensors.index.json."""
    d = tmp_path_factory.mktemp("thr") / "sharded"
    d.mkdir()
    rng = np.random.default_rng(4)
    weight_map, layout, files, total = {}, {}, [], 0
    for fname, entries in builtin_llama():
        tensors = {n: _torch_random(dt, shape, rng) for n, dt, shape in entries}
        path = str(d / fname)
        ref_pt.save_file(tensors, path, metadata={"format": "pt"})
        files.append(path)
        with safetensors.safe_open(path, "pt") as h:
            for n in h.offset_keys():
                t = tensors[n]
                st_dtype = next(k for k, v in DTYPES.items() if v[1] == t.dtype)
                layout[n] = (st_dtype, tuple(t.shape), None, t.numel() * t.element_size())
                weight_map[n] = fname
                total += t.numel() * t.element_size()
    with open(d / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return Ckpt(str(d), layout, files)


# --- comparisons ----------------------------------------------------------------------------------

def _bytes_view(x):
    """The bytes of a tensor or array as a one-dimensional numpy uint8 array (a view if it can)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().contiguous().reshape(-1)
        if t.numel() == 0:  # (an empty tensor's stride may forbid the view)
            return np.empty(0, dtype=np.uint8)
        if t.stride(-1) != 1:  # size-1 dims keep any stride through contiguous()
            t = torch.empty(t.numel(), dtype=t.dtype).copy_(t)
        return t.view(torch.uint8).numpy()
    a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    return a.view(np.uint8)


def _same_bytes(a, b):
    a, b = _bytes_view(a), _bytes_view(b)
    return a.shape == b.shape and np.array_equal(a, b)


def assert_same(got, want, what=""):
    """Same type, dtype, shape and bytes (NaN-safe)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), (what, type(got))
        assert got.device.type == "cpu", what
        assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
        assert tuple(got.shape) == tuple(want.shape), (what, tuple(got.shape), tuple(want.shape))
        assert _same_bytes(got, want), f"{what}: bytes differ"
    else:
        assert type(got) is type(want), (what, type(got), type(want))
        assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
        assert np.shape(got) == np.shape(want), (what, np.shape(got), np.shape(want))
        assert _same_bytes(got, want), f"{what}: bytes differ"


def assert_same_dict(got, want, what=""):
    assert list(got) == list(want), (what, list(got)[:5], list(want)[:5])
    for name in want:
        assert_same(got[name], want[name], f"{what}{name}")


def iterate_tensors(loader, want, what, hold):
    """Loader.iter_tensors() against `want`, in file order. hold=True: a plain for loop, which
    holds the previous tensor while asking for the next (guaranteed to fit when no tensor is
    larger than half the budget); hold=False: each tensor is dropped before the next is asked
    for (what a budget smaller than twice the largest tensor needs: batches of the whole budget,
    and a batch counts until its last tensor goes)."""
    seen = []
    if hold:
        for name, t in loader.iter_tensors():
            assert_same(t, want[name], f"{what}/{name}")
            seen.append(name)
        del t
    else:
        it = loader.iter_tensors()
        while True:
            try:
                name, t = next(it)
            except StopIteration:
                break
            assert_same(t, want[name], f"{what}/{name}")
            seen.append(name)
            del t
    assert seen == list(want), what


# Engines and direct I/O modes where they mean something (mmap reads through the page cache).
ENGINES = [("pread", "off"), ("pread", "on"), ("io_uring", "off"), ("io_uring", "on"),
           ("mmap", "off")]


def make_loader(path, engine, direct, **kwargs):
    try:
        return tensorferry.Loader(path, engine=engine, direct=direct, **kwargs)
    except tensorferry.UnsupportedError as e:
        if engine == "io_uring":
            pytest.skip(f"io_uring is not usable here: {e}")
        raise


def check_stats(loader, engine, direct, tensors, nbytes):
    st = loader.stats
    assert st.tensors == tensors and st.bytes == nbytes, (st.tensors, tensors, st.bytes, nbytes)
    if engine is not None:
        assert st.engine == engine
    if direct == "off" or engine == "mmap":
        assert st.direct_files == 0 and st.direct_bytes == 0
    elif direct == "on" and nbytes:
        # O_DIRECT where the file system takes it, else a reported buffered fallback.
        assert st.direct_files + st.buffered_files >= 1
        assert st.direct_bytes <= st.bytes_read


# --- safe_open ---------------------------------------------------------------------------------

BACKENDS = [None, "pread", "io_uring", "mmap"]


def _get_tensor_fresh(path, fw, backend, name):
    """get_tensor(name) on a freshly opened file, and whether it went through the Loader (the
    path from 2 x chunk_size on: the reader's load statistics then show that one tensor; the
    heap-block path below leaves them empty)."""
    with tensorferry.safe_open(path, fw, backend=backend) as f:
        t = f.get_tensor(name)
        st = f._reader.stats()
    via_loader = st["tensors"] == 1
    assert st["tensors"] in (0, 1) and st["bytes"] == (t.nbytes if via_loader else 0)
    return t, via_loader


@pytest.mark.parametrize("backend", BACKENDS)
def test_safe_open_big_get_tensor_around_2x_default_chunk(big, backend):
    """get_tensor below 16 MiB (one pread into a heap block), at and above (the Loader), in both
    frameworks, with every backend; keys/offset_keys/metadata/get_tensors too."""
    want_np = big.np()
    with safetensors.safe_open(big.path, "pt") as ref:
        ref_keys, ref_offset_keys, ref_meta = ref.keys(), ref.offset_keys(), ref.metadata()
    paths = {}
    for fw, want in (("pt", big.pt), ("np", want_np)):
        for name in big.names:
            t, paths[name] = _get_tensor_fresh(big.path, fw, backend, name)
            assert_same(t, want[name], f"{fw}/{backend}/{name}")
            assert paths[name] == (big.layout[name][3] >= 2 * DEFAULT_CHUNK), (fw, name)
            del t
        with tensorferry.safe_open(big.path, fw, backend=backend) as f:
            assert f.keys() == ref_keys
            assert f.offset_keys() == ref_offset_keys == big.names
            assert f.metadata() == ref_meta == {"m": "big"}
            if backend in (None, "pread"):
                assert_same_dict(f.get_tensors(), want, f"{fw}/{backend}/get_tensors/")
    # Both sides of the switch were taken: 16 MiB - 4 by the heap read, 16 MiB by the Loader.
    assert not paths["m.f32_16777212"] and paths["m.f32_16777216"] and paths["m.f16_16777218"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_safe_open_small_every_threshold_tensor(small, backend):
    want_np = small.np()
    with safetensors.safe_open(small.path, "pt") as ref:
        ref_keys, ref_meta = ref.keys(), ref.metadata()
    for fw, want in (("pt", small.pt), ("np", want_np)):
        with tensorferry.safe_open(small.path, fw, backend=backend) as f:
            assert f.keys() == ref_keys and f.offset_keys() == small.names
            assert f.metadata() == ref_meta
            for name in want:
                assert_same(f.get_tensor(name), want[name], f"{fw}/{backend}/{name}")
            if fw == "np":
                with pytest.raises(tensorferry.UnsupportedDTypeError):
                    f.get_tensor("p.bf16_4094")
            else:
                assert_same_dict(f.get_tensors(), small.pt, f"{backend}/get_tensors/")


@pytest.mark.parametrize("chunk", ["4KiB", "65536"])
def test_safe_open_get_tensor_switch_with_a_small_chunk(small, monkeypatch, chunk):
    """TENSORFERRY_CHUNK_SIZE moves get_tensor's switch (2 x chunk) down: 8 KiB / 128 KiB, crossed
    by p.* and c2.* tensors; checked with every backend (the Loader path uses it)."""
    monkeypatch.setenv("TENSORFERRY_CHUNK_SIZE", chunk)
    names = [n for n in small.names if n.startswith(("p.", "c.", "c2.", "s."))]
    switch = 2 * (4096 if chunk == "4KiB" else CHUNK)
    sizes = [small.layout[n][3] for n in names]
    assert min(sizes) < switch <= max(sizes) and switch in sizes
    for backend in BACKENDS:
        for fw in ("pt", "np"):
            with safetensors.safe_open(small.path, fw) as ref:
                for name in names:
                    if fw == "np" and small.layout[name][0] == "BF16":
                        continue
                    t, via_loader = _get_tensor_fresh(small.path, fw, backend, name)
                    assert_same(t, ref.get_tensor(name), f"{chunk}/{fw}/{backend}/{name}")
                    assert via_loader == (small.layout[name][3] >= switch), (chunk, name)


def _random_index(rng, shape, negative_steps):
    items = []
    for d in range(rng.randint(1, len(shape))):
        n = shape[d]
        if rng.random() < 0.25:
            items.append(rng.randrange(-n, n))  # an integer, negative ones too
            continue
        def bound():
            return rng.choice([None, rng.randrange(-n, n + 1), rng.randrange(0, n + 1)])
        steps = [None, 1, 2, 3, 7, 4096] + ([-1, -3] if negative_steps else [])
        items.append(slice(bound(), bound(), rng.choice(steps)))
    if len(items) == 1 and rng.random() < 0.5:
        return items[0]
    return tuple(items)


def _boundary_indices(shape, whole=True):
    """Indices whose byte ranges start or end on either side of 4 KiB and chunk boundaries."""
    n = shape[0]
    out = [0, -1, n // 2, slice(-2, None)]
    if whole:
        out += [slice(None), slice(1, None), slice(None, -1)]
    for edge in (PAGE, CHUNK, HUGE, DEFAULT_CHUNK):
        # rows of dim 0 (in elements: byte edges fall at itemsize times these)
        e = edge // max(1, int(np.prod(shape[1:], dtype=np.int64)))
        if 1 < e < n:
            out += [slice(e - 1, e + 1), slice(e, None), slice(None, e), slice(e - 1, None, 3)]
    return out


def _check_slices(ours, ref, name, indices, full):
    checked = 0
    sl_ours, sl_ref = ours.get_slice(name), ref.get_slice(name)
    assert sl_ours.get_shape() == sl_ref.get_shape()
    assert sl_ours.get_dtype() == sl_ref.get_dtype()
    for index in indices:
        want = full[index]
        got = sl_ours[index]
        if isinstance(want, np.generic):  # NumPy gives a scalar for integers alone, as do we
            assert type(got) is type(want) and _bytes_view(got).tobytes() == \
                _bytes_view(want).tobytes(), (name, index)
        else:
            assert_same(got, want, f"{name}[{index}]")
        try:
            ref_got = sl_ref[index]
        except BaseException as e:  # noqa: BLE001 - the reference's slicing lacks some index
            if isinstance(e, (KeyboardInterrupt, SystemExit)):  # forms (numpy: negative steps
                raise  # and bounds), and panics on some (pyo3 PanicException: BaseException)
            continue
        if isinstance(ref_got, np.ndarray):
            assert _same_bytes(ref_got, got), (name, index)
            assert np.shape(ref_got) == np.shape(got)
        else:
            assert_same(got, ref_got, f"ref {name}[{index}]")
        checked += 1
    return checked


@pytest.mark.parametrize("fw", ["pt", "np"])
def test_get_slice_around_thresholds(small, big, fw):
    """get_slice(name)[index] == full[index] (and == the reference's get_slice where it answers)
    on the threshold tensors, with random indices (steps, negative indices, integers on dim 0)
    and indices whose byte ranges cross 4 KiB / chunk / huge-page boundaries."""
    rng = random.Random(17 if fw == "pt" else 18)
    compared = 0
    for ckpt in (small, big):
        with tensorferry.safe_open(ckpt.path, fw) as ours, \
                safetensors.safe_open(ckpt.path, fw) as ref:
            for name in ckpt.names:
                dtype, shape = ckpt.layout[name][:2]
                if fw == "np" and dtype == "BF16":
                    continue
                full = ref.get_tensor(name)
                if not shape or 0 in shape:
                    indices = [(), Ellipsis] if not shape else [slice(None), (Ellipsis, 1)]
                    for index in indices:
                        assert_same(ours.get_slice(name)[index], full[index], f"{name}[{index}]")
                    continue
                count = 3 if ckpt is big else 6
                indices = _boundary_indices(shape, whole=ckpt is small) + [
                    _random_index(rng, shape, negative_steps=fw == "np") for _ in range(count)]
                compared += _check_slices(ours, ref, name, indices, full)
                del full
    assert compared > 200  # the reference answered most of them


# --- load_file ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", [None, "pread", "io_uring", "mmap"])
def test_load_file_torch_and_numpy(small, big, backend):
    for ckpt in (small, big):
        got = tf_pt.load_file(ckpt.path, backend=backend)
        assert_same_dict(got, ref_pt.load_file(ckpt.path), f"pt/{backend}/")
        del got
    got = tf_np.load_file(big.path, backend=backend)
    assert_same_dict(got, ref_np.load_file(big.path), f"np/{backend}/")
    del got
    # BF16 in the file: both refuse numpy, tensorferry naming the tensor, before reading.
    with pytest.raises(Exception):
        ref_np.load_file(small.path)
    with pytest.raises(tensorferry.UnsupportedDTypeError, match="BF16"):
        tf_np.load_file(small.path, backend=backend)


# --- Loader: engines, direct I/O, chunk sizes, budgets --------------------------------------------

@pytest.mark.parametrize("engine,direct", ENGINES + [(None, None)])
def test_loader_small_chunk_every_call(small, engine, direct):
    """chunk_size=64 KiB: load(), iter_tensors(), iter_batches(), load_into() (torch and numpy
    destinations) and a second load() (pooled buffers reused), each against the reference."""
    names = small.names
    with make_loader(small.path, engine, direct, chunk_size=CHUNK) as loader:
        assert loader.keys() == names and len(loader) == len(names)
        assert loader.total_bytes == small.nbytes(names)
        assert loader.metadata() == {"what": "thresholds", "chunk": str(CHUNK)}
        for attempt in range(2):
            got = loader.load()
            assert_same_dict(got, small.pt, f"load#{attempt}/")
            check_stats(loader, engine, direct, len(names), small.nbytes(names))
            del got
        assert loader.options["chunk_size"] == CHUNK
        iterate_tensors(loader, small.pt, "iter", hold=True)  # unbounded
        streamed = []

        def on_batch(batch):
            for n, t in batch.tensors.items():
                assert_same(t, small.pt[n], f"stream/{n}")
                streamed.append(n)

        loader.stream(on_batch)
        assert streamed == names
        check_stats(loader, engine, direct, len(names), small.nbytes(names))
        # load_into: destinations full of a sentinel, every byte must be overwritten.
        dst = {n: torch.full_like(w, 0xA5 if w.dtype == torch.uint8 else 1)
               for n, w in small.pt.items()}
        loader.load_into(dst)
        assert_same_dict(dst, small.pt, "load_into/")
        check_stats(loader, engine, direct, len(names), small.nbytes(names))
    want_np = small.np()
    with make_loader(small.path, engine, direct, chunk_size=CHUNK, framework="np",
                     select=small.np_names) as loader:
        assert_same_dict(loader.load(), want_np, "np load/")
        dst = {n: np.zeros_like(w) for n, w in want_np.items()}
        loader.load_into(dst)
        assert_same_dict(dst, want_np, "np load_into/")


@pytest.mark.parametrize("engine,direct", ENGINES)
def test_loader_default_chunk_big(big, engine, direct):
    """The default 8 MiB chunk: tensors of 8 MiB - 1 / 8 MiB / 8 MiB + 1 and around 16 MiB are cut
    into 1, 2 and 3 read tasks."""
    with make_loader(big.path, engine, direct) as loader:
        assert loader.options["chunk_size"] == DEFAULT_CHUNK
        got = loader.load()
        assert_same_dict(got, big.pt, f"{engine}/{direct}/")
        check_stats(loader, engine, direct, len(big.names), big.nbytes(big.names))
        del got
        if engine == "pread":
            names = ["m.f32_16777216", "k.u8_8388609"]
            dst = {n: torch.empty_like(big.pt[n]) for n in names}
            loader.load_into(dst)
            for n in names:
                assert_same(dst[n], big.pt[n], f"load_into/{n}")


@pytest.mark.parametrize("chunk_size", [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE - 1])
@pytest.mark.parametrize("engine,direct", [("pread", "on"), ("io_uring", "on"), ("pread", "off")])
def test_loader_chunk_sizes_around_the_page(small, chunk_size, engine, direct):
    """chunk_size below 4096 is clamped to 4096; chunks that are not multiples of 4096 must still
    give exact bytes with O_DIRECT (tasks end on 4 KiB boundaries of the file)."""
    names = [n for n in small.names if n.startswith(("s.", "p.", "c.", "a."))]
    want = {n: small.pt[n] for n in names}
    with make_loader(small.path, engine, direct, chunk_size=chunk_size, select=names) as loader:
        assert_same_dict(loader.load(), want, f"chunk {chunk_size}/")
        check_stats(loader, engine, direct, len(names), small.nbytes(names))
        seen = 0
        for name, t in loader.iter_tensors():
            assert_same(t, want[name], f"iter chunk {chunk_size}/{name}")
            seen += 1
        assert seen == len(names)


@pytest.mark.parametrize("queue_depth,threads", [(1, 1), (2, 3), (4096, 1), (5000, 2)])
def test_loader_io_uring_queue_depth_and_threads(small, queue_depth, threads):
    """4 KiB tasks (~150 of them) against io_uring rings of 1, 2 and 4096 entries (5000: clamped
    to 4096) on 1 to 3 workers, with O_DIRECT."""
    names = [n for n in small.names if n.startswith(("s.", "p.", "c.", "a."))]
    want = {n: small.pt[n] for n in names}
    with make_loader(small.path, "io_uring", "on", chunk_size=PAGE, select=names,
                     queue_depth=queue_depth, threads=threads) as loader:
        assert_same_dict(loader.load(), want, f"qd {queue_depth}/{threads}/")
        check_stats(loader, "io_uring", "on", len(names), small.nbytes(names))


def _iterate_and_check(loader, want, budget, what):
    """iter_batches under `budget`: every tensor equals the reference, once, in file order but for
    a smaller batch delivered between two tensors that went alone and would pass the budget
    together, and no batch is larger than the plan allows (half the budget, or all of it when a
    tensor exceeds half)."""
    names, batches = [], []
    largest = max(t.numel() * t.element_size() for t in want.values())
    limit = budget // 2 if largest <= budget // 2 else budget
    for batch in loader.iter_batches():
        assert batch.bytes == sum(t.nbytes for t in batch.tensors.values())
        oversized = [n for n, t in batch.tensors.items() if t.nbytes > budget]
        if oversized:
            assert batch.count >= 1 and len(batch.tensors) == 1, (what, oversized)
        else:
            assert batch.bytes <= limit, (what, batch.index, batch.bytes, limit)
        for name, t in batch.tensors.items():
            assert_same(t, want[name], f"{what}/{name}")
            names.append(name)
        batches.append((list(batch.tensors), batch.bytes))
        del batch, t
    order = {n: i for i, n in enumerate(want)}
    assert sorted(names, key=order.__getitem__) == list(want), what
    alone = budget - largest  # a batch over this holds one tensor that went alone
    for i in range(1, len(batches)):
        (prev, _), (cur, cur_bytes) = batches[i - 1], batches[i]
        if order[cur[0]] > order[prev[-1]]:
            continue
        # `cur` went alone and comes after the batch that was put before it, itself after
        # another tensor that went alone: the two would have passed the budget together.
        assert i >= 2 and len(cur) == 1 and cur_bytes > alone, (what, i, cur)
        first, first_bytes = batches[i - 2]
        assert len(first) == 1 and first_bytes > alone and first_bytes + cur_bytes > budget, \
            (what, i, first, cur)
    return names


@pytest.mark.parametrize("engine,direct", ENGINES)
def test_loader_budgets_cross_half_and_whole(small, engine, direct):
    """Budgets of 1 MiB and 2 MiB against tensors of budget/2 - 1, budget/2, budget/2 + 1,
    budget - 1, budget, budget + 1 (oversized: refused, or alone with allow_oversized)."""
    for budget in (BUDGET, 2 * BUDGET):
        fits = [n for n in small.names if small.layout[n][3] <= budget]
        with make_loader(small.path, engine, direct, chunk_size=CHUNK, budget=budget,
                         select=fits) as loader:
            _iterate_and_check(loader, {n: small.pt[n] for n in fits}, budget, f"{budget}")
            st = loader.stats
            assert st.tensors == len(fits) and st.bytes == small.nbytes(fits)
            if engine != "mmap":
                assert 0 < st.peak_budget_bytes <= budget
            assert st.batches >= 2
            iterate_tensors(loader, {n: small.pt[n] for n in fits}, f"iter_tensors {budget}",
                            hold=False)
        # Tensors up to half the budget: a for loop holding the previous tensor never blocks.
        half = [n for n in small.names if small.layout[n][3] <= budget // 2]
        assert any(small.layout[n][3] == budget // 2 for n in half)
        with make_loader(small.path, engine, direct, chunk_size=CHUNK, budget=budget,
                         select=half) as loader:
            iterate_tensors(loader, {n: small.pt[n] for n in half}, f"half {budget}", hold=True)
            assert loader.stats.batches >= 2
        # Just over the budget: refused without allow_oversized (naming the tensor) ...
        over = next(n for n in small.names if small.layout[n][3] == budget + 1)
        with pytest.raises(tensorferry.BudgetExceededError, match=over):
            with make_loader(small.path, engine, direct, chunk_size=CHUNK, budget=budget,
                             select=[over] + fits[:3]) as loader:
                for _ in loader.iter_tensors():
                    pass
        # ... and loaded alone with it; everything in the file, huge pages included.
        with make_loader(small.path, engine, direct, chunk_size=CHUNK, budget=budget,
                         allow_oversized=True) as loader:
            _iterate_and_check(loader, small.pt, budget, f"oversized {budget}")
            assert loader.stats.tensors == len(small.names)
            # load_into fills memory the caller owns: the budget does not limit it.
            dst = {n: torch.empty_like(t) for n, t in small.pt.items()}
            loader.load_into(dst)
            assert_same_dict(dst, small.pt, f"load_into {budget}/")
        # A tensor of exactly the budget, alone: load() fits it.
        exact = next(n for n in small.names if small.layout[n][3] == budget)
        with make_loader(small.path, engine, direct, chunk_size=CHUNK, budget=budget,
                         select=[exact]) as loader:
            assert_same_dict(loader.load(), {exact: small.pt[exact]}, f"exact {budget}/")


@pytest.mark.parametrize("engine,direct", [("pread", "off"), ("io_uring", "on"), ("mmap", "off")])
def test_loader_load_under_a_budget_at_and_below_the_total(small, engine, direct):
    """load() must fit the budget as a whole: exactly the total loads, one byte less does not."""
    names = [n for n in small.names if n.startswith(("p.", "c.", "b.u8_5"))]
    want = {n: small.pt[n] for n in names}
    total = small.nbytes(names)
    with make_loader(small.path, engine, direct, chunk_size=CHUNK, budget=total,
                     select=names) as loader:
        assert_same_dict(loader.load(), want, "budget=total/")
        assert loader.stats.peak_budget_bytes <= total
    if engine == "mmap":
        return  # the mmap engine holds no memory of its own: the budget only shapes batches
    with make_loader(small.path, engine, direct, chunk_size=CHUNK, budget=total - 1,
                     select=names) as loader:
        with pytest.raises(tensorferry.BudgetExceededError):
            loader.load()


@pytest.mark.parametrize("budget", [2 * DEFAULT_CHUNK, 4 * DEFAULT_CHUNK])
def test_loader_big_budget_iteration(big, budget):
    """16 MiB and 32 MiB budgets with the default chunk: the 16 MiB tensors are at / around the
    budget or its half."""
    with make_loader(big.path, "pread", "off", budget=budget, allow_oversized=True) as loader:
        _iterate_and_check(loader, big.pt, budget, f"big {budget}")
        assert loader.stats.tensors == len(big.names)


# --- multi-file checkpoint ------------------------------------------------------------------------

@pytest.mark.parametrize("engine,direct", ENGINES + [(None, None)])
def test_sharded_checkpoint_directory_and_index(sharded, engine, direct):
    index = os.path.join(sharded.path, "model.safetensors.index.json")
    total = sharded.nbytes(sharded.names)
    for where in (sharded.path, index):
        with make_loader(where, engine, direct, chunk_size=CHUNK) as loader:
            assert loader.keys() == sharded.names
            assert [os.path.basename(f) for f in loader.files] == \
                [os.path.basename(f) for f in sharded.files]
            assert loader.total_bytes == total
            assert loader.metadata()["total_size"] == str(total)
            assert_same_dict(loader.load(), sharded.pt, f"{where}/")
            check_stats(loader, engine, direct, len(sharded.names), total)
        budget = BUDGET  # the down/up/gate projections sit around budget / 2
        with make_loader(where, engine, direct, chunk_size=CHUNK, budget=budget) as loader:
            _iterate_and_check(loader, sharded.pt, budget, f"{where} budget/")
            dst = {n: torch.empty_like(t) for n, t in sharded.pt.items()}
            loader.load_into(dst)
            assert_same_dict(dst, sharded.pt, "load_into/")
    for f in sharded.files:
        with tensorferry.safe_open(f, "pt") as ours, safetensors.safe_open(f, "pt") as ref:
            assert ours.keys() == ref.keys() and ours.metadata() == ref.metadata()


# --- tensor parallelism --------------------------------------------------------------------------

RULES_SPLIT1 = {"rules": [{"pattern": "pad.*", "replicate": True},
                          {"pattern": "a.*", "replicate": True},
                          {"pattern": "*", "split": 1}]}
RULES_SPLIT0 = [("pad.*", None), ("a.*", None), ("*", 0)]  # the (pattern, rule) list form


def _rule(rules, name):
    if name.startswith(("pad.", "a.")):
        return {"replicate": True}
    return {"split": 1} if rules is RULES_SPLIT1 else {"split": 0}


def _tp_want(ckpt, rules, rank, world, rule_of=None):
    out = {}
    for name in ckpt.names:
        rule = rule_of(name) if rule_of else _rule(rules, name)
        out[name] = reference_slice(ckpt.pt[name], rule, rank, world).contiguous()
    return out


@pytest.mark.parametrize("engine,direct", ENGINES)
def test_tp_slices_every_engine(tp, engine, direct):
    """Loader(tp_rank, tp_size, shard_rules) == torch.tensor_split of the reference tensor, for
    splits of dim 1 (strided reads) and dim 0 (contiguous), worlds 2 and 3, every rank."""
    for rules in (RULES_SPLIT1, RULES_SPLIT0):
        for world in (2, 3):
            for rank in range(world):
                want = _tp_want(tp, rules, rank, world)
                local = sum(t.nbytes for t in want.values())
                with make_loader(tp.path, engine, direct, chunk_size=CHUNK, tp_rank=rank,
                                 tp_size=world, shard_rules=rules) as loader:
                    what = f"{engine}/{direct}/{'s1' if rules is RULES_SPLIT1 else 's0'}/" \
                           f"{rank}of{world}/"
                    assert loader.total_bytes == local
                    got = loader.load()
                    assert_same_dict(got, want, what)
                    check_stats(loader, engine, direct, len(want), local)
                    del got
                    if rules is RULES_SPLIT1:
                        dst = {n: torch.empty_like(t) for n, t in want.items()}
                        loader.load_into(dst)
                        assert_same_dict(dst, want, "load_into/" + what)


@pytest.mark.parametrize("engine,direct", [("pread", "off"), ("io_uring", "on")])
def test_tp_shard_max_gap_around_64k(tp, engine, direct):
    """t.wide_f32 rows are 128 KiB: with world 2 the gap between a rank's pieces is exactly 64 KiB,
    read and discarded when max_gap >= 64 KiB (7 gaps more read than with 64 KiB - 1); world 3
    leaves gaps of ~85 KiB, beyond all three. max_gap=0 reads exact strides."""
    rows = tp.layout["t.wide_f32"][1][0]
    assert tp.layout["t.wide_f32"][1][1] * 4 == 2 * MAX_GAP
    for world in (2, 3):
        for rank in range(world):
            want = _tp_want(tp, RULES_SPLIT1, rank, world)
            local = sum(t.nbytes for t in want.values())
            read = {}
            for max_gap in (0, MAX_GAP - 1, MAX_GAP, MAX_GAP + 1, None):
                with make_loader(tp.path, engine, direct, chunk_size=CHUNK, tp_rank=rank,
                                 tp_size=world, shard_rules=RULES_SPLIT1,
                                 shard_max_gap=max_gap) as loader:
                    assert_same_dict(loader.load(), want, f"gap {max_gap}/{rank}of{world}/")
                    assert loader.stats.bytes == local
                    read[max_gap] = loader.stats.bytes_read
            what = (rank, world, read, local)
            assert read[0] == local, what  # exact strides
            assert read[MAX_GAP - 1] > local, what  # the small gaps of the other tensors
            extra = (rows - 1) * MAX_GAP if world == 2 else 0
            assert read[MAX_GAP] == read[MAX_GAP + 1] == read[MAX_GAP - 1] + extra, what
            if direct == "off":
                assert read[None] == local, what  # a cached file: exact strides by default


@pytest.mark.parametrize("engine", ["pread", "mmap"])
def test_tp_under_a_budget(tp, engine):
    budget = BUDGET
    for world in (2, 3):
        for rank in range(world):
            want = _tp_want(tp, RULES_SPLIT1, rank, world)
            with make_loader(tp.path, engine, "off", chunk_size=CHUNK, budget=budget,
                             allow_oversized=True, tp_rank=rank, tp_size=world,
                             shard_rules=RULES_SPLIT1) as loader:
                iterate_tensors(loader, want, f"tp budget {rank}/{world}", hold=False)


def test_tp_load_file_torch_and_numpy(tp):
    for world in (2, 3):
        for rank in range(world):
            for rules in (RULES_SPLIT1, RULES_SPLIT0):
                want = _tp_want(tp, rules, rank, world)
                got = tf_pt.load_file(tp.path, tp_rank=rank, tp_size=world, shard_rules=rules)
                assert_same_dict(got, want, f"pt load_file {rank}/{world}/")
                got = tf_np.load_file(tp.path, tp_rank=rank, tp_size=world, shard_rules=rules)
                assert_same_dict(got, {n: t.numpy() for n, t in want.items()},
                                 f"np load_file {rank}/{world}/")


@pytest.mark.parametrize("engine,direct", [("pread", "on"), ("io_uring", "off"), ("mmap", "off")])
def test_tp_builtin_rules_on_the_sharded_checkpoint(sharded, engine, direct):
    spec = tensorferry.shard_spec("builtin")
    assert spec.rule_for("model.layers.0.self_attn.q_proj.weight") == {"split": 0}
    assert spec.rule_for("model.layers.0.self_attn.o_proj.weight") == {"split": 1}
    assert spec.rule_for("model.layers.1.mlp.down_proj.weight") == {"split": 1}
    assert spec.rule_for("model.norm.weight") == {"replicate": True}
    for world in (2, 3):
        for rank in range(world):
            want = _tp_want(sharded, None, rank, world, rule_of=spec.rule_for)
            with make_loader(sharded.path, engine, direct, chunk_size=CHUNK, tp_rank=rank,
                             tp_size=world, shard_rules="builtin") as loader:
                assert_same_dict(loader.load(), want, f"builtin {rank}/{world}/")
            with make_loader(sharded.path, engine, direct, chunk_size=CHUNK, tp_rank=rank,
                             tp_size=world, shard_rules="builtin", budget=BUDGET // 2,
                             allow_oversized=True) as loader:
                iterate_tensors(loader, want, f"builtin budget {rank}/{world}", hold=False)


# --- devices -------------------------------------------------------------------------------------

FAKE = os.environ.get("TENSORFERRY_FAKE_CUDA") or os.path.join(
    ROOT, "build", "release", "lib", "libtensorferry_fake_cudart.so")
needs_fake = pytest.mark.skipif(not os.path.exists(FAKE),
                                reason=f"fake CUDA runtime not built ({FAKE})")

# Helpers of the child process: device loads through the core Reader (torch cannot wrap the fake
# runtime's memory), each tensor's device bytes copied back and hashed.
_CHILD = """
import hashlib, json, os
import tensorferry, tensorferry._core as core

def _open(path, opts):
    opts = dict(opts)
    opts.setdefault("gds", "off")
    return core.Reader(path, False, dict(opts, device="cuda:0"))

def load(path, names=None, **opts):
    r = _open(path, opts)
    got = {n: hashlib.sha256(bytes(core.copy_to_host(a))).hexdigest()
           for n, _, a in r.load(names, 2)}
    st = r.stats()
    r.close()
    return {"got": got, "device_bytes": st["device_bytes"]}

def stream(path, names=None, **opts):
    # Batch by batch under a device budget, each batch dropped before the next is asked for.
    r = _open(path, opts)
    got, devices, it = {}, set(), r.iterate(names, 2)
    try:
        while (item := it.next()) is not None:
            index, count, nbytes, triples, device = item
            devices.add(device)
            for n, _, a in triples:
                got[n] = hashlib.sha256(bytes(core.copy_to_host(a))).hexdigest()
            a = None  # the loop variable would keep the batch's device buffer
            del item, triples
    except tensorferry.SafetensorError as e:
        it.close()
        return {"error": f"{type(e).__name__}: {e}"}
    st = r.stats()
    r.close()
    return {"got": got, "device_bytes": st["device_bytes"], "devices": sorted(devices),
            "batches": st["batches"], "peak_device_bytes": st["peak_device_bytes"]}
"""


def _run_child(code, env_extra=None):
    """Runs `code` after _CHILD in a child Python with the fake CUDA runtime (the runtime is
    chosen once per process); returns what it passed to emit()."""
    prelude = textwrap.dedent("""
        import json as _json, os as _os
        def emit(obj):
            with open(_os.environ["TF_TEST_OUT"], "w") as _f:
                _f.write(_json.dumps(obj))
    """)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        env = dict(os.environ, TF_TEST_OUT=out, TENSORFERRY_CUDA_RUNTIME=FAKE,
                   TENSORFERRY_CUFILE_LIBRARY=FAKE, **(env_extra or {}))
        r = subprocess.run([sys.executable, "-c", prelude + _CHILD + textwrap.dedent(code)],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        with open(out) as f:
            return json.load(f)


def _sha(t):
    return hashlib.sha256(_bytes_view(t).tobytes()).hexdigest()


@needs_fake
def test_fake_cuda_staging_slot_crossings(small, big, tp):
    """Device loads through the fake CUDA runtime: staging slots of 64 KiB (crossed by the c.*
    tensors and by t.wide_f32's 128 KiB rows / 64 KiB pieces) and the default 8 MiB (crossed by the
    k.* tensors), device budgets of 1 MiB and 2 MiB (crossed by the b.* and h.* tensors); each
    tensor's device bytes, copied back, hash like the reference's."""
    fits = {b: [n for n in small.names if small.layout[n][3] <= b] for b in (BUDGET, 2 * BUDGET)}
    out = _run_child(f"""
        slot = {CHUNK}
        res = {{}}
        for engine in ("pread", "io_uring"):
            for direct in ("off", "on"):
                res[f"small/{{engine}}/{{direct}}"] = load(
                    {small.path!r}, engine=engine, direct=direct, chunk_size={CHUNK},
                    staging_slot=slot, staging_bytes=4 * slot)
        for budget, names in {fits!r}.items():
            res[f"small/budget{{budget}}"] = stream(
                {small.path!r}, names, engine="pread", chunk_size={CHUNK}, staging_slot=slot,
                staging_bytes=4 * slot, device_budget=budget)
        for odd_slot in (4096, 4097, 65537):  # 4097 and 65537 are rounded up to 4 KiB multiples
            rounded = (odd_slot + 4095) // 4096 * 4096
            res[f"small/slot{{odd_slot}}"] = load(
                {small.path!r}, engine="io_uring", chunk_size={CHUNK}, staging_slot=odd_slot,
                staging_bytes=2 * rounded, gds="auto")
            res[f"tp/1/3/slot{{odd_slot}}"] = load(
                {tp.path!r}, engine="pread", staging_slot=odd_slot, staging_bytes=3 * rounded + 1,
                tp_rank=1, tp_size=3, gds="auto",
                shard_rules=tensorferry.shard_spec({RULES_SPLIT1!r}))
        res["big/default-slot"] = load({big.path!r}, engine="pread")
        for world in (2, 3):
            for rank in range(world):
                res[f"tp/{{rank}}/{{world}}"] = load(
                    {tp.path!r}, engine="pread", staging_slot=slot, staging_bytes=4 * slot,
                    tp_rank=rank, tp_size=world,
                    shard_rules=tensorferry.shard_spec({RULES_SPLIT1!r}))
        emit(res)
    """)
    assert len(out) == 4 + 2 + 6 + 1 + 5
    for key, entry in out.items():
        assert "error" not in entry, (key, entry.get("error"))
        if key.startswith("tp/"):
            rank, world = map(int, key.split("/")[1:3])
            want = {n: _sha(t) for n, t in _tp_want(tp, RULES_SPLIT1, rank, world).items()}
            nbytes = sum(t.nbytes for t in _tp_want(tp, RULES_SPLIT1, rank, world).values())
        else:
            ckpt = big if key.startswith("big") else small
            names = fits[int(key[len("small/budget"):])] if "budget" in key else ckpt.names
            want = {n: _sha(ckpt.pt[n]) for n in names}
            nbytes = ckpt.nbytes(names)
        assert entry["got"] == want, key
        assert entry["device_bytes"] == nbytes, key
        if "budget" in key:
            budget = int(key[len("small/budget"):])
            assert entry["devices"] == ["cuda:0"] and entry["batches"] >= 4, key
            assert entry["peak_device_bytes"] <= budget, key


@needs_fake
def test_fake_cuda_allow_oversized_tensor_loads_alone(small):
    name = "b.u8_1048577"
    out = _run_child(f"""
        emit(stream({small.path!r}, [{name!r}], engine="pread", device_budget={BUDGET},
                    allow_oversized=True))
    """)
    assert "error" not in out, out.get("error")
    assert out["got"] == {name: _sha(small.pt[name])}


@needs_fake
def test_fake_cuda_tensor_of_exactly_the_device_budget_gds_auto(small):
    name = "b.bf16_1048576"
    assert small.layout[name][3] == BUDGET and small.layout[name][2] % PAGE
    out = _run_child(f"""
        emit({{"off": stream({small.path!r}, [{name!r}], engine="pread",
                             device_budget={BUDGET}, gds="off"),
               "auto": stream({small.path!r}, [{name!r}], engine="pread",
                              device_budget={BUDGET}, gds="auto")}})
    """)
    for mode in ("off", "auto"):
        assert "error" not in out[mode], (mode, out[mode].get("error"))
        assert out[mode]["got"] == {name: _sha(small.pt[name])}, mode


def _real_cuda():
    try:
        return torch.cuda.is_available() and tensorferry._core.cuda_available()
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not _real_cuda(), reason="needs torch with a CUDA device")
def test_real_cuda_around_the_staging_slot(small, big):
    """A real GPU: the default 8 MiB staging slot crossed by the k.* tensors, device budgets
    (budget= is the device budget of a CUDA Loader) whose halves the b.* / m.* tensors cross, and
    safe_open(device="cuda:0").get_tensor on both sides of 16 MiB. (Budgets stay above every
    tensor plus its 4 KiB padding.)"""
    for ckpt, budgets in ((small, (None, 2 * BUDGET + 2 * PAGE)),
                          (big, (None, 4 * DEFAULT_CHUNK))):
        want = ref_pt.load_file(ckpt.path)
        for budget in budgets:
            with tensorferry.Loader(ckpt.path, device="cuda:0", budget=budget,
                                    select=[n for n in ckpt.names if budget is None
                                            or ckpt.layout[n][3] + PAGE <= budget]) as loader:
                it, seen = loader.iter_tensors(), []
                while True:
                    try:
                        name, t = next(it)
                    except StopIteration:
                        break
                    assert t.device == torch.device("cuda", 0), name
                    assert_same(t.cpu(), want[name], f"cuda {budget}/{name}")
                    seen.append(name)
                    del t  # a batch's device buffer counts until its last tensor goes
                assert seen == loader.keys()
                assert loader.stats.device == "cuda:0"
                if budget:
                    assert loader.stats.peak_device_bytes <= budget
        with tensorferry.safe_open(ckpt.path, "pt", device="cuda:0") as f:
            for name in ckpt.names:
                t = f.get_tensor(name)
                assert t.device == torch.device("cuda", 0), name
                assert_same(t.cpu(), want[name], f"safe_open cuda/{name}")

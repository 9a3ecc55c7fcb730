"""get_slice follows the framework's indexing rules in full: for every index, the result (value,
shape, dtype) or the exception (type and message) is exactly what full_tensor[index] gives, and
only the bytes the result needs are read where the index allows it."""
import builtins
import random

import numpy as np
import pytest
import safetensors
import safetensors.torch as ref_pt
import torch

import tensorferry

SHAPE = (5, 6, 7)


def random_index(rng, shape, negative_steps):
    def bound(n):
        return rng.choice([None, rng.randint(-2 * n, 2 * n), rng.randint(-n, n)])

    items = []
    for n in shape[:rng.randint(0, len(shape) + 1)]:
        r = rng.random()
        if r < 0.3:
            items.append(rng.randint(-n - 1, n))  # sometimes out of range: IndexError
        elif r < 0.4:
            items.append(None)
        else:
            steps = [None, 1, 1, 2, 3, 9] + ([-1, -2, -4] if negative_steps else [])
            if rng.random() < 0.03:
                steps = [-1]  # torch: "step must be greater than zero"
            items.append(slice(bound(n), bound(n), rng.choice(steps)))
    if rng.random() < 0.3:
        items.insert(rng.randint(0, len(items)), Ellipsis)
    if rng.random() < 0.05:
        items.append(0)  # likely too many indices
    if rng.random() < 0.2 and len(items) == 1:
        return items[0]
    return tuple(items)


def outcome(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - the exception itself is compared
        kind = type(e)
        if kind.__name__.startswith("Slice") and kind.__module__.startswith("tensorferry"):
            # NumPy's error made a SafetensorError too (as the reference raises): its own type.
            assert isinstance(e, tensorferry.SafetensorError), kind.__mro__
            kind = getattr(builtins, kind.__name__[len("Slice"):])
            assert isinstance(e, kind), type(e).__mro__
        return None, (kind, str(e))


def same_result(got, want):
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
        assert got.is_contiguous()
    else:
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def file_3d(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("slice") / "f.safetensors")
    full = torch.arange(int(np.prod(SHAPE)), dtype=torch.float32).reshape(SHAPE)
    ref_pt.save_file({"a": full, "b": (full * 3).to(torch.bfloat16), "i": full.to(torch.int64),
                      "s": torch.tensor(2.5), "e": torch.zeros(0, 4), "v": torch.arange(11)}, path)
    return path


@pytest.mark.parametrize("framework", ["pt", "np"])
def test_random_indices_match_full_tensor_indexing(file_3d, framework):
    rng = random.Random(7 if framework == "pt" else 8)
    names = ["a", "i"] if framework == "np" else ["a", "b", "i"]
    checked = errors = 0
    with tensorferry.safe_open(file_3d, framework) as f:
        for name in names:
            full = f.get_tensor(name)
            sl = f.get_slice(name)
            for _ in range(400):
                index = random_index(rng, SHAPE, negative_steps=framework == "np")
                want, want_error = outcome(lambda: full[index])
                got, got_error = outcome(lambda: sl[index])
                assert got_error == want_error, index
                if want_error is None:
                    same_result(got, want)
                    checked += 1
                else:
                    errors += 1
    assert checked > 500 and errors > 20  # both paths exercised


@pytest.mark.parametrize("framework", ["pt", "np"])
def test_matches_reference_get_slice_where_it_works(file_3d, framework):
    # Where the reference's own get_slice answers, tensorferry gives the same; where it fails
    # (numpy: None, negative steps), tensorferry gives full[index].
    rng = random.Random(11)
    with tensorferry.safe_open(file_3d, framework) as ours, \
            safetensors.safe_open(file_3d, framework) as ref:
        full = ref.get_tensor("a")
        for _ in range(300):
            index = random_index(rng, SHAPE, negative_steps=framework == "np")
            want, want_error = outcome(lambda: full[index])
            got, got_error = outcome(lambda: ours.get_slice("a")[index])
            ref_got, ref_error = outcome(lambda: ref.get_slice("a")[index])
            assert got_error == want_error
            if ref_error is None and want_error is None:
                if framework == "np":
                    # Integers alone: NumPy (and tensorferry) give a scalar, the reference a 0-d
                    # array; same value either way.
                    got, ref_got = np.asarray(got), np.asarray(ref_got)
                same_result(got, ref_got)


@pytest.mark.parametrize("framework", ["pt", "np"])
def test_special_cases(file_3d, framework):
    with tensorferry.safe_open(file_3d, framework) as f:
        cases = {
            "s": [(), Ellipsis, None, (None, Ellipsis)],
            "e": [(), 0, slice(None), (slice(None), 2), (Ellipsis, slice(1, 3))],
            "v": [slice(None, None, 4), -1, slice(-3, None), slice(100, 200), [1, 3], (None, 2)],
            "a": [[0, 2], ([1, 0], slice(None), 2), True, False, np.int64(-2),
                  (np.int32(1), np.int64(2)), (Ellipsis, Ellipsis), np.array([1, 2]),
                  (slice(None), [True, False, True, False, True, False])],
        }
        if framework == "pt":
            cases["a"] += [torch.tensor(1), torch.tensor([0, 4]), (torch.tensor(2), slice(1, 3))]
        for name, indices in cases.items():
            full = f.get_tensor(name)
            for index in indices:
                want, want_error = outcome(lambda: full[index])
                got, got_error = outcome(lambda: f.get_slice(name)[index])
                assert got_error == want_error, (name, index)
                if want_error is None:
                    if isinstance(want, (np.generic, np.ndarray)) and framework == "np":
                        want = np.asarray(want) if isinstance(got, np.ndarray) else want
                    if isinstance(want, np.generic):
                        assert got == want and type(got) is type(want)
                    else:
                        same_result(got, want)


def test_slices_own_their_memory_and_read_only_what_they_need(tmp_path):
    path = str(tmp_path / "big.safetensors")
    full = torch.arange(1000 * 256, dtype=torch.int32).reshape(1000, 256)
    ref_pt.save_file({"w": full}, path)
    with tensorferry.safe_open(path, "pt") as f:
        sl = f.get_slice("w")
        part = sl[10:12]
        assert torch.equal(part, full[10:12])
        # Its storage is exactly its bytes: nothing else of the tensor was read or kept.
        assert part.untyped_storage().nbytes() == 2 * 256 * 4
        col = sl[100:300:50, 3]
        assert torch.equal(col, full[100:300:50, 3])
        assert col.untyped_storage().nbytes() == col.nbytes
        row = sl[-1]
        assert torch.equal(row, full[-1])
        part.add_(1)  # writable, private
    assert torch.equal(ref_pt.load_file(path)["w"], full)


def test_tensor_parallel_shards_like_vllm(tmp_path):
    # The use get_slice exists for: each rank takes its part of a column- or row-parallel weight.
    path = str(tmp_path / "w.safetensors")
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref_pt.save_file({"w": w}, path)
    with tensorferry.safe_open(path, "pt") as f:
        sl = f.get_slice("w")
        rows, cols = sl.get_shape()
        for world in (1, 2, 4, 8):
            parts = [sl[r * rows // world:(r + 1) * rows // world] for r in range(world)]
            assert torch.equal(torch.cat(parts, 0), w)
            parts = [sl[:, r * cols // world:(r + 1) * cols // world] for r in range(world)]
            assert torch.equal(torch.cat(parts, 1), w)


def test_8_bit_float_types(tmp_path):
    # float8 comes out of the file as bytes viewed as torch's types; slices follow the same rules.
    path = str(tmp_path / "f.safetensors")
    full = torch.arange(6 * 8, dtype=torch.uint8).reshape(6, 8).view(torch.float8_e4m3fn)
    ref_pt.save_file({"f8": full}, path)
    rng = random.Random(5)
    with tensorferry.safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("f8").view(torch.uint8), full.view(torch.uint8))
        for _ in range(100):
            index = random_index(rng, (6, 8), negative_steps=False)
            want, want_error = outcome(lambda: full[index])
            got, got_error = outcome(lambda: f.get_slice("f8")[index])
            assert got_error == want_error, index
            if want_error is None:
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got.contiguous().view(torch.uint8),
                                   want.contiguous().view(torch.uint8))


def unpack_f4(packed, dim):
    """The 4-bit values of a float4_e2m1fn_x2 tensor as uint8, dimension `dim` doubled."""
    u8 = packed.contiguous().view(torch.uint8).movedim(dim, -1)
    values = torch.stack([u8 & 0xF, u8 >> 4], dim=-1).reshape(*u8.shape[:-1], 2 * u8.shape[-1])
    return values.movedim(-1, dim)


def file_last_dim(index, ndim):
    """Where the file's last dimension lands in full[index] counted from the end (-1, -2, ...),
    or None when an int drops it."""
    items = list(index) if isinstance(index, tuple) else [index]
    consuming = [i for i in items if i is not None and i is not Ellipsis]
    if Ellipsis not in items and len(consuming) < ndim:
        return -1  # the dimensions not indexed come last
    if len(consuming) == ndim and isinstance(consuming[-1], int):
        return None
    trailing = 0
    while items and items[-1] is None:
        items.pop()
        trailing += 1
    return -1 - trailing


def test_f4_slices_count_4_bit_values_as_get_shape(tmp_path):
    # F4 packs two values per byte (torch: float4_e2m1fn_x2 counts pairs); get_shape() counts
    # values, and so do indexes: the last dimension's selection must keep whole bytes.
    path = str(tmp_path / "f.safetensors")
    packed = torch.randint(0, 256, (6, 8), dtype=torch.uint8, generator=torch.Generator()
                           .manual_seed(3))
    ref_pt.save_file({"f4": packed.view(torch.float4_e2m1fn_x2)}, path)
    values = unpack_f4(packed, -1)  # (6, 16): the file's view
    with tensorferry.safe_open(path, "pt") as f:
        sl = f.get_slice("f4")
        rows, cols = sl.get_shape()
        assert [rows, cols] == [6, 16]
        # Tensor-parallel splits by get_shape() give the halves.
        halves = [sl[:, r * cols // 2:(r + 1) * cols // 2] for r in range(2)]
        assert [tuple(h.shape) for h in halves] == [(6, 4), (6, 4)]
        assert all(h.dtype == torch.float4_e2m1fn_x2 for h in halves)
        assert torch.equal(torch.cat([h.view(torch.uint8) for h in halves], 1), packed)
        assert torch.equal(sl[:, 0:6].view(torch.uint8), packed[:, 0:3])
        assert torch.equal(sl[1:3, cols - 4:].view(torch.uint8), packed[1:3, 6:])
        assert torch.equal(sl[4].view(torch.uint8), packed[4])
        assert torch.equal(sl[..., 2:4, None].view(torch.uint8), packed[:, 1:2, None])
        assert tuple(sl[:, 5:5].shape) == (6, 0) and tuple(sl[2:2, 0:4].shape) == (0, 2)
        # Selections that split a byte are refused, naming tensor, dimension and index.
        for index, text in [((slice(None), cols - 1), "index 15 into dimension 1"),
                            ((slice(None), slice(1, 3)), "index 1:3 into dimension 1"),
                            ((2, slice(0, 5)), "index 0:5 into dimension 1"),
                            ((Ellipsis, slice(0, 16, 2)), "index 0:16:2 into dimension 1"),
                            ((slice(None), torch.tensor(3)), "index 3 into dimension 1"),
                            ((1, 2), "index 2 into dimension 1")]:
            with pytest.raises(tensorferry.SafetensorError, match="'f4'.*" + text) as e:
                sl[index]
            assert isinstance(e.value, tensorferry.InvalidArgumentError)
        with pytest.raises(tensorferry.InvalidArgumentError, match="can only be sliced"):
            sl[[0, 2]]
        # Out-of-range indexes fail as torch fails on a tensor of the file's shape.
        with pytest.raises(IndexError, match="index 16 is out of bounds for dimension 1 with "
                                             "size 16"):
            sl[:, 16]
        # Random indexes: every result holds exactly the values the index selects.
        rng = random.Random(7)
        counts = {"ok": 0, "refused": 0}
        for _ in range(400):
            index = random_index(rng, (6, 16), negative_steps=False)
            want, want_error = outcome(lambda: values[index])
            got, got_error = outcome(lambda: sl[index])
            if want_error is not None and got_error is not None and \
                    got_error[0] is not tensorferry.InvalidArgumentError:
                assert got_error == want_error, index
                continue
            if got_error is not None:
                assert got_error[0] is tensorferry.InvalidArgumentError, (index, got_error)
                assert "splits a byte" in got_error[1] or "half a byte" in got_error[1]
                counts["refused"] += 1
                continue
            assert want_error is None, (index, want_error)
            dim = file_last_dim(index, 2)
            assert dim is not None, index
            assert got.dtype == torch.float4_e2m1fn_x2 and got.is_contiguous()
            assert torch.equal(unpack_f4(got, dim), want), index
            counts["ok"] += 1
        assert counts["ok"] > 50 and counts["refused"] > 50, counts

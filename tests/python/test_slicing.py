"""get_slice follows the framework's indexing rules in full: for every index, the result (value,
shape, dtype) or the exception (type and message) is exactly what full_tensor[index] gives, and
only the bytes the result needs are read where the index allows it."""
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
        return None, (type(e), str(e))


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


def test_packed_and_8_bit_float_types(tmp_path):
    # float8 and float4 (two values per byte) come out of the file as bytes and are viewed as
    # torch's types; slices of them follow the same rules.
    path = str(tmp_path / "f.safetensors")
    raw = torch.arange(6 * 8, dtype=torch.uint8).reshape(6, 8)
    tensors = {"f8": raw.view(torch.float8_e4m3fn), "f4": raw.clone().view(torch.float4_e2m1fn_x2)}
    ref_pt.save_file(tensors, path)
    rng = random.Random(5)
    with tensorferry.safe_open(path, "pt") as f:
        assert f.get_slice("f4").get_shape() == [6, 16]  # the file counts 4-bit values
        for name, full in tensors.items():
            assert torch.equal(f.get_tensor(name).view(torch.uint8), full.view(torch.uint8))
            for _ in range(100):
                index = random_index(rng, (6, 8), negative_steps=False)
                want, want_error = outcome(lambda: full[index])
                got, got_error = outcome(lambda: f.get_slice(name)[index])
                assert got_error == want_error, index
                if want_error is None:
                    assert got.dtype == want.dtype and got.shape == want.shape
                    assert torch.equal(got.contiguous().view(torch.uint8),
                                       want.contiguous().view(torch.uint8))

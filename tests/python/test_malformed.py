"""Malformed files through the Python API: tensorferry refuses what the reference refuses, with the
same exception class (SafetensorError for the format, FileNotFoundError/OSError for the file
system), and refuses more only for the stricter rules of docs/format.md."""
import os
import struct

import pytest
import safetensors
import safetensors.torch
import torch
from conftest import write_raw
from test_reference_interop import HAND_WRITTEN, STRICTER, mutated_files, t

import tensorferry
import tensorferry.numpy as tf_np
import tensorferry.torch as tf_pt


def dtype_error(module, e):
    """True when get_tensor failed only because numpy has no such dtype (not a format error)."""
    if module is tensorferry:
        return isinstance(e, tensorferry.UnsupportedDTypeError)
    return isinstance(e, (TypeError, AttributeError)) or "Dtype not understood" in str(e)


def open_all(module, path, framework="np"):
    """Opens `path` with `module` (safetensors or tensorferry) and reads everything; returns
    ("ok", keys, metadata, names numpy cannot hold) or ("error", exception)."""
    try:
        without_type = []
        with module.safe_open(path, framework) as f:
            keys = f.keys()
            meta = f.metadata()
            for name in keys:
                try:
                    f.get_tensor(name)
                except Exception as e:  # noqa: BLE001
                    if not dtype_error(module, e):
                        raise
                    without_type.append(name)
        return ("ok", keys, meta, without_type)
    except Exception as e:  # noqa: BLE001 - the class is what is compared
        return ("error", e)


def check(path, label):
    ref = open_all(safetensors, path)
    ours = open_all(tensorferry, path)
    if ref[0] == "ok" and ours[0] == "ok":
        assert ours[1:] == ref[1:], label
    elif ref[0] == "error" and ours[0] == "error" and \
            getattr(ours[1], "code", None) in STRICTER:
        pass  # refused at open by a stricter rule; the reference failed later (e.g. in numpy)
    elif ref[0] == "error" and ours[0] == "error":
        # Same class of failure: a format error is a SafetensorError in both.
        assert isinstance(ref[1], safetensors.SafetensorError), (label, ref[1])
        assert isinstance(ours[1], tensorferry.SafetensorError), (label, ours[1])
        assert ours[1].category == "corrupt", (label, ours[1])
    elif ours[0] == "error":
        err = ours[1]
        stricter = getattr(err, "code", None) in STRICTER or \
            "the integer -0" in str(err)
        assert stricter, f"{label}: tensorferry refuses ({err!r}) a file the reference accepts"
    else:
        pytest.fail(f"{label}: tensorferry accepts a file the reference refuses ({ref[1]!r})")


@pytest.mark.parametrize("index", range(len(HAND_WRITTEN)))
def test_hand_written_headers(tmp_path, index):
    header, data = HAND_WRITTEN[index]
    path = str(tmp_path / "f.safetensors")
    write_raw(path, header, data)
    check(path, repr(header)[:120])


def test_mutated_headers(tmp_path):
    refused = 0
    for path, f in mutated_files(tmp_path, 4321):
        check(path, f[:120])
        refused += open_all(safetensors, path)[0] == "error"
    assert refused > 100


def test_error_classes_for_the_file_system(tmp_path):
    missing = str(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError):
        safetensors.safe_open(missing, "pt")
    with pytest.raises(FileNotFoundError) as e:
        tensorferry.safe_open(missing, "pt")
    assert e.value.errno == 2 and missing in str(e.value)
    for load in (tf_pt.load_file, tf_np.load_file, lambda p: tensorferry.Loader(p)):
        with pytest.raises(FileNotFoundError):
            load(missing)
    # A directory: the reference fails with an OSError, and so does tensorferry's safe_open.
    with pytest.raises(OSError):
        safetensors.safe_open(str(tmp_path), "pt")
    with pytest.raises(OSError):
        tensorferry.safe_open(str(tmp_path), "pt")
    if os.geteuid() != 0:  # root reads anything
        path = str(tmp_path / "secret.safetensors")
        write_raw(path, "{}")
        os.chmod(path, 0)
        with pytest.raises(OSError):
            tensorferry.safe_open(path, "pt")


def test_truncated_file_is_a_format_error(tmp_path):
    path = str(tmp_path / "f.safetensors")
    tf_pt.save_file({"a": torch.arange(10.0)}, path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)
    with pytest.raises(safetensors.SafetensorError):
        safetensors.safe_open(path, "pt")
    with pytest.raises(tensorferry.SafetensorError) as e:
        tensorferry.safe_open(path, "pt")
    assert e.value.code == "data_truncated" and path in str(e.value)


def test_load_bytes_refuses_malformed_data():
    for data in (b"", b"abc", struct.pack("<Q", 100) + b"{}", struct.pack("<Q", 2) + b"[]"):
        with pytest.raises(safetensors.SafetensorError):
            safetensors.torch.load(data)
        with pytest.raises(tensorferry.SafetensorError):
            tf_pt.load(data)
        with pytest.raises(tensorferry.SafetensorError):
            tf_np.load(data)


def test_duplicate_keys_are_refused_with_a_code(tmp_path):
    # Stricter than the reference on purpose (it keeps the last of two identical entries).
    path = str(tmp_path / "f.safetensors")
    write_raw(path, '{"a":%s,"a":%s}' % (t("U8", [1], 0, 1), t("U8", [1], 0, 1)), bytes(1))
    with safetensors.safe_open(path, "pt") as f:
        assert f.keys() == ["a"]
    with pytest.raises(tensorferry.SafetensorError) as e:
        tensorferry.safe_open(path, "pt")
    assert e.value.code == "duplicate_key" and e.value.category == "corrupt"

"""Interoperability with the reference implementation (huggingface/safetensors, pinned in
requirements.txt), through the `tensorferry` CLI (path in $TENSORFERRY_CLI, set by CTest).

1. Differential validation: hundreds of headers, hand-written and mutated, are given to both. Where
   they disagree, the only allowed case is tensorferry refusing a file the reference accepts, for one
   of the stricter rules documented in docs/format.md.
2. Files tensorferry writes (`gen`) are read by the reference with the same tensors and bytes.
"""
import json
import os
import random
import struct
import subprocess

import numpy as np
import pytest
from safetensors import safe_open

CLI = os.environ.get("TENSORFERRY_CLI") or os.path.join(
    os.path.dirname(__file__), "..", "..", "build", "release", "bin", "tensorferry")

# Codes for files the reference accepts and tensorferry refuses on purpose (docs/format.md).
STRICTER = {"duplicate_key", "header_too_deep", "rank_too_large", "too_many_tensors"}


def stricter_on_purpose(err):
    # The integer -0 is refused wherever it stands (docs/format.md); the reference ignores it
    # inside unknown fields.
    return err["code"] in STRICTER or (err["code"] == "header_invalid_json"
                                       and "the integer -0" in err["message"])


def run_cli(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60)


def write(path, header, data=b""):
    hb = header if isinstance(header, bytes) else header.encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + data)


def reference_accepts(path):
    try:
        with safe_open(path, "np") as f:
            f.keys()
            f.metadata()
        return True
    except Exception:  # noqa: BLE001 - any refusal counts
        return False


def ours(path):
    r = run_cli("verify", "--json", path)
    assert r.returncode in (0, 1), (r.returncode, r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert doc["ok"] == (r.returncode == 0)
    return doc


def t(dtype, shape, begin, end, extra=""):
    return ('{"dtype":"%s","shape":%s,"data_offsets":[%d,%d]%s}'
            % (dtype, json.dumps(shape, separators=(",", ":")), begin, end, extra))


HAND_WRITTEN = [
    ("{}", b""),
    ("{}      ", b""),
    (" \n{}\t", b""),
    ('{"__metadata__":null}', b""),
    ('{"__metadata__":{}}', b""),
    ('{"__metadata__":{"a":"b"}}', b""),
    ('{"__metadata__":{"a":1}}', b""),
    ('{"__metadata__":[]}', b""),
    ('{"__metadata__":{"a":"1","a":"2"}}', b""),
    ('{"a":%s}' % t("F32", [2, 2], 0, 16), bytes(16)),
    ('{"a":%s}' % t("F32", [2, 2], 0, 16), bytes(17)),
    ('{"a":%s}' % t("F32", [2, 2], 0, 16), bytes(15)),
    ('{"a":%s}' % t("F32", [2, 2], 1, 17), bytes(17)),
    ('{"a":%s}' % t("f32", [2, 2], 0, 16), bytes(16)),
    ('{"a":%s}' % t("F4", [2, 3], 0, 3), bytes(3)),
    ('{"a":%s}' % t("F4", [3], 0, 2), bytes(2)),
    ('{"a":%s}' % t("F6_E2M3", [4], 0, 3), bytes(3)),
    ('{"a":%s}' % t("F6_E3M2", [3], 0, 3), bytes(3)),
    ('{"a":%s}' % t("F8_E8M0", [], 0, 1), bytes(1)),
    ('{"a":%s}' % t("C64", [1], 0, 8), bytes(8)),
    ('{"a":%s}' % t("F8_E4M3FNUZ", [2], 0, 2), bytes(2)),
    ('{"a":%s}' % t("U8", [0], 0, 0), b""),
    ('{"a":%s,"b":%s}' % (t("U8", [0], 0, 0), t("U8", [0], 0, 0)), b""),
    ('{"a":%s,"b":%s}' % (t("U8", [2], 0, 2), t("U8", [1], 1, 2)), bytes(2)),
    ('{"a":%s,"b":%s}' % (t("U8", [1], 0, 1), t("U8", [1], 2, 3)), bytes(3)),
    ('{"a":%s,"a":%s}' % (t("U8", [1], 0, 1), t("U8", [1], 0, 1)), bytes(1)),
    ('{"a":%s}' % t("U8", [1], 0, 1, ',"x":{"k":1,"k":2}'), bytes(1)),
    ('{"a":%s}' % t("U8", [1], 0, 1, ',"x":[1.5,null,true,"s"]'), bytes(1)),
    ('{"a":%s}' % t("U8", [1], 0, 1, ',"x":' + "[" * 100 + "]" * 100), bytes(1)),
    ('{"a":%s}' % t("U8", [1], 0, 1, ',"x":' + "[" * 200 + "]" * 200), bytes(1)),
    ('{"a":%s}' % t("U8", [1] * 100, 0, 1), bytes(1)),
    ('{"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', bytes(1)),
    ('{"a":{"dtype":"U8","shape":[1]}}', bytes(1)),
    ('{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}', bytes(1)),
    ('{"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}', bytes(1)),
    ('{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}', b""),
    ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}}', bytes(1)),
    ('{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}}', bytes(1)),
    ('{"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}}', b""),
    ('{"a":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,0]}}', b""),
    ('{"a":[]}', b""),
    ('[]', b""),
    ('{"a":1}', b""),
    ("{'a':1}", b""),
    ("{}x", b""),
    ('{"":%s}' % t("BOOL", [1], 0, 1), bytes(1)),
    ('{"caf\\u00e9":%s}' % t("BOOL", [1], 0, 1), bytes(1)),
    (b"\xef\xbb\xbf{}", b""),
    (b'{"\xff":1}', b""),
    (b"{}\x00\x00\x00\x00\x00\x00", b""),
]


def check_agreement(path, label):
    ref = reference_accepts(path)
    doc = ours(path)
    if ref == doc["ok"]:
        return
    assert ref and not doc["ok"], f"{label}: tensorferry accepts a file the reference refuses"
    err = doc["error"]
    assert stricter_on_purpose(err), f"{label}: refused with {err['code']}: {err['message']}"


@pytest.mark.parametrize("index", range(len(HAND_WRITTEN)))
def test_hand_written_headers_agree_with_reference(tmp_path, index):
    header, data = HAND_WRITTEN[index]
    path = str(tmp_path / "f.safetensors")
    write(path, header, data)
    check_agreement(path, repr(header)[:120])


def mutated_files(directory, seed, count=300):
    """`count` files, each a small valid one with 1-3 random bytes of its header replaced or
    deleted, written under `directory`. Yields (path, the file's bytes)."""
    rng = random.Random(seed)
    base_header = ('{"__metadata__":{"format":"pt"},"w":%s,"b":%s,"s":%s}'
                   % (t("BF16", [3, 4], 0, 24), t("F32", [4], 24, 40), t("I64", [], 40, 48)))
    base = struct.pack("<Q", len(base_header)) + base_header.encode() + bytes(range(48))
    alphabet = b'{}[]",:0123456789-. \x00\xffabcdefFUIB_'
    for i in range(count):
        f = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(0, 8 + len(base_header))
            if rng.random() < 0.2 and len(f) > 9:
                del f[pos]
            else:
                f[pos] = rng.choice(alphabet)
        path = os.path.join(str(directory), f"m{i}.safetensors")
        with open(path, "wb") as fh:
            fh.write(bytes(f))
        yield path, bytes(f)


def test_mutated_headers_agree_with_reference(tmp_path):
    for path, f in mutated_files(tmp_path, 1234):
        ref = reference_accepts(path)
        doc = ours(path)
        if ref != doc["ok"]:
            assert ref and stricter_on_purpose(doc["error"]), (f[:200], doc)


def test_verify_error_line_format(tmp_path):
    path = str(tmp_path / "bad.safetensors")
    write(path, '{"a":%s}' % t("F32", [2, 2], 0, 16), bytes(15))
    r = run_cli("verify", path)
    assert r.returncode == 1
    lines = r.stderr.strip().split("\n")
    assert len(lines) == 1 and lines[0].startswith("error: " + path + ": "), r.stderr


@pytest.mark.parametrize("dtype", ["F32", "BF16", "F16", "I32"])
def test_reference_reads_generated_checkpoint(tmp_path, dtype):
    out = str(tmp_path / "ckpt")
    r = run_cli("gen", out, "--preset", "tiny", "--dtype", dtype, "--shard-size", "64KB")
    assert r.returncode == 0, r.stderr
    info = json.loads(run_cli("inspect", "--json", out).stdout)
    files = sorted({tt["file"] for tt in info["tensors"]})
    assert len(files) > 1, "tiny preset with 64KB shards should give several files"
    seen = 0
    for fpath in files:
        mine = {tt["name"]: tt for tt in info["tensors"] if tt["file"] == fpath}
        with open(fpath, "rb") as fh:
            raw = fh.read()
        with safe_open(fpath, "np") as f:
            assert sorted(f.keys()) == sorted(mine)
            for name in f.keys():
                sl = f.get_slice(name)
                assert list(sl.get_shape()) == mine[name]["shape"]
                assert sl.get_dtype() == dtype
                if dtype in ("F32", "F16", "I32"):
                    arr = f.get_tensor(name)
                    start = mine[name]["offset"]
                    assert arr.tobytes() == raw[start:start + mine[name]["size"]]
                    if dtype in ("F32", "F16"):
                        assert np.isfinite(arr).all()
                seen += 1
    assert seen == len(info["tensors"])

"""Writes byte-exact reference vectors with the reference implementation (huggingface/safetensors).

tests/data/reference/<name>.safetensors are files written by `safetensors.serialize`;
tests/data/reference/manifest.json lists, for each file, the tensors (name, header dtype, shape,
data as hex) and metadata that produced it. The C++ writer test writes the same tensors and must
produce identical bytes. Rerun with the pinned safetensors version (requirements.txt) to refresh:
    .venv/bin/python tests/python/make_reference_vectors.py
"""
import ctypes
import json
import os

import safetensors
from safetensors import TensorSpec, serialize

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "data", "reference")

# header dtype -> (dtype name the reference's TensorSpec takes, bits per element)
DTYPES = {
    "BOOL": ("bool", 8), "U8": ("uint8", 8), "I8": ("int8", 8),
    "F8_E5M2": ("float8_e5m2", 8), "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8), "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8), "I16": ("int16", 16), "U16": ("uint16", 16),
    "F16": ("float16", 16), "BF16": ("bfloat16", 16), "I32": ("int32", 32),
    "U32": ("uint32", 32), "F32": ("float32", 32), "C64": ("complex64", 64),
    "F64": ("float64", 64), "I64": ("int64", 64), "U64": ("uint64", 64),
}

keep = []


def spec(dtype, shape, data):
    buf = ctypes.create_string_buffer(data, max(len(data), 1))
    keep.append(buf)
    return TensorSpec(dtype=DTYPES[dtype][0], shape=shape, data_ptr=ctypes.addressof(buf),
                      data_len=len(data))


def nbytes(dtype, shape):
    n = 1
    for s in shape:
        n *= s
    return n * DTYPES[dtype][1] // 8


def pattern(n, seed):
    return bytes(((i * 37 + seed * 11 + 5) & 0xFF) for i in range(n))


CASES = {
    "all_dtypes": ([(f"t.{d.lower()}", d, [2, 3]) for d in DTYPES], {"format": "pt"}),
    "names_sorted_within_dtype": ([("b", "F32", [1]), ("a", "F32", [2]), ("B", "F32", [1]),
                                   ("a.10", "BF16", [3]), ("a.2", "BF16", [1]), ("", "U8", [5])],
                                  None),
    "escapes_and_utf8": ([("quote\"back\\slash", "I32", [1]), ("tab\tnl\nctl\x01\x1f", "U8", [3]),
                          ("caf\u00e9/\u65e5\u672c", "F16", [2, 2]), ("del\x7f", "I8", [1])],
                         {"k\"ey": "v\nal\u00e9"}),
    "scalars_and_empty": ([("scalar", "F64", []), ("empty", "F32", [0, 4]), ("e2", "U8", [0]),
                           ("one", "I64", [1, 1, 1])], None),
    "empty_file": ([], None),
    "empty_with_metadata": ([], {"framework": "pt"}),
    "padding_7": ([("attn0", "F32", [1, 1, 2, 3])], None),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    manifest = {"safetensors_version": safetensors.__version__, "files": {}}
    for seed, (name, (tensors, metadata)) in enumerate(sorted(CASES.items())):
        specs, entries = {}, []
        for i, (tname, dtype, shape) in enumerate(tensors):
            data = pattern(nbytes(dtype, shape), seed * 100 + i)
            specs[tname] = spec(dtype, shape, data)
            entries.append({"name": tname, "dtype": dtype, "shape": shape, "data": data.hex()})
        blob = serialize(specs, metadata)
        with open(os.path.join(OUT, name + ".safetensors"), "wb") as f:
            f.write(blob)
        manifest["files"][name] = {"tensors": entries, "metadata": metadata or {}}
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()

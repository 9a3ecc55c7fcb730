#!/usr/bin/env python3
"""Prints the hash of every input of the Python package's build: the sources it compiles (library,
bindings, pure-Python files), the build files, and the Python and nanobind versions it is built
for. scripts/install_python.sh embeds it in the package (tensorferry._core.SOURCE_HASH) and skips
the build when the installed package carries the same hash; tests/python/conftest.py refuses to
test a package built from other sources."""
import hashlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ["pyproject.toml", "CMakeLists.txt"]
TREES = ["cmake", "include", "src", "python"]


def included(rel):
    name = os.path.basename(rel)
    if "__pycache__" in rel or name.endswith((".pyc", "_test.cc", "_fuzz.cc")):
        return False
    return not rel.startswith(os.path.join("src", "testing") + os.sep)


def source_hash():
    paths = [f for f in FILES if os.path.exists(os.path.join(ROOT, f))]
    for tree in TREES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, tree)):
            dirnames.sort()
            for name in filenames:
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)
                if included(rel):
                    paths.append(rel)
    h = hashlib.sha256()
    try:
        import nanobind
        nb_version = nanobind.__version__
    except ImportError:
        nb_version = "none"
    h.update(f"python {sys.version_info[:3]} nanobind {nb_version}\n".encode())
    for rel in sorted(paths):
        with open(os.path.join(ROOT, rel), "rb") as f:
            data = f.read()
        h.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()[:16]


if __name__ == "__main__":
    print(source_hash())

"""Writes the seed corpora of pickle_fuzz and zip_fuzz (fuzz/corpus/pickle, fuzz/corpus/zip) with
the real torch.save: small checkpoints in the zip and legacy formats, their data.pkl pickles, and a
few malicious pickles. Run with the project's .venv: .venv/bin/python fuzz/make_convert_corpus.py
"""
import io
import os
import pickle
import zipfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def checkpoints():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 3, generator=g)
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    yield "tensors", {"w": base, "b": torch.arange(3, dtype=torch.int64)}
    yield "views", {"w": base, "t": base.t(), "row": base[1], "tied": base,
                    "e": torch.arange(2).expand(3, 2)}
    yield "dtypes", {str(d): torch.zeros(2, dtype=d) for d in (
        torch.float16, torch.bfloat16, torch.uint16, torch.float8_e4m3fn, torch.bool,
        torch.complex64)}
    yield "module", lin.state_dict()
    yield "optimizer", {"model": lin.state_dict(), "opt": opt.state_dict(), "epoch": 3,
                        "name": "x", "size": torch.Size([2, 3]), "raw": b"\x00\xff"}
    yield "param", {"p": torch.nn.Parameter(torch.ones(2)), "scalar": torch.tensor(1.5)}


class Evil:
    def __reduce__(self):
        return os.system, ("true",)


def main():
    pdir = os.path.join(HERE, "corpus", "pickle")
    zdir = os.path.join(HERE, "corpus", "zip")
    os.makedirs(pdir, exist_ok=True)
    os.makedirs(zdir, exist_ok=True)
    for name, obj in checkpoints():
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
        with open(os.path.join(zdir, name + ".pt"), "wb") as f:
            f.write(data)
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl")][0]
            with open(os.path.join(pdir, name + ".pkl"), "wb") as f:
                f.write(z.read(pkl))
        buf = io.BytesIO()
        torch.save(obj, buf, _use_new_zipfile_serialization=False)
        with open(os.path.join(zdir, name + "_legacy.pt"), "wb") as f:
            f.write(buf.getvalue())
    with open(os.path.join(pdir, "evil_reduce.pkl"), "wb") as f:
        f.write(pickle.dumps({"w": Evil()}, protocol=2))
    with open(os.path.join(pdir, "protocol5.pkl"), "wb") as f:
        f.write(pickle.dumps({"a": [1, 2.5, "x", None, True, (1,), {3}, frozenset([4]),
                                    b"y", 2 ** 70]}, protocol=5))
    buf = io.BytesIO()
    torch.save({"w": torch.ones(1), "evil": Evil()}, buf)
    with open(os.path.join(zdir, "evil.pt"), "wb") as f:
        f.write(buf.getvalue())


if __name__ == "__main__":
    main()

"""The compiled module as a neighbour of other extension modules: it exports its entry point and
nothing else, so importing it first cannot change what torch's libraries bind to."""
import os
import shutil
import subprocess
import sys

import pytest

import tensorferry._core as core


def test_the_module_exports_only_its_entry_point():
    """python/src/exports.map: on the GPU machine (g++ 13) the module exported ~5,800 symbols,
    libstdc++ locale facet ids among them, and `import tensorferry._core, torch` aborted inside
    torch's import. Every defined dynamic symbol but PyInit__core is a regression."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", core.__file__], capture_output=True,
                         text=True, check=True).stdout
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert names == ["PyInit__core"], f"{core.__file__} exports {len(names)}: {names[:20]}"


@pytest.mark.parametrize("order", ["tensorferry._core, torch", "torch, tensorferry._core"])
def test_imports_in_either_order_with_torch(order):
    """Either import order works and leaves both usable (the abort above happened only with
    tensorferry first)."""
    code = (f"import {order}\n"
            "import tensorferry, torch\n"
            "t = torch.arange(6, dtype=torch.float32)\n"
            "assert float(t.sum()) == 15.0\n"
            "print(tensorferry.__version__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert r.returncode == 0, f"rc {r.returncode}: {r.stdout}{r.stderr}"
    assert r.stdout.strip()

"""One options layer (include/tensorferry/options.h): the Python keywords go through the same
LoadOptions::Set and Validated as the environment and the CLI, with the same messages."""
import pytest
import safetensors.torch
import torch

import tensorferry
from tensorferry import _core


@pytest.fixture
def path(tmp_path):
    p = str(tmp_path / "x.safetensors")
    safetensors.torch.save_file({"a": torch.ones(4), "b": torch.zeros(2, 3)}, p)
    return p


def test_bad_values_name_the_key_and_the_value(path):
    for kwargs, words in (({"order": "random"}, "order = random: unknown order"),
                          ({"engine": "fast"}, "engine = fast: unknown engine"),
                          ({"direct": "maybe"}, "direct = maybe: unknown O_DIRECT mode"),
                          ({"queue_depth": 0}, "queue_depth = 0 must be > 0"),
                          ({"chunk_size": 0}, "chunk_size = 0 must be > 0"),
                          ({"tp_rank": 0}, "tp_rank and tp_size go together")):
        with pytest.raises(tensorferry.InvalidArgumentError, match=words):
            tensorferry.Loader(path, **kwargs)
    with pytest.raises(tensorferry.InvalidArgumentError, match='unknown load option "speed"'):
        _core.Reader(path, False, {"speed": 11})


def test_the_environment_goes_through_the_same_checks(path, monkeypatch):
    monkeypatch.setenv("TENSORFERRY_QUEUE_DEPTH", "0")
    with pytest.raises(tensorferry.InvalidArgumentError,
                       match='TENSORFERRY_QUEUE_DEPTH="0": queue_depth = 0 must be > 0'):
        tensorferry.Loader(path, engine="pread")
    monkeypatch.setenv("TENSORFERRY_QUEUE_DEPTH", "16")
    monkeypatch.setenv("TENSORFERRY_ORDER", "layer")
    with tensorferry.Loader(path, engine="pread") as loader:
        options = loader.options
        assert options["queue_depth"] == 16 and options["order"] == "layer"


def test_text_and_ints_mean_the_same(path):
    a = _core.Reader(path, False, {"budget": "1MiB", "threads": "3", "populate": "on"}).options()
    b = _core.Reader(path, False, {"budget": 1 << 20, "threads": 3, "populate": True}).options()
    assert a == b
    assert a["budget"] == 1 << 20 and a["threads"] == 3 and a["populate"] is True


def test_options_show_every_key_and_no_secret(path, monkeypatch):
    # Every key Set accepts is in Loader.options (the tensor-parallel ones with tp_size), each
    # as the loader took it; secrets are shown as set or not, never as their value.
    monkeypatch.setenv("TENSORFERRY_VERIFY", "off")
    monkeypatch.setenv("TENSORFERRY_MEMORY_LIMIT", "off")
    with tensorferry.Loader(path, engine="pread", tp_rank=0, tp_size=2, drop_cache=True,
                            coop_exchange="none",
                            storage_options={"object_concurrency": 3,
                                             "s3_secret_access_key": "hunter2",
                                             "s3_access_key_id": "AKID",
                                             "http_token": "tok"}) as loader:
        options = loader.options
    assert set(_core.option_keys()) <= set(options), set(_core.option_keys()) - set(options)
    assert options["verify"] == "off" and options["memory_limit"] is None
    assert options["drop_cache"] is True and options["coop_exchange"] == "none"
    assert options["object_concurrency"] == 3 and options["tp_size"] == 2
    assert options["s3_access_key_id"] == "AKID"
    assert options["s3_secret_access_key"] == "<set>" and options["http_token"] == "<set>"
    assert options["gcs_token"] == "" and options["s3_anonymous"] is None
    assert "hunter2" not in repr(options) and "tok" not in repr(options).replace("token", "")
    with tensorferry.Loader(path, engine="pread", memory_limit="1GiB") as loader:
        assert loader.options["memory_limit"] == 1 << 30
        assert "tp_size" not in loader.options  # no tensor parallelism


def test_stats_carry_every_field(path):
    with tensorferry.Loader(path, engine="pread") as loader:
        loader.load()
        core = loader._reader.stats()
    for key in ("tensors", "bytes", "bytes_read", "batches", "seconds", "engine",
                "peak_device_bytes", "gds_reason", "pinned_bytes"):
        assert key in core
    assert core["tensors"] == 2 and core["engine"] == "pread"


def test_cuda_available_is_public():
    assert "cuda_available" in tensorferry.__all__
    available = tensorferry.cuda_available()
    assert isinstance(available, bool)
    # The same answer as torch's, which finds the same runtime and devices.
    import torch
    assert available == torch.cuda.is_available()


def test_a_misspelt_variable_is_named_by_the_cli_and_at_import(path):
    """TENSORFERRY_BUGDET would be ignored without a word (and the load it was meant to bound
    run without a budget): the CLI warns on stderr, the package logs it at import (logger
    "tensorferry"), with the nearest known name; the command and the import still run."""
    import os
    import subprocess
    import sys
    from conftest import CLI
    env = {**os.environ, "TENSORFERRY_BUGDET": "1GB", "TENSORFERRY_BUDGET": "1GB"}
    r = subprocess.run([CLI, "inspect", path], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ("tensorferry: warning: TENSORFERRY_BUGDET is not a tensorferry setting: "
                        "it is ignored (did you mean TENSORFERRY_BUDGET?)\n"), r.stderr
    # Logged, not a Python warning: even under -W error the import goes on.
    r = subprocess.run([sys.executable, "-W", "error", "-c", "import tensorferry"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ("TENSORFERRY_BUGDET is not a tensorferry setting: it is ignored (did you "
                        "mean TENSORFERRY_BUDGET?); docs/runtime_settings.md lists the "
                        "TENSORFERRY_* variables\n"), r.stderr
    r = subprocess.run([sys.executable, "-c", "import tensorferry"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "TENSORFERRY_BUDGET": "1GB"})
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_every_variable_the_sources_read_is_known(monkeypatch):
    """The list of variables read outside the options table (options.cc) keeps up with the
    sources: every TENSORFERRY_* name read from the environment anywhere in the repository
    (getenv, os.environ, a shell's $NAME) or written as a literal in the library's sources is
    known, so that no user of it is warned."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[2]
    read = re.compile(r'(?:getenv\(\s*|environ\.get\(\s*|environ\[\s*)["\'](TENSORFERRY_\w+)["\']'
                      r'|\$\{?(TENSORFERRY_\w+)')
    literal = re.compile(r'"(TENSORFERRY_[A-Z0-9_]*[A-Z0-9])"')
    names = set()
    for folder in ("src", "python", "tools", "tests", "scripts", "bench", ".ci", "fuzz"):
        for p in (root / folder).rglob("*"):
            if not p.is_file() or p.suffix not in {".cc", ".h", ".py", ".sh", ""}:
                continue
            try:
                text = p.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            names.update(a or b for a, b in read.findall(text))
            if folder in ("src", "python", "tools") and not p.name.endswith("_test.cc"):
                names.update(literal.findall(text))
    assert {"TENSORFERRY_CLI", "TENSORFERRY_CURL_LIBRARY", "TENSORFERRY_CUDA_RUNTIME",
            "TENSORFERRY_BUDGET"} <= names, names  # the scan finds what it must
    for name in names:
        monkeypatch.setenv(name, "1")
    assert _core.unknown_environment_variables() == []

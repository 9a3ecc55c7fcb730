"""hf:// paths: checkpoints named by their Hugging Face hub repository, read from the local hub
cache (include/tensorferry/hub.h). Checked against huggingface_hub itself: a cache laid out by
hand here is one the real package recognises (scan_cache_dir), and every hf:// path resolves to
the snapshot huggingface_hub's snapshot_download(local_files_only=True) returns; the cache folder
follows its environment variables the way huggingface_hub.constants reads them."""
import hashlib
import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch

import tensorferry
from conftest import CLI

huggingface_hub = pytest.importorskip("huggingface_hub")

MAIN = "a" * 40
PR = "b" * 40


def _blob(repo, data):
    digest = hashlib.sha256(data).hexdigest()
    path = repo / "blobs" / digest
    path.write_bytes(data)
    return digest


def make_cache(cache, repo_id="org/tiny", repo_type="model"):
    """A hub cache holding `repo_id` at two commits: main (two shards and their index) and
    refs/pr/1 (one file). Returns {commit: {file name: tensors}}."""
    repo = cache / (f"{repo_type}s--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs" / "refs" / "pr").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "refs" / "pr" / "1").write_text(PR)
    files = {
        MAIN: {"model-00001-of-00002.safetensors": {"a": torch.arange(6.0).reshape(2, 3)},
               "model-00002-of-00002.safetensors": {"b": torch.ones(4, dtype=torch.bfloat16)}},
        PR: {"model.safetensors": {"c": torch.zeros(3, dtype=torch.int32)}},
    }
    for commit, by_file in files.items():
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        weight_map = {}
        for name, tensors in by_file.items():
            digest = _blob(repo, safetensors.torch.save(tensors))
            (snap / name).symlink_to(f"../../blobs/{digest}")
            weight_map.update({t: name for t in tensors})
        if len(by_file) > 1:
            index = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
            digest = _blob(repo, index)
            (snap / "model.safetensors.index.json").symlink_to(f"../../blobs/{digest}")
    return files


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    files = make_cache(root)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    # The cache only: what it lacks is not looked for on the hub (test_object_store_hub.py).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return root, files


def test_the_hand_made_cache_is_one_huggingface_hub_recognises(cache):
    root, _ = cache
    info = huggingface_hub.scan_cache_dir(root)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == "org/tiny" and repo.repo_type == "model"
    assert {r.commit_hash for r in repo.revisions} == {MAIN, PR}
    assert {ref for r in repo.revisions for ref in r.refs} == {"main", "refs/pr/1"}


@pytest.mark.parametrize("path,revision,inside", [
    ("hf://org/tiny", None, ""),
    ("hf://org/tiny@main", "main", ""),
    (f"hf://org/tiny@{PR}", PR, ""),
    ("hf://org/tiny@refs%2Fpr%2F1", "refs/pr/1", ""),
    ("hf://org/tiny/model-00002-of-00002.safetensors", None, "model-00002-of-00002.safetensors"),
])
def test_paths_resolve_to_the_snapshot_huggingface_hub_returns(cache, path, revision, inside):
    root, files = cache
    snapshot = huggingface_hub.snapshot_download("org/tiny", revision=revision, cache_dir=root,
                                                 local_files_only=True)
    commit = os.path.basename(snapshot)
    with tensorferry.Loader(path) as loader:
        got_files = loader.files
        got = loader.load()
    if inside:
        assert got_files == [os.path.join(snapshot, inside)]
        want = files[commit][inside]
    else:
        assert sorted(got_files) == sorted(os.path.join(snapshot, f) for f in files[commit])
        want = {k: v for by_file in files[commit].values() for k, v in by_file.items()}
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_drop_in_apis_take_hf_paths(cache):
    _, files = cache
    import tensorferry.torch
    path = "hf://org/tiny/model-00001-of-00002.safetensors"
    want = files[MAIN]["model-00001-of-00002.safetensors"]
    with tensorferry.safe_open(path, "pt") as f:
        assert torch.equal(f.get_tensor("a"), want["a"])
    assert torch.equal(tensorferry.torch.load_file(path)["a"], want["a"])


def test_not_cached_says_what_to_download(cache):
    root, _ = cache
    with pytest.raises(FileNotFoundError) as e:
        tensorferry.Loader("hf://org/other")
    assert str(root) in str(e.value) and "hf download org/other" in str(e.value)
    with pytest.raises(FileNotFoundError, match='revision "v9" of org/tiny'):
        tensorferry.Loader("hf://org/tiny@v9")
    with pytest.raises(ValueError, match="has a '.' or '..' component"):
        tensorferry.Loader("hf://org/tiny/../tiny")
    # huggingface_hub agrees that nothing is there to use offline.
    with pytest.raises(huggingface_hub.errors.LocalEntryNotFoundError):
        huggingface_hub.snapshot_download("org/other", cache_dir=root, local_files_only=True)


def test_cli_loads_and_verifies_hub_blobs(cache):
    root, _ = cache
    env = dict(os.environ, HF_HUB_CACHE=str(root))
    r = subprocess.run([CLI, "verify", "hf://org/tiny", "--json"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert [f["hub_sha256"] for f in report["per_file"]] == ["ok", "ok"]
    r = subprocess.run([CLI, "load", "hf://org/tiny", "--json"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tensors"] == 2
    r = subprocess.run([CLI, "inspect", "hf://org/nothing"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 1 and "not in the Hugging Face hub cache" in r.stderr, r.stderr


CACHE_ENVS = [
    {"HF_HUB_CACHE": "{tmp}/explicit"},
    {"HUGGINGFACE_HUB_CACHE": "{tmp}/legacy", "HF_HOME": "{tmp}/ignored"},
    {"HF_HUB_CACHE": "$TF_TEST_ROOT/vars", "HUGGINGFACE_HUB_CACHE": "{tmp}/ignored"},
    {"HF_HOME": "~/hf-home"},
    {"XDG_CACHE_HOME": "{tmp}/xdg"},
    {},
]


@pytest.mark.parametrize("variables", CACHE_ENVS, ids=lambda v: "+".join(v) or "default")
def test_the_cache_folder_follows_huggingface_hubs_environment(tmp_path, variables):
    """In a child process with only these variables (and HOME) set: the folder
    huggingface_hub.constants.HF_HUB_CACHE names is the one hf:// paths are read from."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")}
    env["HOME"] = str(tmp_path / "home")
    env["TF_TEST_ROOT"] = str(tmp_path)
    env.update({k: v.format(tmp=tmp_path) for k, v in variables.items()})
    child = (
        "import pathlib, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import huggingface_hub.constants as c, tensorferry\n"
        "from test_hub import make_cache\n"
        "make_cache(pathlib.Path(c.HF_HUB_CACHE))\n"
        "with tensorferry.Loader('hf://org/tiny') as loader:\n"
        "    print(c.HF_HUB_CACHE, loader.files[0], sep='\\n')\n")
    r = subprocess.run([sys.executable, "-c", child, os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    hub_cache, first = r.stdout.splitlines()
    assert first.startswith(os.path.join(hub_cache, "models--org--tiny", "snapshots", MAIN))
    assert str(tmp_path) in hub_cache


def test_a_local_dir_download_linked_into_the_cache_says_how_to_load_it(cache, tmp_path):
    """huggingface_hub before 0.23 downloaded with --local-dir as links into its cache
    (local_dir_use_symlinks="auto": files of 5 MB and more; True: every file), absolute links to
    <cache>/models--OWNER--NAME/blobs/<sha256>. They leave the folder and are refused (accepting
    any hub blob would let an untrusted folder read every model of the machine's hub caches), the
    error saying how to load it; its hf:// path loads the same model, and so does a copy of the
    folder with the links replaced by their files."""
    import shutil
    root, files = cache
    snapshot = root / "models--org--tiny" / "snapshots" / MAIN
    local = tmp_path / "local"
    local.mkdir()
    for entry in snapshot.iterdir():
        (local / entry.name).symlink_to(os.path.realpath(entry))
    with pytest.raises(tensorferry.SafetensorError) as e:
        tensorferry.Loader(str(local))
    assert "outside the checkpoint directory" in str(e.value)
    assert "huggingface_hub before 0.23" in str(e.value) and "cp -rL" in str(e.value)
    r = subprocess.run([CLI, "load", str(local)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "hf://OWNER/NAME" in r.stderr, r.stderr
    want = {k: v for by_file in files[MAIN].values() for k, v in by_file.items()}
    copied = tmp_path / "copied"
    shutil.copytree(local, copied, symlinks=False)  # cp -rL
    for path in (str(copied), "hf://org/tiny"):
        with tensorferry.Loader(path) as loader:
            got = loader.load()
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), path

"""Loading straight from an HTTP model hub (issue 13's "HTTP model hub"): a hub on loopback shaped
like the Hugging Face Hub's file endpoints (hub_server.ModelHub: a resolver that answers each
weight file with a 302 to a signed, expiring CDN link, and nginx as the CDN checking the links).

What is checked: the prefix `<hub>/<org>/<name>/resolve/main` loads like a model folder (its index,
or its single model.safetensors) through Python and the CLI, byte for byte; the resolver is asked
once per file however many ranged GETs the load makes (the later ones go to the CDN link); links
that expire during a load are resolved again and the load completes byte-exact; a hub without the
model is a FileNotFoundError naming what was looked for; a gated model loads with its token, which
goes to the hub and never to its CDN; an https:// hub is never followed to a plain-text link;
transformers' from_pretrained of the hub prefix equals the local model. And hf:// paths that the
local hub cache lacks (HF_ENDPOINT naming this hub): streamed from the hub at the one commit a branch
named when the load opened, the cache preferred when it holds the checkpoint, errors naming both
places, HF_HUB_OFFLINE honoured."""
import hashlib
import json
import os
import shutil
import subprocess

import pytest
import torch
from conftest import CLI, raw_bytes
from hub_server import ModelHub, git_blob_id
from objstore_servers import TlsFront

import tensorferry
import tensorferry.torch


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_checkpoint):
    """Local folders: a sharded checkpoint (the CLI's tiny preset, with its index) and a
    single-file one (a 4 MiB model.safetensors)."""
    single = str(tmp_path_factory.mktemp("single"))
    torch.manual_seed(0)
    tensorferry.torch.save_file({"w": torch.randn(1024, 1024), "b": torch.arange(7.0)},
                                os.path.join(single, "model.safetensors"))
    return {"org/sharded": tiny_checkpoint, "org/single": single}


@pytest.fixture(scope="module")
def hub(models):
    with ModelHub() as h:
        for repo, local in models.items():
            h.add_repo(repo, local)
        yield h


def load_all(path, **kw):
    """The load, then its copies into the hub cache (they finish after the loader closes)."""
    with tensorferry.Loader(path, **kw) as loader:
        got = loader.load(), loader.stats
    tensorferry.wait_for_caches()
    return got


def assert_same(got, want):
    assert list(got) == list(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and tuple(got[name].shape) == tuple(w.shape), name
        assert raw_bytes(got[name]) == raw_bytes(w), name


def weight_files(local):
    return sorted(f for f in os.listdir(local) if f.endswith(".safetensors"))


@pytest.mark.parametrize("repo", ["org/sharded", "org/single"])
def test_a_hub_prefix_loads_like_a_model_folder(hub, models, repo):
    local = models[repo]
    want, _ = load_all(local)
    hub.reset_counts()
    # Small parts, one at a time: many ranged GETs per file.
    opts = {"object_part_size": "1MiB", "object_concurrency": 1}
    got, stats = load_all(hub.repo_url(repo), storage_options=opts)
    assert_same(got, want)
    files = weight_files(local)
    for f in files:  # every GET after the first went to the CDN link
        assert hub.resolve_count(repo, f) == 1, (f, hub.resolves)
    if repo == "org/single":
        assert stats.remote_requests >= 5  # 4 MiB in 1 MiB parts, and the header's GET
    # The CLI, the same checksum as the local folder's load.
    local_json = json.loads(subprocess.run([CLI, "load", local, "--json"], capture_output=True,
                                           text=True, check=True).stdout)
    r = subprocess.run([CLI, "load", hub.repo_url(repo), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    remote_json = json.loads(r.stdout)
    assert remote_json["checksum"] == local_json["checksum"]
    assert remote_json["tensors"] == local_json["tensors"]


def test_a_hub_without_the_model_names_what_was_looked_for(hub):
    url = hub.repo_url("org/none")
    with pytest.raises(FileNotFoundError) as e:
        tensorferry.Loader(url)
    message = str(e.value)
    assert url in message
    assert "model.safetensors.index.json" in message and "nor model.safetensors" in message


@pytest.fixture
def no_hf_token(monkeypatch, tmp_path):
    """No Hugging Face token or endpoint of the caller's: each test says what it uses."""
    for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token-file"))


def test_a_gated_model_loads_with_its_token_sent_to_the_hub_only(models, no_hf_token,
                                                                  monkeypatch):
    """The hub wants the token; its CDN refuses a request with one (as S3 refuses a presigned
    link with an Authorization header): the token goes to the origin only, through redirects
    too. HF_TOKEN reaches the Hugging Face hub's origins (here HF_ENDPOINT's) and no other."""
    local = models["org/sharded"]
    want, _ = load_all(local)
    with ModelHub() as h:
        h.add_repo("org/gated", local, token="hf_secret_1")
        url = h.repo_url("org/gated")
        with pytest.raises(OSError) as e:
            tensorferry.Loader(url)
        message = str(e.value)
        assert "HTTP 401" in message and "restricted" in message, message
        assert "no access token was sent" in message and "HF_TOKEN" in message
        # A repository the hub does not show without a token (401 RepositoryNotFound), asked
        # for as a prefix: the hub's answer is told, not only "neither file under this prefix".
        with pytest.raises(OSError) as e:
            tensorferry.Loader(h.repo_url("org/private"))
        message = str(e.value)
        assert "neither model.safetensors.index.json nor model.safetensors" in message, message
        assert "RepositoryNotFound" in message and "no access token was sent" in message, message
        got, _ = load_all(url, storage_options={"http_token": "hf_secret_1"})
        assert_same(got, want)
        # First GETs of 512 bytes: the index and every header take more GETs, which go straight
        # to where the first was redirected: the CDN's links without the token, the hub's own
        # cache of small files (the same origin) with it.
        h.reset_counts()
        got, _ = load_all(url, storage_options={"http_token": "hf_secret_1",
                                                "object_header_bytes": 512})
        assert_same(got, want)
        assert h.resolve_count("org/gated", "model.safetensors.index.json") == 1, h.resolves
        with pytest.raises(OSError) as e:
            tensorferry.Loader(url, storage_options={"http_token": "hf_wrong"})
        assert "the access token from the http_token option was sent" in str(e.value)
        assert "hf_wrong" not in str(e.value)
        # HF_TOKEN: only to the hub's origins; HF_ENDPOINT makes this hub one.
        monkeypatch.setenv("HF_TOKEN", "hf_secret_1")
        with pytest.raises(OSError, match="no access token was sent"):
            tensorferry.Loader(url)
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        got, _ = load_all(url)
        assert_same(got, want)
        # The CLI, from the environment.
        r = subprocess.run([CLI, "load", url, "--json"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        local_json = json.loads(subprocess.run([CLI, "load", local, "--json"],
                                               capture_output=True, text=True).stdout)
        assert json.loads(r.stdout)["checksum"] == local_json["checksum"]
        # huggingface_hub's token file, when HF_TOKEN is unset.
        monkeypatch.delenv("HF_TOKEN")
        token_file = os.environ["HF_TOKEN_PATH"]
        with open(token_file, "w") as f:
            f.write("hf_secret_1\n")
        got, _ = load_all(url)
        assert_same(got, want)


# --- hf:// paths not in the local hub cache: streamed from the hub -------------------------------


@pytest.fixture
def hf_hub(no_hf_token, monkeypatch, tmp_path):
    """A hub of its own as HF_ENDPOINT, and an empty local hub cache that loads leave empty
    (TENSORFERRY_OBJECT_HUB_CACHE=0: every load asks the hub; the tests of the hub cache's filling
    remove it)."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("TENSORFERRY_OBJECT_HUB_CACHE", "0")
    with ModelHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        yield h


def resolved_revisions(h, repo):
    return {rev for kind, r, rev, _ in h.log if kind == "resolve" and r == repo}


@pytest.mark.parametrize("repo", ["org/sharded", "org/single"])
def test_an_hf_path_not_cached_is_streamed_from_the_hub_at_one_commit(hf_hub, models, repo):
    local = models[repo]
    want, _ = load_all(local)
    commit = hf_hub.add_repo(repo, local)
    got, stats = load_all(f"hf://{repo}")
    assert_same(got, want)
    assert stats.remote_requests > 0
    # The branch was asked once through the API; every file was read at the commit it named.
    assert [x for x in hf_hub.log if x[0] == "api"] == [("api", repo, "main", "")]
    assert resolved_revisions(hf_hub, repo) == {commit}
    # The API's request and the reads share their connection to the hub (one GET at a time).
    hf_hub.reset_counts()
    got, _ = load_all(f"hf://{repo}", storage_options={"object_concurrency": 1})
    assert_same(got, want)
    if repo == "org/single":  # (a sharded checkpoint's files are opened 16 at a time)
        assert hf_hub.connections == 1, hf_hub.log
    # A commit is read as written: no API request.
    hf_hub.reset_counts()
    got, _ = load_all(f"hf://{repo}@{commit}")
    assert_same(got, want)
    assert [x for x in hf_hub.log if x[0] == "api"] == []
    assert resolved_revisions(hf_hub, repo) == {commit}
    # One file of the repository, and the drop-in APIs.
    name = weight_files(local)[0]
    with tensorferry.safe_open(f"hf://{repo}/{name}", "pt") as f:
        key = next(iter(f.keys()))
        assert raw_bytes(f.get_tensor(key)) == raw_bytes(want[key])
    # The CLI, from the same environment: the local folder's checksum.
    local_json = json.loads(subprocess.run([CLI, "load", local, "--json"], capture_output=True,
                                           text=True, check=True).stdout)
    r = subprocess.run([CLI, "load", f"hf://{repo}", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["checksum"] == local_json["checksum"]


def published_to_fill(h, repo, local, monkeypatch):
    """`local` published as `repo` on the hub `h`, with the hub cache's filling on (the default):
    the tensors of `local`, the commit, the hub cache and the repository's folder there."""
    monkeypatch.delenv("TENSORFERRY_OBJECT_HUB_CACHE")
    want, _ = load_all(local)
    commit = h.add_repo(repo, local)
    cache = os.environ["HF_HUB_CACHE"]
    return want, commit, cache, os.path.join(cache, "models--" + repo.replace("/", "--"))


def cached_repo(h, cache, repo):
    """scan_cache_dir's view of `repo` in the hub cache `cache`: (its one revision, no warnings)."""
    import huggingface_hub
    tensorferry.wait_for_caches()
    info = huggingface_hub.scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (found,) = [r for r in info.repos if r.repo_id == repo]
    (revision,) = found.revisions
    return revision


def test_an_hf_path_streamed_is_kept_in_the_hub_cache_as_huggingface_hub_keeps_it(
        hf_hub, models, monkeypatch):
    """object_hub_cache (on by default): what a load streams from the hub is kept in the local hub
    cache where huggingface_hub keeps it (blobs named by the hub's X-Linked-Etag, the SHA-256, or
    its ETag; links in the commit's snapshot; refs/main), written beside the load. huggingface_hub
    reads it as its own download, offline; the next load reads it and asks the hub nothing."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    local = models["org/sharded"]
    want, commit, cache, repo_dir = published_to_fill(hf_hub, "org/sharded", local, monkeypatch)
    names = sorted(os.listdir(local))
    got, stats = load_all("hf://org/sharded")
    assert_same(got, want)
    assert f"hub cache {cache}: 0 files read from it, {len(names)} downloaded into it" \
        in stats.engine_reason, stats.engine_reason
    with open(os.path.join(repo_dir, "refs", "main")) as f:
        assert f.read() == commit
    for name in names:
        path = huggingface_hub.try_to_load_from_cache("org/sharded", name, cache_dir=cache)
        assert path == os.path.join(repo_dir, "snapshots", commit, name)
        with open(path, "rb") as f, open(os.path.join(local, name), "rb") as g:
            data = f.read()
            assert data == g.read(), name
        blob = os.path.basename(os.path.realpath(path))
        want_blob = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") \
            else git_blob_id(data)
        assert blob == want_blob, name
    revision = cached_repo(hf_hub, cache, "org/sharded")
    assert revision.commit_hash == commit and revision.refs == {"main"}
    assert sorted(f.file_name for f in revision.files) == names
    assert sorted(os.listdir(os.path.join(repo_dir, "blobs"))) == \
        sorted(os.path.basename(os.path.realpath(f.file_path)) for f in revision.files)
    assert huggingface_hub.snapshot_download("org/sharded", cache_dir=cache,
                                             local_files_only=True) == \
        os.path.join(repo_dir, "snapshots", commit)
    # huggingface_hub's own check of the cache against the hub (`hf cache verify`): every file's
    # SHA-256 (weights) or git blob id (the rest) as the hub lists them; a changed byte is found.
    api = huggingface_hub.HfApi(endpoint=hf_hub.endpoint)
    checked = api.verify_repo_checksums("org/sharded", cache_dir=cache)
    assert checked.mismatches == [] and checked.missing_paths == [], checked
    assert checked.checked_count == len(names) and checked.revision == commit, checked
    # The next load, from Python and from the CLI: the snapshot, nothing asked of the hub.
    hf_hub.reset_counts()
    with tensorferry.Loader("hf://org/sharded") as loader:
        assert all(f.startswith(os.path.join(repo_dir, "snapshots", commit)) for f in loader.files)
        assert_same(loader.load(), want)
    r = subprocess.run([CLI, "load", "hf://org/sharded", "--json"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["remote_requests"] == 0
    assert hf_hub.log == []
    # A changed byte in a kept file is what that check reports.
    weights = os.path.realpath(os.path.join(repo_dir, "snapshots", commit, weight_files(local)[0]))
    with open(weights, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    checked = api.verify_repo_checksums("org/sharded", cache_dir=cache)
    assert [m["path"] for m in checked.mismatches] == [weight_files(local)[0]], checked


def test_a_single_file_is_kept_and_nothing_when_the_hub_cache_is_off(
        hf_hub, models, monkeypatch, tmp_path):
    """A file read through safe_open is kept; named by a commit, it writes no ref.
    object_hub_cache=False (storage_options, the CLI's --object-hub-cache 0,
    TENSORFERRY_OBJECT_HUB_CACHE=0) writes nothing."""
    pytest.importorskip("huggingface_hub")
    local = models["org/single"]
    want, commit, cache, repo_dir = published_to_fill(hf_hub, "org/single", local, monkeypatch)
    got, _ = load_all("hf://org/single", storage_options={"object_hub_cache": False})
    assert_same(got, want)
    r = subprocess.run([CLI, "load", "hf://org/single", "--object-hub-cache", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("TENSORFERRY_OBJECT_HUB_CACHE", "0")
    got, _ = load_all("hf://org/single")
    assert not os.path.exists(repo_dir), os.listdir(repo_dir)
    monkeypatch.delenv("TENSORFERRY_OBJECT_HUB_CACHE")
    with tensorferry.safe_open(f"hf://org/single@{commit}/model.safetensors", "pt") as f:
        assert raw_bytes(f.get_tensor("w")) == raw_bytes(want["w"])
    assert not os.path.exists(os.path.join(repo_dir, "refs"))
    revision = cached_repo(hf_hub, cache, "org/single")
    assert revision.commit_hash == commit
    assert [f.file_name for f in revision.files] == ["model.safetensors"]
    (kept,) = revision.files
    with open(kept.file_path, "rb") as f, open(os.path.join(local, "model.safetensors"), "rb") as g:
        assert f.read() == g.read()


def _single_model(folder, seed):
    os.makedirs(folder)
    torch.manual_seed(seed)
    tensorferry.torch.save_file({"w": torch.randn(256, 256), "b": torch.randn(256)},
                                os.path.join(folder, "model.safetensors"))
    return load_all(folder)[0]


def test_a_branch_that_moves_during_a_load_is_read_at_the_commit_it_named(hf_hub, tmp_path):
    """The branch moves to a new commit just as the hub answers which commit it names: the load
    reads that commit's bytes throughout, and the next load the new commit's. A commit and a
    branch with a '/' (refs/pr/1, written %2F) are revisions too."""
    v1 = _single_model(str(tmp_path / "v1"), 1)
    v2 = _single_model(str(tmp_path / "v2"), 2)
    first = hf_hub.add_repo("org/moving", str(tmp_path / "v1"))
    moved = []

    def move():
        if not moved:
            moved.append(hf_hub.add_repo("org/moving", str(tmp_path / "v2")))

    hf_hub.on_api = move
    got, _ = load_all("hf://org/moving")
    assert_same(got, v1)
    assert resolved_revisions(hf_hub, "org/moving") == {first}
    got, _ = load_all("hf://org/moving")
    assert_same(got, v2)
    # A commit is read as written, without asking the API.
    hf_hub.log.clear()
    got, _ = load_all(f"hf://org/moving@{first}")
    assert_same(got, v1)
    assert [x for x in hf_hub.log if x[0] == "api"] == []
    pr = hf_hub.add_repo("org/moving", str(tmp_path / "v1"), revision="refs/pr/1")
    hf_hub.log.clear()
    got, _ = load_all("hf://org/moving@refs%2Fpr%2F1/model.safetensors")
    assert_same(got, v1)
    assert [x for x in hf_hub.log if x[0] == "api"] == [("api", "org/moving", "refs/pr/1", "")]
    assert resolved_revisions(hf_hub, "org/moving") == {pr}


def test_the_commit_a_load_read_names_the_same_files_later_and_elsewhere(hf_hub, tmp_path,
                                                                           monkeypatch):
    """What the vLLM plugin sends its other ranks (_safe_open.pinned_hub_path): the path a load
    read, at the commit it read, from the root of its files whether streamed from the hub or
    read from the hub cache; it reads the same bytes after the branch moved."""
    from tensorferry import _safe_open
    v1 = _single_model(str(tmp_path / "v1"), 1)
    v2 = _single_model(str(tmp_path / "v2"), 2)
    first = hf_hub.add_repo("org/pinned", str(tmp_path / "v1"))
    with tensorferry.Loader("hf://org/pinned") as loader:
        root = _safe_open.hub_root(loader.files[0])
    assert root == f"{hf_hub.endpoint}/org/pinned/resolve/{first}"
    pinned = _safe_open.pinned_hub_path("hf://org/pinned", root)
    assert pinned == f"hf://org/pinned@{first}" and _safe_open.is_pinned_hub_path(pinned)
    assert not _safe_open.is_pinned_hub_path("hf://org/pinned")
    assert not _safe_open.is_pinned_hub_path("hf://org/pinned@main/" + "a" * 40)
    hf_hub.add_repo("org/pinned", str(tmp_path / "v2"))
    assert_same(load_all(pinned)[0], v1)
    assert_same(load_all("hf://org/pinned")[0], v2)
    # A file or folder inside, a revision named, another kind of repository; from the cache's
    # snapshot folder as from the hub's URL.
    snapshot = f"/c/hub/models--org--pinned/snapshots/{first}"
    for path, want in (("hf://org/pinned@main/model.safetensors",
                        f"hf://org/pinned@{first}/model.safetensors"),
                       ("hf://org/pinned@refs%2Fpr%2F1/sub/x.json",
                        f"hf://org/pinned@{first}/sub/x.json"),
                       # huggingface_hub's unescaped form: the ref whole is the revision
                       ("hf://org/pinned@refs/pr/1/sub/x.json",
                        f"hf://org/pinned@{first}/sub/x.json"),
                       ("hf://org/pinned@refs/convert/parquet",
                        f"hf://org/pinned@{first}"),
                       ("hf://org/pinned/sub", f"hf://org/pinned@{first}/sub"),
                       ("hf://org/pinnedmore", None), ("hf://other/pinned", None),
                       ("s3://org/pinned", None)):
        assert _safe_open.pinned_hub_path(path, root) == want, path
        assert _safe_open.pinned_hub_path(path, snapshot) == want, path
    assert _safe_open.pinned_hub_path(
        "hf://datasets/org/d/x.safetensors",
        f"/c/hub/datasets--org--d/snapshots/{first}") == f"hf://datasets/org/d@{first}/x.safetensors"
    assert _safe_open.pinned_hub_path(
        "hf://gpt2", f"{hf_hub.endpoint}/gpt2/resolve/{first}") == f"hf://gpt2@{first}"
    assert _safe_open.pinned_hub_path("hf://org/pinned", "/not/a/root") is None
    monkeypatch.setenv("HF_ENDPOINT", "https://elsewhere.example")  # not this hub's URL
    assert _safe_open.pinned_hub_path("hf://org/pinned", root) is None


def _coop_open_rank(rank, world, path, init, marks, out):
    """Rank 0 opens `path` first; rank 1 opens it once the test moved the branch."""
    import time

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        pg = dist.new_group(list(range(world)))
        if rank == 1:
            while not os.path.exists(os.path.join(marks, "moved")):
                time.sleep(0.05)
        with tensorferry.Loader(path, tp_rank=rank, tp_size=world, process_group=pg,
                                shard_rules="none") as loader:
            if rank == 0:
                open(os.path.join(marks, "opened"), "w").close()
            try:
                loader.load()
                result = {"ok": True}
            except Exception as e:  # noqa: BLE001 - reported to the test
                result = {"ok": False, "type": type(e).__name__, "message": str(e)}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_cooperative_ranks_that_read_two_commits_of_a_branch_fail_at_once(hf_hub, tmp_path):
    """A branch that moves between two ranks' opens (same layout, other bytes, no checksum
    records): the ranks refuse to exchange, each naming the disagreement, instead of mixing the
    two commits' bytes (the commit is part of what cooperative ranks compare)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import time

    import torch.multiprocessing as mp
    from safetensors.torch import save_file  # the reference writer: no checksum records
    for seed in (1, 2):
        os.makedirs(tmp_path / f"v{seed}")
        torch.manual_seed(seed)
        save_file({"w": torch.randn(256, 256), "b": torch.randn(256)},
                  str(tmp_path / f"v{seed}" / "model.safetensors"))
    hf_hub.add_repo("org/coop", str(tmp_path / "v1"))
    marks, out = str(tmp_path / "marks"), str(tmp_path / "result")
    os.makedirs(marks)
    ctx = mp.spawn(_coop_open_rank, args=(2, "hf://org/coop", f"file://{tmp_path}/init", marks,
                                          out), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(marks, "opened")) and time.monotonic() < deadline:
        time.sleep(0.05)
    hf_hub.add_repo("org/coop", str(tmp_path / "v2"))
    open(os.path.join(marks, "moved"), "w").close()
    while not ctx.join():
        pass
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            result = json.load(f)
        assert not result["ok"], rank
        assert "disagree on planning" in result["message"], result
    assert len(resolved_revisions(hf_hub, "org/coop")) == 2  # each rank read its own commit


def test_the_cache_wins_and_an_incomplete_snapshot_reads_the_hub(hf_hub, models, tmp_path):
    """huggingface_hub's own snapshot_download from this hub fills the cache: then nothing is
    asked of the hub. A snapshot holding only config.json (what AutoConfig fetches) is not the
    checkpoint: the hub is read."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    local = models["org/sharded"]
    want, _ = load_all(local)
    hf_hub.add_repo("org/sharded", local)
    cache = os.environ["HF_HUB_CACHE"]
    # endpoint= as well: huggingface_hub reads HF_ENDPOINT once, when first imported.
    snapshot = huggingface_hub.snapshot_download("org/sharded", cache_dir=cache,
                                                 endpoint=hf_hub.endpoint)
    hf_hub.log.clear()
    with tensorferry.Loader("hf://org/sharded") as loader:
        assert all(f.startswith(snapshot) for f in loader.files), loader.files
        assert_same(loader.load(), want)
    assert hf_hub.log == []
    # Only a config in the cache's snapshot of another repository.
    with_config = str(tmp_path / "single-with-config")
    shutil.copytree(models["org/single"], with_config)
    with open(os.path.join(with_config, "config.json"), "w") as f:
        f.write('{"model_type": "llama"}')
    want_single, _ = load_all(models["org/single"])
    hf_hub.add_repo("org/single", with_config)
    huggingface_hub.hf_hub_download("org/single", "config.json", cache_dir=cache,
                                    endpoint=hf_hub.endpoint)
    got, _ = load_all("hf://org/single")
    assert_same(got, want_single)
    assert any(x[0] == "resolve" and x[3] == "model.safetensors" for x in hf_hub.log)


def test_what_neither_the_cache_nor_the_hub_has_names_both(hf_hub, models, monkeypatch):
    hf_hub.add_repo("org/single", models["org/single"])
    cache = os.environ["HF_HUB_CACHE"]
    with pytest.raises(FileNotFoundError) as e:
        tensorferry.Loader("hf://org/none")
    message = str(e.value)
    assert "not in the Hugging Face hub cache" in message and cache in message, message
    assert hf_hub.endpoint in message and "RepositoryNotFound" in message, message
    with pytest.raises(FileNotFoundError, match="RevisionNotFound"):
        tensorferry.Loader("hf://org/single@v9")
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        tensorferry.Loader("hf://org/single/nope.safetensors")
    # Offline: the hub is not asked.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf_hub.log.clear()
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE is set, so the hub"):
        tensorferry.Loader("hf://org/single")
    assert hf_hub.log == []
    r = subprocess.run([CLI, "inspect", "hf://org/single"], capture_output=True, text=True)
    assert r.returncode == 1 and "HF_HUB_OFFLINE" in r.stderr, r.stderr


def test_a_gated_hf_path_takes_hf_token(hf_hub, models, monkeypatch):
    local = models["org/single"]
    want, _ = load_all(local)
    hf_hub.add_repo("org/gated", local, token="hf_secret_2")
    with pytest.raises(OSError) as e:
        tensorferry.Loader("hf://org/gated")
    assert "GatedRepo" in str(e.value) and "no access token was sent" in str(e.value)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_2")
    got, _ = load_all("hf://org/gated")
    assert_same(got, want)


def test_links_that_expire_during_a_load_are_resolved_again(models, tmp_path):
    """Links live 1 s and the CDN sends each part at 1 MiB/s: every part after the first finds
    its link expired (403), asks the resolver again and completes; the load is byte-exact."""
    local = models["org/single"]
    want, _ = load_all(local)
    with ModelHub(link_ttl_s=1, cdn_rate="1m") as h:
        h.add_repo("org/single", local)
        opts = {"object_part_size": "1MiB", "object_concurrency": 1}
        got, stats = load_all(h.repo_url("org/single"), storage_options=opts)
        assert_same(got, want)
        resolves = h.resolve_count("org/single", "model.safetensors")
        parts = -(-os.path.getsize(os.path.join(local, "model.safetensors")) // (1 << 20))
        assert 2 <= resolves <= parts + 1, (resolves, parts)
        assert stats.remote_retries == 0  # an expired link is not a failed attempt


def test_an_https_hub_is_never_followed_to_plain_http(models, tmp_path):
    local = models["org/single"]
    want, _ = load_all(local)
    with ModelHub() as h:
        h.add_repo("org/single", local)
        os.makedirs(tmp_path / "hub")
        os.makedirs(tmp_path / "cdn")
        hub_tls = TlsFront(h._http.server_address[1], str(tmp_path / "hub"))
        cdn_tls = TlsFront(h.cdn.port, str(tmp_path / "cdn"))
        try:
            bundle = str(tmp_path / "bundle.pem")
            with open(bundle, "w") as out:
                for front in (hub_tls, cdn_tls):
                    with open(front.cert) as f:
                        out.write(f.read())
            opts = {"object_ca_bundle": bundle}
            url = f"https://127.0.0.1:{hub_tls.port}/org/single/resolve/main"
            # Links to http://: refused at once, naming the link without its signature.
            with pytest.raises(OSError) as e:
                tensorferry.Loader(url, storage_options=opts)
            message = str(e.value)
            assert "refused to follow the redirect to http://" in message, message
            assert "from https:// only to https://" in message and "md5=" not in message
            assert "attempts" not in message
            # Links to https://: followed.
            h.cdn_base = f"https://127.0.0.1:{cdn_tls.port}"
            got, _ = load_all(url, storage_options=opts)
            assert_same(got, want)
        finally:
            hub_tls.close()
            cdn_tls.close()


def tiny_llama_config(transformers):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16)


def assert_same_parameters(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name].reshape(-1).view(torch.uint8),
                           sb[name].reshape(-1).view(torch.uint8)), name


def test_from_pretrained_of_a_hub_prefix_equals_the_local_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    import tensorferry.transformers as tft
    config = tiny_llama_config(transformers)
    for shard in (None, "60KB"):
        folder = tmp_path / f"llama-{shard}"
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        if shard:
            model.save_pretrained(folder, max_shard_size=shard)
        else:
            model.save_pretrained(folder)
        with ModelHub() as h:
            h.add_repo("org/llama", str(folder))
            ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
            with tft.loading():
                got = transformers.AutoModelForCausalLM.from_pretrained(
                    h.repo_url("org/llama"), dtype=torch.bfloat16)
            for f in weight_files(folder):
                assert h.resolve_count("org/llama", f) >= 1
        assert_same_parameters(ref, got)
        shutil.rmtree(folder)


def published_llama(hub, tmp_path, monkeypatch):
    """A tiny Llama saved in 4 shards and published as org/llama on `hub`, with the hub cache's
    filling on: (transformers, tensorferry.transformers, its config, its folder, the commit, the
    model as transformers loads the folder)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("huggingface_hub")
    import tensorferry.transformers as tft
    monkeypatch.delenv("TENSORFERRY_OBJECT_HUB_CACHE")
    config = tiny_llama_config(transformers)
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(
        folder, max_shard_size="60KB")
    commit = hub.add_repo("org/llama", str(folder))
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    return transformers, tft, config, folder, commit, ref


def test_from_pretrained_of_an_hf_path_streams_then_reads_the_cache(hf_hub, tmp_path,
                                                                    monkeypatch):
    """Inside tensorferry.transformers.loading(), from_pretrained("hf://org/llama"): streamed from
    the hub when the cache lacks it (the configuration and the weights from the one commit the
    branch named), and kept in the hub cache as it streams: then transformers alone loads it
    offline from there, and the next from_pretrained("hf://...") reads the cache's snapshot."""
    transformers, tft, config, folder, commit, ref = published_llama(hf_hub, tmp_path,
                                                                     monkeypatch)

    with tft.loading():
        assert_same_parameters(ref, transformers.AutoModelForCausalLM.from_pretrained(
            "hf://org/llama", dtype=torch.bfloat16))
        with pytest.raises(OSError, match="name the revision in the path"):
            transformers.AutoModelForCausalLM.from_pretrained("hf://org/llama", revision="v2")
    assert len([x for x in hf_hub.log if x[0] == "api"]) == 1, hf_hub.log
    assert resolved_revisions(hf_hub, "org/llama") == {commit}
    assert any(x[3] == "config.json" for x in hf_hub.log)
    hf_hub.log.clear()
    tensorferry.wait_for_caches()  # the copies finish after the load
    # transformers alone, offline (cache_dir given: it reads HF_HUB_CACHE when first imported).
    assert_same_parameters(ref, transformers.AutoModelForCausalLM.from_pretrained(
        "org/llama", dtype=torch.bfloat16, cache_dir=os.environ["HF_HUB_CACHE"],
        local_files_only=True))
    with tft.loading():
        assert_same_parameters(ref, transformers.AutoModelForCausalLM.from_pretrained(
            "hf://org/llama", dtype=torch.bfloat16))
    assert hf_hub.log == []


def test_from_pretrained_of_a_plain_hub_id_streams_inside_loading(hf_hub, tmp_path, monkeypatch):
    """Inside loading() (hub="stream", the default), from_pretrained("org/llama") reads the model
    as hf://org/llama: the branch pinned by one API request, the weights streamed and kept in the
    hub cache (which transformers alone then reads offline). A repository tensorferry cannot read
    (no safetensors: a tokenizer's, a configuration's) is left to transformers' own download, and
    so is every model with hub="download"."""
    transformers, tft, config, folder, commit, ref = published_llama(hf_hub, tmp_path,
                                                                     monkeypatch)
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    shutil.copy(folder / "config.json", only_config / "config.json")
    hf_hub.add_repo("org/config-only", str(only_config))
    cache = os.environ["HF_HUB_CACHE"]
    # transformers' own downloads below ask the hub huggingface_hub was imported with: this one.
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "ENDPOINT", hf_hub.endpoint)
    # And its cache (where transformers' resolve_revision records refs/main).
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    # transformers' one HfApi (its resolve_revision's) keeps the endpoint it was made with.
    import transformers.utils.hub
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        hf_hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")

    with tft.loading():
        assert_same_parameters(ref, transformers.AutoModelForCausalLM.from_pretrained(
            "org/llama", dtype=torch.bfloat16))
        # Nothing for tensorferry to read there: transformers resolves it as always.
        got = transformers.AutoConfig.from_pretrained("org/config-only")
        assert got.hidden_size == config.hidden_size
    assert [x for x in hf_hub.log if x[0] == "api" and x[1] == "org/llama"] == \
        [("api", "org/llama", "main", "")], hf_hub.log  # tensorferry's pinning, once
    assert resolved_revisions(hf_hub, "org/llama") == {commit}, hf_hub.log
    tensorferry.wait_for_caches()  # the copies finish after the load
    repo_dir = os.path.join(cache, "models--org--llama")
    kept = sorted(os.listdir(os.path.join(repo_dir, "snapshots", commit)))
    assert set(weight_files(folder)) | {"config.json", "model.safetensors.index.json"} <= \
        set(kept), kept
    hf_hub.log.clear()
    assert_same_parameters(ref, transformers.AutoModelForCausalLM.from_pretrained(
        "org/llama", dtype=torch.bfloat16, cache_dir=cache, local_files_only=True))
    assert hf_hub.log == []
    # hub="download", and the arguments that keep transformers' own download.
    with tft.loading(hub="download"):
        assert tft._streamed_id("org/llama", (), {}) is None
        assert_same_parameters(ref, transformers.AutoModelForCausalLM.from_pretrained(
            "org/llama", dtype=torch.bfloat16))
    with tft.loading():
        assert tft._streamed_id("org/llama", (), {"revision": "refs/pr/1"}) == \
            "hf://org/llama@refs%2Fpr%2F1"
        for kwargs in ({"cache_dir": cache}, {"token": "hf_x"}, {"local_files_only": True},
                       {"force_download": True}, {"repo_type": "dataset"}):
            assert tft._streamed_id("org/llama", (), kwargs) is None, kwargs
        assert tft._streamed_id(str(folder), (), {}) is None
    with pytest.raises(tensorferry.InvalidArgumentError, match="hub must be"):
        tft.enable(hub="upload")

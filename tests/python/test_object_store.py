"""Checkpoints read from object storage (issue 13) against real servers on loopback: SeaweedFS (S3
with SigV4 identities) and nginx (HTTP range reads), started once per session by the fixtures of
conftest.py (they fail, never skip, when a server is missing).

Every load is compared byte for byte with the same API loading the local copy. This file covers
the sources (file, index, prefix, listing) through Python, the CLI and C++, the prefix rules, and
credentials and endpoints; test_object_store_faults.py covers faults (through the fault proxy) and
tensor parallelism."""
import json
import os
import shutil
import subprocess
import time

import pytest
import torch
from conftest import CLI, ROOT, raw_bytes
from objstore_servers import TlsFront

import tensorferry
import tensorferry.numpy
import tensorferry.torch
from tensorferry import InvalidArgumentError, SafetensorError, safe_open

REF_DIR = os.path.join(ROOT, "tests", "data", "reference")
REF_FILES = sorted(f for f in os.listdir(REF_DIR) if f.endswith(".safetensors"))
PREFIX = "objstore-tests"  # every key this file writes starts here


def clean_aws_env(monkeypatch):
    """No AWS_* variable of the caller, and no ~/.aws files: each test says what it uses."""
    for name in list(os.environ):
        if name.startswith("AWS_") or name.startswith("TENSORFERRY_OBJECT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(autouse=True)
def _no_ambient_aws(monkeypatch):
    clean_aws_env(monkeypatch)


class Stores:
    """The checkpoints uploaded once per module, and how to name them.

    S3 (bucket BUCKET): PREFIX/ref/<file>, PREFIX/tiny/ (shards + index), PREFIX/tiny-noindex/
    (shards without index: a listing, with a config.json and a sub/ beside them);
    PUBLIC_BUCKET: PREFIX/tiny/. nginx: PREFIX/ref/, PREFIX/tiny/."""

    def __init__(self, seaweed, nginx_http, tiny):
        self.seaweed, self.nginx, self.tiny = seaweed, nginx_http, tiny
        self.shards = sorted(f for f in os.listdir(tiny) if f.endswith(".safetensors"))
        self.tiny_noindex = os.path.join(os.path.dirname(tiny), "ckpt-noindex")
        os.makedirs(self.tiny_noindex, exist_ok=True)
        for shard in self.shards:
            shutil.copyfile(os.path.join(tiny, shard), os.path.join(self.tiny_noindex, shard))
        b = seaweed.BUCKET
        seaweed.upload_dir(b, f"{PREFIX}/ref", REF_DIR)
        seaweed.upload_dir(b, f"{PREFIX}/tiny", tiny)
        for shard in self.shards:
            seaweed.upload(b, f"{PREFIX}/tiny-noindex/{shard}", os.path.join(tiny, shard))
        # Not part of the listed checkpoint: other suffixes, and objects one level down.
        seaweed.upload(b, f"{PREFIX}/tiny-noindex/config.json", b"{}")
        seaweed.upload(b, f"{PREFIX}/tiny-noindex/sub/extra.safetensors",
                       os.path.join(tiny, self.shards[0]))
        seaweed.upload_dir(seaweed.PUBLIC_BUCKET, f"{PREFIX}/tiny", tiny)
        nginx_http.copy_dir(REF_DIR, f"{PREFIX}/ref")
        nginx_http.copy_dir(tiny, f"{PREFIX}/tiny")

    def s3_options(self, endpoint=None, keys=None, **more):
        keys = keys or self.seaweed.ADMIN_KEY
        opts = {"s3_endpoint": endpoint or self.seaweed.endpoint, "s3_region": self.seaweed.REGION,
                "s3_access_key_id": keys[0], "s3_secret_access_key": keys[1]}
        opts.update(more)
        return opts

    def url(self, store, rel):
        """(URL, storage_options) of PREFIX/rel on "s3" or "http"."""
        if store == "s3":
            return self.seaweed.url(f"{PREFIX}/{rel}"), self.s3_options()
        return self.nginx.url(f"{PREFIX}/{rel}"), {}

    def tiny_form(self, store, form):
        """(URL, options, local path) of the tiny checkpoint as a file, index, prefix or listing."""
        rel, local = {
            "file": (f"tiny/{self.shards[0]}", os.path.join(self.tiny, self.shards[0])),
            "index": ("tiny/model.safetensors.index.json", self.tiny),
            "prefix": ("tiny", self.tiny),
            "listing": ("tiny-noindex", self.tiny_noindex),
        }[form]
        url, opts = self.url(store, rel)
        return url, opts, local


@pytest.fixture(scope="module")
def stores(seaweed, nginx_http, tiny_checkpoint):
    return Stores(seaweed, nginx_http, tiny_checkpoint)


TINY_FORMS = [("s3", "file"), ("s3", "index"), ("s3", "prefix"), ("s3", "listing"),
              ("http", "file"), ("http", "index"), ("http", "prefix")]


def assert_same(got, want):
    assert list(got) == list(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), name
        assert raw_bytes(g) == raw_bytes(w), name


def load_all(path, **kw):
    """Every tensor of a checkpoint (file, index or directory) through tensorferry.Loader."""
    with tensorferry.Loader(path, **kw) as loader:
        return loader.load()


def load_both(load, local, url, **kw):
    """load(local) and load(url, **kw); when the local load raises, the remote one raises the
    same exception type (an unsupported dtype is not the object store's business)."""
    try:
        want = load(local)
    except Exception as e:  # noqa: BLE001 - compared with the remote behaviour below
        with pytest.raises(type(e)):
            load(url, **kw)
        return None, None
    return load(url, **kw), want


def cli(*args, env=None, timeout=60):
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=timeout, env=full)


def cli_checksum(path, *args, env=None):
    r = cli("load", path, "--json", *args, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# --- 1. byte-exact loads --------------------------------------------------------------------------

@pytest.mark.parametrize("store", ["s3", "http"])
@pytest.mark.parametrize("name", REF_FILES)
def test_reference_file_is_byte_exact(stores, store, name):
    url, opts = stores.url(store, f"ref/{name}")
    local = os.path.join(REF_DIR, name)
    for module in (tensorferry.torch, tensorferry.numpy):
        got, want = load_both(module.load_file, local, url, storage_options=opts)
        if want is not None:
            assert_same(got, want)
    with safe_open(local, "pt") as a, safe_open(url, "pt", storage_options=opts) as b:
        assert list(b.keys()) == list(a.keys())
        assert b.metadata() == a.metadata()
        for key in a.keys():
            try:
                want = a.get_tensor(key)
            except Exception as e:  # noqa: BLE001 - a dtype torch lacks: the same error remotely
                with pytest.raises(type(e)):
                    b.get_tensor(key)
                continue
            assert_same({key: b.get_tensor(key)}, {key: want})
            if want.dim() > 0 and want.shape[0] > 1:
                assert raw_bytes(b.get_slice(key)[1:]) == raw_bytes(a.get_slice(key)[1:])


@pytest.mark.parametrize("store,form", TINY_FORMS)
def test_tiny_checkpoint_is_byte_exact_through_python(stores, store, form):
    url, opts, local = stores.tiny_form(store, form)
    with tensorferry.Loader(local) as loader:
        want, keys, metadata = loader.load(), loader.keys(), loader.metadata()
    with tensorferry.Loader(url, storage_options=opts) as loader:
        assert loader.keys() == keys
        assert loader.metadata() == metadata
        assert_same(loader.load(), want)
        stats = loader.stats
        assert stats.remote_requests > 0 and stats.remote_bytes >= stats.bytes
    got_np, want_np = load_both(lambda p, **kw: load_all(p, framework="np", **kw), local, url,
                                storage_options=opts)
    if want_np is not None:
        assert_same(got_np, want_np)
    # Under a budget, batch by batch.
    largest = max(t.numel() * t.element_size() for t in want.values())
    seen = []
    with tensorferry.Loader(url, budget="48KB", allow_oversized=True,
                            storage_options=opts) as loader:
        for batch in loader.iter_batches():
            assert_same(batch.tensors, {k: want[k] for k in batch.tensors})
            seen += list(batch.tensors)
            del batch  # the budget counts what is still held
        assert loader.stats.peak_budget_bytes <= max(48 << 10, largest)
        assert loader.stats.batches > 1
    assert sorted(seen) == sorted(want)
    if form == "file":  # the single-file APIs
        for module in (tensorferry.torch, tensorferry.numpy):
            got, want_file = load_both(module.load_file, local, url, storage_options=opts)
            if want_file is not None:
                assert_same(got, want_file)
        with safe_open(local, "pt") as a, safe_open(url, "pt", storage_options=opts) as b:
            assert list(b.keys()) == list(a.keys()) and b.metadata() == a.metadata()
            name = next(k for k in a.keys() if a.get_slice(k).get_shape()[0] > 2)
            assert torch.equal(b.get_slice(name)[1:3], a.get_slice(name)[1:3])


def test_a_loader_of_an_open_loader_asks_the_store_nothing_more(stores, s3_proxy):
    """Loader(open_loader, ...) reads the first loader's checkpoint with its own options (here a
    budget): making it sends no request (no listing, index or header read again), its load is
    byte-exact, and a closed loader cannot be read so."""
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    opts = stores.s3_options(endpoint=s3_proxy.url)
    with tensorferry.Loader(url, storage_options=opts) as first:
        before = s3_proxy.stats()["requests"]
        with tensorferry.Loader(first, budget="48KB", allow_oversized=True) as loader:
            assert s3_proxy.stats()["requests"] == before
            assert loader.keys() == first.keys()
            got = {name: t.clone() for name, t in loader.iter_tensors()}
            assert loader.stats.batches > 1
    assert_same(got, load_all(stores.tiny))
    with pytest.raises(InvalidArgumentError, match="closed"):
        tensorferry.Loader(first)


@pytest.mark.parametrize("store,form", TINY_FORMS)
def test_tiny_checkpoint_through_the_cli(stores, store, form):
    url, _, local = stores.tiny_form(store, form)
    env = stores.seaweed.env() if store == "s3" else {}
    want = cli_checksum(local)
    got = cli_checksum(url, env=env)
    assert got["checksum"] == want["checksum"]
    assert got["tensors"] == want["tensors"] and got["bytes"] == want["bytes"]
    assert got["remote_requests"] > 0 and got["remote_bytes"] >= got["bytes"]
    inspect_local, inspect_remote = cli("inspect", local, "--json"), cli("inspect", url, "--json",
                                                                        env=env)
    assert inspect_remote.returncode == 0, inspect_remote.stderr
    assert inspect_local.returncode == 0, inspect_local.stderr
    a, b = json.loads(inspect_local.stdout), json.loads(inspect_remote.stdout)
    for doc in (a, b):  # the files are named by path or URL: compare their base names
        for t in doc["tensors"]:
            t["file"] = t["file"].rsplit("/", 1)[-1]
    assert b["tensors"] == a["tensors"] and b["totals"] == a["totals"]
    verify = cli("verify", url, env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize("store", ["s3", "http"])
def test_reshard_from_a_url_writes_what_reshard_from_disk_writes(stores, store, tmp_path):
    url, _, local = stores.tiny_form(store, "index")
    env = stores.seaweed.env() if store == "s3" else {}
    for src, dst in ((local, tmp_path / "from-disk"), (url, tmp_path / "from-url")):
        r = cli("reshard", src, str(dst), "--tp", "2", "--no-sync", env=env)
        assert r.returncode == 0, r.stderr
    written = sorted(os.path.relpath(os.path.join(d, f), tmp_path / "from-disk")
                     for d, _, files in os.walk(tmp_path / "from-disk") for f in files)
    assert written and written == sorted(
        os.path.relpath(os.path.join(d, f), tmp_path / "from-url")
        for d, _, files in os.walk(tmp_path / "from-url") for f in files)
    for rel in written:
        if rel.endswith(".safetensors"):
            assert_same(load_all(str(tmp_path / "from-url" / rel)),
                        load_all(str(tmp_path / "from-disk" / rel)))


def gtest_binary():
    """build/<flavour>/tensorferry_tests beside the CLI's bin/ directory."""
    candidates = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(CLI))),
                               "tensorferry_tests"),
                  os.path.join(ROOT, "build", "release", "tensorferry_tests")]
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    pytest.fail(f"tensorferry_tests not found (looked at {candidates}): build it "
                f"(cmake --build build/release --target tensorferry_tests)", pytrace=False)


def test_cpp_live_tests_run_against_seaweed(stores):
    env = dict(stores.seaweed.env())
    env["TENSORFERRY_TEST_S3_URL"] = stores.seaweed.url(f"{PREFIX}/tiny")
    env["TENSORFERRY_TEST_S3_LOCAL"] = stores.tiny
    full = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    full.update(env)
    r = subprocess.run([gtest_binary(), "--gtest_filter=ObjectSourceLive*", "--gtest_brief=0"],
                       capture_output=True, text=True, timeout=120, env=full)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "[  PASSED  ] 9 tests." in out, out
    assert "SKIPPED" not in out, out


@pytest.mark.parametrize("store", ["s3", "http"])
def test_keys_with_utf8_and_reserved_characters(stores, store):
    """Keys are encoded in requests (and signed as encoded): UTF-8, '+', '=', ',', '@' and '%'
    in the prefix, and an index naming a shard with '#', '?', '%', brackets (an http URL must
    encode them: they are part of the name)."""
    local = os.path.join(REF_DIR, "all_dtypes.safetensors")
    tiny_shard = os.path.join(stores.tiny, stores.shards[0])
    odd_dir, shard_name = "ödd dir+=1,@%41", "shärd(1)+[x]#?%41.safetensors"
    index = json.dumps({"metadata": {}, "weight_map": {
        k: shard_name for k in tensorferry.torch.load_file(tiny_shard)}}).encode()
    if store == "s3":
        b = stores.seaweed.BUCKET
        stores.seaweed.upload(b, f"{PREFIX}/{odd_dir}/all.safetensors", open(local, "rb").read())
        stores.seaweed.upload(b, f"{PREFIX}/{odd_dir}/{shard_name}", open(tiny_shard, "rb").read())
        stores.seaweed.upload(b, f"{PREFIX}/{odd_dir}/model.safetensors.index.json", index)
        base, opts = stores.seaweed.url(f"{PREFIX}/{odd_dir}"), stores.s3_options()
    else:
        from urllib.parse import quote
        stores.nginx.put(f"{PREFIX}/{odd_dir}/all.safetensors", open(local, "rb").read())
        stores.nginx.put(f"{PREFIX}/{odd_dir}/{shard_name}", open(tiny_shard, "rb").read())
        stores.nginx.put(f"{PREFIX}/{odd_dir}/model.safetensors.index.json", index)
        base, opts = stores.nginx.url(quote(f"{PREFIX}/{odd_dir}")), {}  # URLs are encoded
    assert_same(tensorferry.torch.load_file(f"{base}/all.safetensors", storage_options=opts),
                tensorferry.torch.load_file(local))
    assert_same(load_all(base, storage_options=opts), load_all(tiny_shard))


def test_dot_segments_never_read_another_key(stores):
    """A key's "." or ".." segment is a path step to libcurl and some servers: a URL that holds
    one is refused (it could read another bucket's key); an index's "./name" means name."""
    b = stores.seaweed.BUCKET
    for key in (f"{PREFIX}/x/../tiny/{stores.shards[0]}", f"{PREFIX}/./tiny/{stores.shards[0]}",
                f"{PREFIX}/tiny/.."):
        with pytest.raises(tensorferry.InvalidArgumentError) as e:
            tensorferry.Loader(stores.seaweed.url(key), storage_options=stores.s3_options())
        assert "segment (a path step, not a name)" in str(e.value), str(e.value)
    tiny_shard = os.path.join(stores.tiny, stores.shards[0])
    names = tensorferry.torch.load_file(tiny_shard)
    stores.seaweed.upload(b, f"{PREFIX}/dotted/{stores.shards[0]}", open(tiny_shard, "rb").read())
    stores.seaweed.upload(b, f"{PREFIX}/dotted/model.safetensors.index.json", json.dumps(
        {"metadata": {}, "weight_map": {k: f"./{stores.shards[0]}" for k in names}}).encode())
    assert_same(load_all(stores.seaweed.url(f"{PREFIX}/dotted"),
                         storage_options=stores.s3_options()), load_all(tiny_shard))


@pytest.mark.parametrize("part_size", ["8MiB", "1MiB"])
def test_checks_as_the_body_lands_find_a_corrupt_byte(stores, tmp_path, part_size):
    """Checksums of an object store's bytes are checked as each GET's body lands (in pieces of
    512 KiB and more, read_engine.h's LandingScope): a checkpoint with embedded checksums loads
    verified and byte-exact, and one byte flipped deep in a 10 MiB tensor (chunk 2 of 3) is the
    checksum error naming the tensor and chunk, whatever the part size."""
    want = {"a": torch.arange(10 * 1024 * 1024 // 4, dtype=torch.int32).reshape(1024, -1),
            "b": torch.ones(3, 5)}
    path = str(tmp_path / "m.safetensors")
    tensorferry.torch.save_file(want, path)
    data = bytearray(open(path, "rb").read())
    b = stores.seaweed.BUCKET
    stores.seaweed.upload(b, f"{PREFIX}/landing-{part_size}/good.safetensors", bytes(data))
    n = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8:8 + n])["a"]["data_offsets"][0]
    data[8 + n + begin + 9_000_000] ^= 0x20
    stores.seaweed.upload(b, f"{PREFIX}/landing-{part_size}/bad.safetensors", bytes(data))
    opts = stores.s3_options(object_part_size=part_size)
    good = stores.seaweed.url(f"{PREFIX}/landing-{part_size}/good.safetensors")
    with tensorferry.Loader(good, verify="on", storage_options=opts) as loader:
        got = loader.load()
        stats = loader.stats
    assert_same(dict(sorted(got.items())), want)
    assert stats.verified_tensors == 2 and stats.verified_bytes == 10 * 1024 * 1024 + 60
    bad = stores.seaweed.url(f"{PREFIX}/landing-{part_size}/bad.safetensors")
    with pytest.raises(tensorferry.SafetensorError) as e:
        with tensorferry.Loader(bad, verify="on", storage_options=opts) as loader:
            loader.load()
    assert e.value.code == "checksum_mismatch"
    assert 'tensor "a": checksum mismatch in chunk 2 of 3' in str(e.value)


# --- 2. prefix rules ------------------------------------------------------------------------------

def test_http_prefix_without_index_is_not_found_naming_the_url(stores):
    url, _ = stores.url("http", "ref")
    with pytest.raises(FileNotFoundError) as e:
        tensorferry.Loader(url)
    assert url in str(e.value) and "cannot be listed" in str(e.value)
    with pytest.raises(FileNotFoundError, match="cannot be listed"):
        load_all(url + "/")


def test_s3_prefix_with_nothing_under_it_is_not_found(stores):
    url, opts = stores.url("s3", "no-such-prefix")
    with pytest.raises(FileNotFoundError) as e:
        tensorferry.Loader(url, storage_options=opts)
    assert url in str(e.value)


def test_s3_listing_missing_a_shard_names_it(stores):
    """Without an index, a listing whose numbered shards lack one is refused (not loaded
    without that shard's tensors), naming the missing key."""
    assert len(stores.shards) >= 2 and "-of-" in stores.shards[0], stores.shards
    for shard in stores.shards[1:]:
        stores.seaweed.upload(stores.seaweed.BUCKET, f"{PREFIX}/tiny-partial/{shard}",
                              os.path.join(stores.tiny, shard))
    url, opts = stores.url("s3", "tiny-partial")
    with pytest.raises(tensorferry.SafetensorError) as e:
        tensorferry.Loader(url, storage_options=opts)
    assert e.value.code == "checkpoint_incomplete"
    assert url in str(e.value) and f'missing: "{stores.shards[0]}"' in str(e.value)


@pytest.mark.parametrize("store", ["s3", "http"])
def test_missing_shards_of_an_index_name_the_first_in_file_order(stores, store):
    """The files of an index are opened several at a time; the error is still the first missing
    file in order, named with the tensor the index maps to it."""
    assert len(stores.shards) >= 4, stores.shards
    present = [s for i, s in enumerate(stores.shards) if i not in (1, 3)]
    index = os.path.join(stores.tiny, "model.safetensors.index.json")
    for name in present + ["model.safetensors.index.json"]:
        src = os.path.join(stores.tiny, name)
        if store == "s3":
            stores.seaweed.upload(stores.seaweed.BUCKET, f"{PREFIX}/tiny-gaps/{name}", src)
        else:
            stores.nginx.put(f"{PREFIX}/tiny-gaps/{name}", open(src, "rb").read())
    url, opts = stores.url(store, "tiny-gaps/model.safetensors.index.json")
    with pytest.raises(tensorferry.SafetensorError) as e:
        tensorferry.Loader(url, storage_options=opts)
    weight_map = json.load(open(index))["weight_map"]
    first = sorted(t for t, f in weight_map.items() if f == stores.shards[1])
    assert e.value.code == "index_missing_file", str(e.value)
    assert f'file "{stores.shards[1]}" (of tensor "' in str(e.value)
    assert any(f'(of tensor "{t}")' in str(e.value) for t in first), str(e.value)


@pytest.mark.parametrize("store", ["s3", "http"])
@pytest.mark.parametrize("target", ["../other/x.safetensors", "/abs.safetensors",
                                    "sub/../../x.safetensors"])
def test_index_may_not_leave_its_prefix(stores, store, target):
    index = json.dumps({"metadata": {}, "weight_map": {"w": target}}).encode()
    tag = "".join(c if c.isalnum() else "_" for c in target)
    rel = f"escape-{tag}/model.safetensors.index.json"
    if store == "s3":
        stores.seaweed.upload(stores.seaweed.BUCKET, f"{PREFIX}/{rel}", index)
    else:
        stores.nginx.put(f"{PREFIX}/{rel}", index)
    url, opts = stores.url(store, rel)
    for path in (url, url.rsplit("/", 1)[0]):
        with pytest.raises(SafetensorError) as e:
            tensorferry.Loader(path, storage_options=opts)
        assert e.value.code == "index_path_escape", str(e.value)
        assert target in str(e.value)


# --- 3. credentials and endpoints -----------------------------------------------------------------

def s3_error(stores, key, **opts):
    url = stores.seaweed.url(key) if "://" not in key else key
    with pytest.raises(OSError) as e:
        tensorferry.torch.load_file(url, storage_options=stores.s3_options(**opts))
    return url, e.value, str(e.value)


def test_wrong_secret_is_signature_does_not_match(stores):
    keys = (stores.seaweed.ADMIN_KEY[0], "not-the-secret")
    url, err, msg = s3_error(stores, f"{PREFIX}/ref/{REF_FILES[0]}", keys=keys)
    assert "403" in msg and "SignatureDoesNotMatch" in msg, msg
    assert url in msg and stores.seaweed.BUCKET in msg, msg
    assert stores.seaweed.endpoint in msg, msg  # where the endpoint came from, too
    assert "not-the-secret" not in msg  # never the secret itself


def test_unknown_access_key_is_invalid_access_key_id(stores):
    _, _, msg = s3_error(stores, f"{PREFIX}/ref/{REF_FILES[0]}", keys=("nobody", "whatever-secret"))
    assert "403" in msg and "InvalidAccessKeyId" in msg, msg


def test_identity_without_rights_is_access_denied(stores):
    url, _, msg = s3_error(stores, f"{PREFIX}/ref/{REF_FILES[0]}", keys=stores.seaweed.OTHER_KEY)
    assert "403" in msg and "AccessDenied" in msg and url in msg, msg


def test_missing_key_and_bucket_are_not_found(stores):
    url, err, msg = s3_error(stores, f"{PREFIX}/ref/missing.safetensors")
    assert isinstance(err, FileNotFoundError) and "NoSuchKey" in msg and url in msg, msg
    url, err, msg = s3_error(stores, "s3://no-such-bucket-tf/x.safetensors")
    assert isinstance(err, FileNotFoundError) and "NoSuchBucket" in msg and url in msg, msg


def test_profile_with_credentials_and_config_files(stores, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    key, secret = stores.seaweed.ADMIN_KEY
    (home / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n"
        f"[tf]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    (home / ".aws" / "config").write_text(
        f"[profile tf]\nregion = {stores.seaweed.REGION}\n"
        f"endpoint_url = {stores.seaweed.endpoint}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(home), AWS_PROFILE="tf", AWS_EC2_METADATA_DISABLED="true")
    url, _, local = stores.tiny_form("s3", "prefix")
    r = subprocess.run([CLI, "load", url, "--json"], capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["checksum"] == cli_checksum(local)["checksum"]
    # The default profile's keys are wrong: the error names the profile it used.
    env["AWS_PROFILE"] = "default"
    r = subprocess.run([CLI, "load", url, "--json", "--s3-endpoint", stores.seaweed.endpoint],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    error = json.loads(r.stdout)["error"]["message"]  # --json: the error document
    assert "InvalidAccessKeyId" in error and "default" in error, error
    # In Python, the profile chosen by storage_options (s3_profile) over AWS_PROFILE.
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE")
    monkeypatch.delenv("AWS_CONFIG_FILE")
    monkeypatch.setenv("AWS_PROFILE", "default")
    assert_same(load_all(url, storage_options={"s3_profile": "tf"}), load_all(local))


def test_anonymous_read_of_the_public_bucket(stores, monkeypatch):
    seaweed = stores.seaweed
    url = seaweed.url(f"{PREFIX}/tiny", bucket=seaweed.PUBLIC_BUCKET)
    want = load_all(stores.tiny)
    opts = {"s3_endpoint": seaweed.endpoint, "s3_anonymous": 1}
    assert_same(load_all(url, storage_options=opts), want)
    # The private bucket refuses anonymous reads.
    with pytest.raises(OSError, match="AccessDenied") as e:
        load_all(seaweed.url(f"{PREFIX}/tiny"), storage_options=opts)
    assert "anonymous" in str(e.value)
    assert isinstance(e.value, PermissionError) and e.value.code == "access_denied", e.value
    # The same through the environment (AWS_NO_SIGN_REQUEST), keys present but not used.
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
    monkeypatch.setenv("AWS_NO_SIGN_REQUEST", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "whatever-secret")
    assert_same(load_all(url), want)
    env = {"AWS_ENDPOINT_URL": seaweed.endpoint, "AWS_NO_SIGN_REQUEST": "true"}
    assert cli_checksum(url, env=env)["checksum"] == cli_checksum(stores.tiny)["checksum"]


def test_environment_credentials_and_endpoint(stores, monkeypatch):
    for name, value in stores.seaweed.env().items():
        monkeypatch.setenv(name, value)
    url, _, local = stores.tiny_form("s3", "index")
    assert_same(load_all(url), load_all(local))


def test_storage_options_override_the_environment(stores, monkeypatch):
    from objstore_servers import free_port
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "whatever-secret")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    url, opts, local = stores.tiny_form("s3", "prefix")
    want = load_all(local)
    assert_same(load_all(url, storage_options=opts), want)
    with safe_open(os.path.join(local, stores.shards[0]), "pt") as a, \
            safe_open(f"{url}/{stores.shards[0]}", "pt", storage_options=opts) as b:
        assert b.keys() == a.keys()
    # Without them, the environment's endpoint is used (and named in the error).
    with pytest.raises(OSError) as e:
        load_all(url, storage_options={"object_timeout_ms": 1000, "object_retries": 0})
    assert os.environ["AWS_ENDPOINT_URL"] in str(e.value) and "AWS_ENDPOINT_URL" in str(e.value)


def test_unknown_storage_option_is_invalid_argument(stores):
    url, opts = stores.url("s3", f"ref/{REF_FILES[0]}")
    with pytest.raises(InvalidArgumentError, match="s3_secret"):
        tensorferry.torch.load_file(url, storage_options={"s3_secret": "x"})
    with pytest.raises(InvalidArgumentError, match="endpoint"):
        tensorferry.torch.load_file(url, storage_options={"endpoint": "x"})
    with pytest.raises(InvalidArgumentError, match="object_concurrency = 257 is out of range"):
        safe_open(url, "pt", storage_options={"object_concurrency": 257})
    with pytest.raises(InvalidArgumentError, match="object_part_size = 100 must be at least 4096"):
        safe_open(url, "pt", storage_options={"object_part_size": 100})


# --- edges ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("store", ["s3", "http"])
def test_header_longer_than_the_first_get(stores, store):
    """object_header_bytes smaller than a header: the rest of it comes by ranged GETs."""
    for rel, local in ((f"ref/{REF_FILES[0]}", os.path.join(REF_DIR, REF_FILES[0])),
                       ("tiny", stores.tiny)):
        url, opts = stores.url(store, rel)
        opts = dict(opts, object_header_bytes=16)
        assert_same(load_all(url, storage_options=opts), load_all(local))


def test_trailing_slash_prefix_and_endpoint(stores):
    url, opts = stores.url("s3", "tiny/")
    opts["s3_endpoint"] += "/"
    assert_same(load_all(url, storage_options=opts), load_all(stores.tiny))
    url, _ = stores.url("http", "tiny/")
    assert_same(load_all(url), load_all(stores.tiny))


@pytest.mark.parametrize("store", ["s3", "http"])
def test_empty_and_short_objects_are_format_errors(stores, store):
    for name, data in (("zero", b""), ("short", b"\x10\x00\x00")):
        rel = f"short/{name}.safetensors"
        if store == "s3":
            stores.seaweed.upload(stores.seaweed.BUCKET, f"{PREFIX}/{rel}", data)
        else:
            stores.nginx.put(f"{PREFIX}/{rel}", data)
        url, opts = stores.url(store, rel)
        with pytest.raises(SafetensorError) as e:
            load_all(url, storage_options=opts)
        assert url in str(e.value), str(e.value)


def test_cli_error_names_the_s3_code(stores):
    url = stores.seaweed.url(f"{PREFIX}/ref/missing.safetensors")
    r = cli("load", url, "--json", env=stores.seaweed.env())
    assert r.returncode == 1
    assert "NoSuchKey" in r.stdout + r.stderr and url in r.stdout + r.stderr


def test_https_verifies_the_certificate(stores, tmp_path):
    front = TlsFront(stores.nginx.port, str(tmp_path))
    try:
        url = front.url(f"{PREFIX}/tiny/model.safetensors.index.json")
        want = load_all(stores.tiny)
        start = time.monotonic()
        with pytest.raises(OSError) as e:  # self-signed: refused by the system's CAs
            load_all(url)
        assert url.rsplit("/", 1)[0] in str(e.value) and "certificate" in str(e.value).lower()
        assert "attempts" not in str(e.value)  # not retried: it would fail the same way
        assert time.monotonic() - start < 10  # failed at once, not after retries and backoff
        assert_same(load_all(url, storage_options={"object_ca_bundle": front.cert}), want)
        assert_same(load_all(url, storage_options={"object_verify_tls": False}), want)
    finally:
        front.close()



def _coop_rank(rank, world, url, opts, local, init, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        pg = dist.new_group(list(range(world)))
        with tensorferry.Loader(local, tp_rank=rank, tp_size=world) as ref:
            want = ref.load()  # this rank's slices, read from disk independently
        with tensorferry.Loader(url, tp_rank=rank, tp_size=world, process_group=pg,
                                storage_options=opts) as loader:
            got = loader.load()
            coop = loader.cooperative_stats
            stats = loader.stats
        assert list(got) == list(want)
        for name, w in want.items():
            assert got[name].dtype == w.dtype and tuple(got[name].shape) == tuple(w.shape), name
            assert raw_bytes(got[name]) == raw_bytes(w), name
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"bytes_read": coop["bytes_read"], "remote_bytes": stats.remote_bytes,
                       "bytes_sent": coop["bytes_sent"],
                       "bytes_received": coop["bytes_received"]}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_cooperative_ranks_split_the_objects_and_exchange(stores, tmp_path, world):
    """Cooperative tensor parallelism from S3 over torch.distributed (gloo): each rank's slices
    equal a local sliced load, and the ranks together transfer every tensor byte once."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import torch.multiprocessing as mp
    url, opts = stores.url("s3", "tiny")
    out = str(tmp_path / "stats")
    mp.spawn(_coop_rank, args=(world, url, opts, stores.tiny, f"file://{tmp_path}/init", out),
             nprocs=world, join=True)
    stats = []
    for r in range(world):
        with open(f"{out}.{r}") as f:
            stats.append(json.load(f))
    with tensorferry.Loader(stores.tiny) as full:
        total = sum(t.numel() * t.element_size() for t in full.load().values())
    assert sum(s["bytes_read"] for s in stats) == total, stats
    # What a rank read is what it received from the object store, plus the index probe and the
    # speculative header GETs of the files it opened.
    for s in stats:
        assert s["remote_bytes"] >= s["bytes_read"], s
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)


def doctor(url, env):
    r = cli("doctor", "--quick", "--json", url, env=env)
    assert r.returncode == 0, r.stdout + r.stderr  # the report is the result
    return json.loads(r.stdout)["object_store"], r.stdout


def test_doctor_says_where_each_setting_came_from_and_asks_once(stores, tmp_path):
    s = stores.seaweed
    env = dict(s.env())
    rel = f"{PREFIX}/tiny/{stores.shards[0]}"
    report, _ = doctor(s.url(rel), env)
    assert report["settings"]["ok"] and report["store"] == "s3", report
    assert (report["endpoint"], report["endpoint_from"]) == (s.endpoint, "AWS_ENDPOINT_URL")
    assert (report["region"], report["region_from"]) == (s.REGION, "AWS_REGION")
    assert report["addressing"] == "path-style"
    assert report["credentials_from"] == "environment (AWS_ACCESS_KEY_ID)"
    assert report["credentials"] == "" and report["credentials_status"]["ok"]  # given, not fetched
    assert report["request_url"] == f"{s.endpoint}/{s.BUCKET}/{rel}"
    size = os.path.getsize(os.path.join(stores.tiny, stores.shards[0]))
    assert report["probe_status"]["ok"] and report["probe"].startswith(f"object of {size} bytes")
    # A prefix, with or without '/': its index first, as a load asks, then its listing.
    for prefix in (f"{PREFIX}/tiny-noindex/", f"{PREFIX}/tiny-noindex"):
        report, _ = doctor(s.url(prefix), env)
        index = s.url(f"{PREFIX}/tiny-noindex/model.safetensors.index.json")
        assert report["probe"] == (f"no {index}; {len(stores.shards)} *.safetensors objects "
                                   "directly under the prefix (ListObjectsV2)"), report
        assert report["request_url"] == (f"{s.endpoint}/{s.BUCKET}/{PREFIX}/tiny-noindex/"
                                         f"model.safetensors.index.json then "
                                         f"{s.endpoint}/{s.BUCKET}"), report
    # What a load would say: the missing key, the wrong secret (never shown).
    report, _ = doctor(s.url(f"{PREFIX}/tiny/missing.safetensors"), env)
    assert report["probe_status"]["category"] == "not_found", report
    assert "NoSuchKey" in report["probe_status"]["message"]
    env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret-at-all"
    report, text = doctor(s.url(rel), env)
    assert "SignatureDoesNotMatch" in report["probe_status"]["message"], report
    assert "not-the-secret-at-all" not in text
    # A setting that does not resolve: the settings' error, nothing asked.
    env = dict(s.env(), AWS_ENDPOINT_URL="ftp://example.com")
    report, _ = doctor(s.url(rel), env)
    assert not report["settings"]["ok"] and "AWS_ENDPOINT_URL" in report["settings"]["message"]
    assert report["probe"] == "" and report["request_url"] == ""


def test_doctor_asks_for_a_prefix_what_a_load_asks(stores, tmp_path):
    """Found by a review: doctor GET the prefix itself (an HTTP server's directory page was
    reported as an object); it asks what a load asks: the index, then (HTTP) model.safetensors."""
    s = stores.seaweed
    # An S3 prefix holding an index, without its trailing '/': the index, found.
    report, _ = doctor(s.url(f"{PREFIX}/tiny"), dict(s.env()))
    assert report["probe_status"]["ok"], report
    assert report["request_url"] == (f"{s.endpoint}/{s.BUCKET}/{PREFIX}/tiny/"
                                     "model.safetensors.index.json"), report
    assert report["probe"].startswith("object of "), report
    # nginx: a prefix holding an index, and one holding only model.safetensors.
    index = os.path.join(stores.tiny, "model.safetensors.index.json")
    for prefix in (f"{PREFIX}/tiny/", f"{PREFIX}/tiny"):
        report, _ = doctor(stores.nginx.url(prefix), {})
        assert report["probe_status"]["ok"], report
        assert report["request_url"] == stores.nginx.url(f"{PREFIX}/tiny/{os.path.basename(index)}")
        assert report["probe"].startswith(f"object of {os.path.getsize(index)} bytes"), report
    single = os.path.join(REF_DIR, REF_FILES[0])
    with open(single, "rb") as f:
        stores.nginx.put(f"{PREFIX}/single/model.safetensors", f.read())
    report, _ = doctor(stores.nginx.url(f"{PREFIX}/single/"), {})
    missing = stores.nginx.url(f"{PREFIX}/single/model.safetensors.index.json")
    assert report["probe_status"]["ok"], report
    assert report["request_url"] == (f"{missing} then "
                                     f"{stores.nginx.url(f'{PREFIX}/single/model.safetensors')}")
    assert report["probe"].startswith(f"no {missing}; object of {os.path.getsize(single)} bytes")
    # Neither: the load's error, naming both.
    report, _ = doctor(stores.nginx.url(f"{PREFIX}/nothing-here/"), {})
    assert report["probe_status"]["category"] == "not_found", report
    assert "neither model.safetensors.index.json nor model.safetensors" in (
        report["probe_status"]["message"])


def test_doctor_on_a_plain_http_server_prefix_is_not_its_directory_page(tmp_path):
    """The reviewer's case: python's http.server (which answers a folder with an HTML listing)
    serving model/model.safetensors; doctor on http://.../model/ probes the file, as a load."""
    import functools
    import http.server
    import threading
    os.makedirs(tmp_path / "model")
    single = os.path.join(REF_DIR, REF_FILES[0])
    shutil.copyfile(single, tmp_path / "model" / "model.safetensors")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            base = f"http://127.0.0.1:{server.server_address[1]}/model/"
            report, _ = doctor(base, {"TENSORFERRY_OBJECT_RETRIES": "0"})
        finally:
            server.shutdown()
            thread.join()
    assert report["request_url"] == (f"{base}model.safetensors.index.json then "
                                     f"{base}model.safetensors"), report
    # What answered is the file (whole: smaller than the first GET), not the folder's HTML page.
    assert report["probe_status"]["ok"], report
    assert report["probe"].startswith(
        f"no {base}model.safetensors.index.json; object of {os.path.getsize(single)} bytes")


def test_doctor_shows_a_bucket_key_with_a_question_mark_whole(stores):
    """Found by a review: s3://bucket/a?b was shown as s3://bucket/a (a query is stripped only for
    http(s)); the key asked for is the whole key, percent-encoded."""
    s = stores.seaweed
    key = f"{PREFIX}/q/a?b.safetensors"
    single = os.path.join(REF_DIR, REF_FILES[0])
    s.upload(s.BUCKET, key, single)
    report, _ = doctor(s.url(key), dict(s.env()))
    assert report["url"] == s.url(key), report
    assert report["request_url"] == f"{s.endpoint}/{s.BUCKET}/{PREFIX}/q/a%3Fb.safetensors"
    assert report["probe_status"]["ok"], report
    assert report["probe"].startswith(f"object of {os.path.getsize(single)} bytes"), report


def test_doctor_never_shows_a_password_or_a_signed_query():
    """Found by a review: the password was printed twice, and the refusal's reason was lost."""
    r = cli("doctor", "--quick", "https://user:hunter2@example.invalid/x.safetensors")
    assert r.returncode == 0, r.stderr
    assert "hunter2" not in r.stdout + r.stderr
    assert "credentials (user@host) are not allowed" in r.stdout
    report, text = doctor("https://example.invalid/x.safetensors?X-Amz-Signature=s3cr3t", {})
    assert "s3cr3t" not in text
    assert report["url"] == "https://example.invalid/x.safetensors?***"
    assert "a '?query' is not allowed" in report["settings"]["message"], report
    report, _ = doctor("hf://org/model", {})
    assert "doctor does not probe hub paths" in report["settings"]["message"], report


def test_describe_object_store_from_python(stores):
    s = stores.seaweed
    rel = f"{PREFIX}/tiny/{stores.shards[0]}"
    report = tensorferry.describe_object_store(s.url(rel), stores.s3_options())
    assert report["settings"]["ok"] and report["probe_status"]["ok"], report
    assert report["credentials_from"] == "options" and report["endpoint_from"] == "options"
    assert report["probe"].startswith("object of "), report
    report = tensorferry.describe_object_store(
        s.url(rel), stores.s3_options(keys=(s.ADMIN_KEY[0], "not-the-secret-at-all")))
    assert not report["probe_status"]["ok"]
    assert "SignatureDoesNotMatch" in report["probe_status"]["message"]
    assert "not-the-secret-at-all" not in repr(report)
    report = tensorferry.describe_object_store("/not/a/url", {})
    assert not report["settings"]["ok"] and report["settings"]["category"] == "invalid_argument"

"""The local disk cache of object-store checkpoints (object_cache_dir, docs/object_storage.md
"Local cache") against the real servers of test_object_store.py (SeaweedFS for s3://, nginx for
http://) and the fault proxy: a file is downloaded once per version, later loads (and other
processes on the host) read the copy, a failed download leaves nothing behind, a cache that cannot
be used never fails a load, and every load is byte-exact."""
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import CLI
from fault_proxy import Rule
from test_object_store import PREFIX, assert_same, load_all
# The fixtures of test_object_store.py: no ambient AWS settings, and its uploaded checkpoints.
from test_object_store import _no_ambient_aws, stores  # noqa: F401

import tensorferry
import tensorferry.torch
from tensorferry import safe_open

# The tiny preset's shards are ~64 KB: a first GET of 4 KiB leaves them most of their bytes to
# fetch, so they are cached (an object the open's GET holds whole is not).
SMALL_OPEN = {"object_header_bytes": 4096, "object_timeout_ms": 3000}


def tiny(stores, store, cache_dir, **more):
    """(URL, storage_options) of the tiny sharded checkpoint (by prefix) with `cache_dir`."""
    url, opts = stores.url(store, "tiny")
    opts = dict(opts, **SMALL_OPEN, object_cache_dir=str(cache_dir), **more)
    return url, opts


def blobs(cache_dir):
    # Copies finish after their loader closes (in the background): wait for them first.
    tensorferry.wait_for_caches()
    d = os.path.join(cache_dir, "blobs")
    if not os.path.isdir(d):
        return []
    return sorted(f for f in os.listdir(d) if not f.endswith(".json"))


def shard_bytes(stores):
    return {open(os.path.join(stores.tiny, s), "rb").read() for s in stores.shards}


def load_with_stats(url, **kw):
    with tensorferry.Loader(url, **kw) as loader:
        return loader.load(), loader.stats


@pytest.mark.parametrize("store", ["s3", "http"])
def test_second_load_reads_the_cache_not_the_store(stores, store, tmp_path):
    cache = tmp_path / "cache"
    url, opts = tiny(stores, store, cache)
    want = load_all(stores.tiny)
    got, first = load_with_stats(url, storage_options=opts)
    assert_same(got, want)
    sizes = sum(os.path.getsize(os.path.join(stores.tiny, s)) for s in stores.shards)
    assert (first.cache_fills, first.cache_hits) == (len(stores.shards), 0)
    assert first.cache_fill_bytes == sizes
    # Each entry is the object's bytes, exactly, and says what it is.
    entries = blobs(cache)
    assert len(entries) == len(stores.shards)
    assert {open(cache / "blobs" / e, "rb").read() for e in entries} == shard_bytes(stores)
    for e in entries:
        meta = json.loads((cache / "blobs" / f"{e}.json").read_text())
        assert meta["url"].startswith(url) and meta["etag"] and meta["size"] > 4096
    assert os.listdir(cache / "tmp") == []

    got, second = load_with_stats(url, storage_options=opts)
    assert_same(got, want)
    assert (second.cache_fills, second.cache_hits) == (0, len(stores.shards))
    # The load's reads were all local: no request, no byte from the store.
    assert second.remote_requests == 0 and second.remote_bytes == 0
    assert f"object cache {cache}: {len(stores.shards)} files read from it" in second.engine_reason


def test_new_version_of_an_object_is_downloaded_again(stores, tmp_path):
    a, b = (os.path.join(stores.tiny, s) for s in stores.shards[:2])
    key = f"{PREFIX}/cache-version/model.safetensors"
    bucket = stores.seaweed.BUCKET
    url = stores.seaweed.url(key)
    opts = stores.s3_options(**SMALL_OPEN, object_cache_dir=str(tmp_path / "c"))
    stores.seaweed.upload(bucket, key, a)
    got, stats = load_with_stats(url, storage_options=opts)
    assert_same(got, load_all(a))
    assert stats.cache_fills == 1
    stores.seaweed.overwrite(bucket, key, b)  # same key, new content: a new ETag
    got, stats = load_with_stats(url, storage_options=opts)
    assert_same(got, load_all(b))
    assert (stats.cache_fills, stats.cache_hits) == (1, 0)
    assert len(blobs(tmp_path / "c")) == 2  # the old version stays until evicted


def test_objects_the_open_holds_whole_are_not_cached(stores, tmp_path):
    # Default first GET (256 KiB): every ~64 KB shard arrives whole with the open.
    url, opts = stores.url("s3", "tiny")
    got, stats = load_with_stats(url, storage_options=dict(opts, object_cache_dir=str(tmp_path)))
    assert_same(got, load_all(stores.tiny))
    assert (stats.cache_fills, stats.cache_hits) == (0, 0)
    assert blobs(tmp_path) == []


def test_safe_open_reads_through_the_cache(stores, tmp_path):
    shard = stores.shards[0]
    url, opts = stores.url("s3", f"tiny/{shard}")
    opts = dict(opts, **SMALL_OPEN, object_cache_dir=str(tmp_path))
    want = tensorferry.torch.load_file(os.path.join(stores.tiny, shard))
    for _ in range(2):
        with safe_open(url, framework="pt", storage_options=opts) as f:
            assert_same({k: f.get_tensor(k) for k in f.keys()}, want)
    assert len(blobs(tmp_path)) == 1


def test_environment_variable_sets_the_cache_for_python(stores, tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORFERRY_OBJECT_CACHE_DIR", str(tmp_path))
    url, opts = stores.url("s3", "tiny")
    got, stats = load_with_stats(url, storage_options=dict(opts, **SMALL_OPEN))
    assert_same(got, load_all(stores.tiny))
    assert stats.cache_fills == len(stores.shards)
    assert len(blobs(tmp_path)) == len(stores.shards)


def test_drop_cache_drops_the_copies_pages(stores, tmp_path):
    # drop_cache on an object-store checkpoint: the bytes that stay in the page cache are those of
    # the local copies; the first load (downloads) and a later one (hits) both leave them out.
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from _pagecache import cached_fraction
    want = load_all(stores.tiny)
    kept, dropped = tmp_path / "kept", tmp_path / "dropped"
    for cache, drop in ((kept, False), (dropped, True)):
        url, opts = tiny(stores, "s3", cache)
        for _ in range(2):  # downloads, then hits
            got, stats = load_with_stats(url, storage_options=opts, drop_cache=drop)
            assert_same(got, want)
            paths = [str(cache / "blobs" / e) for e in blobs(cache)]
            assert len(paths) == len(stores.shards)
            if drop:
                assert cached_fraction(paths) < 0.1
            else:
                assert cached_fraction(paths) > 0.9
        assert stats.cache_hits == len(stores.shards)


def cli_load(url, *args, env=None, check=True):
    full = dict(os.environ)
    full.update(env or {})
    r = subprocess.run([CLI, "load", url, *args], capture_output=True, text=True, timeout=120,
                       env=full)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def test_cli_reports_fills_then_hits(stores, tmp_path):
    env = stores.seaweed.env()
    env["TENSORFERRY_OBJECT_HEADER_BYTES"] = "4096"
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    want = json.loads(cli_load(stores.tiny, "--json").stdout)["checksum"]
    n = len(stores.shards)
    first = json.loads(cli_load(url, "--json", "--object-cache-dir", str(tmp_path),
                                env=env).stdout)
    assert first["checksum"] == want
    assert (first["cache_fills"], first["cache_hits"]) == (n, 0)
    # The variable sets it too; the text report says where the files came from.
    env["TENSORFERRY_OBJECT_CACHE_DIR"] = str(tmp_path)
    text = cli_load(url, env=env).stdout
    assert f"; cache: {n} files read from it, 0 files (0 B) downloaded into it" in text, text
    second = json.loads(cli_load(url, "--json", env=env).stdout)
    assert second["checksum"] == want
    assert (second["cache_fills"], second["cache_hits"], second["remote_bytes"]) == (0, n, 0)


def test_ranks_in_separate_processes_share_one_download(stores, tmp_path):
    """Two tensor-parallel ranks started together with one cache directory: each object is
    downloaded by one of them; both loads match their local counterparts."""
    env = stores.seaweed.env()
    env["TENSORFERRY_OBJECT_HEADER_BYTES"] = "4096"
    env["TENSORFERRY_OBJECT_CACHE_DIR"] = str(tmp_path)
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    full = dict(os.environ, **env)
    procs = [subprocess.Popen([CLI, "load", url, "--json", "--tp-rank", str(r), "--tp-size", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    got = [json.loads(out) for out, _ in outs]
    for rank in range(2):
        want = json.loads(cli_load(stores.tiny, "--json", "--tp-rank", str(rank), "--tp-size",
                                   "2").stdout)["checksum"]
        assert got[rank]["checksum"] == want
    n = len(stores.shards)
    assert got[0]["cache_fills"] + got[1]["cache_fills"] == n
    assert got[0]["cache_hits"] + got[1]["cache_hits"] == n
    assert len(blobs(tmp_path)) == n


def test_bounded_cache_evicts_and_still_loads_byte_exact(stores, tmp_path):
    sizes = sorted(os.path.getsize(os.path.join(stores.tiny, s)) for s in stores.shards)
    room = sizes[-1] + sizes[-2]  # any two shards fit, never three
    url, opts = tiny(stores, "s3", tmp_path, object_cache_max=str(room))
    got, stats = load_with_stats(url, storage_options=opts)
    # The files' downloads run beside each other: one that does not fit beside those in progress
    # reads the store (and says so); one that starts after others ended evicts.
    assert_same(got, load_all(stores.tiny))
    refused = re.search(r"(\d+) files? read from the store because .*do not fit object_cache_max",
                        stats.engine_reason)
    assert stats.cache_fills >= 1
    assert stats.cache_fills + (int(refused.group(1)) if refused else 0) == len(stores.shards), \
        stats.engine_reason
    kept = blobs(tmp_path)
    assert 1 <= len(kept) <= 2
    assert sum(os.path.getsize(tmp_path / "blobs" / b) for b in kept) <= room
    # Later loads make room by evicting the least recently used entries (unlinked entries this
    # checkpoint holds open are still read), and stay byte-exact.
    for _ in range(2):
        got, stats = load_with_stats(url, storage_options=opts)
        assert_same(got, load_all(stores.tiny))
        kept = blobs(tmp_path)
        assert sum(os.path.getsize(tmp_path / "blobs" / b) for b in kept) <= room


def test_unusable_cache_reads_the_store_and_says_why(stores, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    url, opts = tiny(stores, "s3", not_a_dir)
    got, stats = load_with_stats(url, storage_options=opts)
    assert_same(got, load_all(stores.tiny))
    assert (stats.cache_fills, stats.cache_hits) == (0, 0)
    assert stats.remote_bytes > 0
    assert f"{len(stores.shards)} files read from the store because object cache {not_a_dir}: " \
           f"cannot create {not_a_dir}/blobs" in stats.engine_reason, stats.engine_reason
    # The same as fields: how many, and the latest reason.
    assert stats.cache_errors == len(stores.shards), stats
    assert stats.cache_error.startswith(f"object cache {not_a_dir}: cannot create "
                                        f"{not_a_dir}/blobs"), stats.cache_error


def test_cli_line_says_which_files_the_cache_failed(stores, tmp_path):
    # Not only --json's engine_reason: the text report counts them and says why.
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    env = stores.seaweed.env()
    env["TENSORFERRY_OBJECT_HEADER_BYTES"] = "4096"  # (files the open holds whole are not cached)
    r = cli_load(url, "--object-cache-dir", str(not_a_dir), env=env)
    n = len(stores.shards)
    assert (f"; cache: 0 files read from it, 0 files (0 B) downloaded into it, {n} files not "
            f"cached (read from the store): object cache {not_a_dir}: cannot create "
            f"{not_a_dir}/blobs") in r.stdout, r.stdout


def test_download_through_resets_is_byte_exact(stores, s3_proxy, tmp_path):
    opts = stores.s3_options(endpoint=s3_proxy.url, **SMALL_OPEN, object_part_size=16 << 10,
                             object_cache_dir=str(tmp_path))
    s3_proxy.set_rules([Rule("reset_mid_body", probability=0.3, seed=7, only_ranged=True,
                             match=lambda r: not r.headers.get("range", "").startswith("bytes=0-"))])
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    got, stats = load_with_stats(url, storage_options=opts)
    assert_same(got, load_all(stores.tiny))
    assert s3_proxy.stats()["faults"]["reset_mid_body"] > 0
    assert stats.cache_fills == len(stores.shards)
    assert {open(tmp_path / "blobs" / b, "rb").read() for b in blobs(tmp_path)} == \
        shard_bytes(stores)


def two_layers(stores, tmp_path, folder):
    """(name a, name b, {name: tensor}, local path, s3:// URL) of a file of two layers (4 and 8
    MiB, one dtype: in the file in name order) uploaded under PREFIX/folder."""
    import torch
    a, b = "model.layers.0.w", "model.layers.1.w"
    big = {a: torch.arange(1 << 20, dtype=torch.int32),
           b: torch.arange(2 << 20, dtype=torch.int32) * 3}
    local = tmp_path / "two.safetensors"
    tensorferry.torch.save_file(big, str(local))
    key = f"{PREFIX}/{folder}/two.safetensors"
    stores.seaweed.upload(stores.seaweed.BUCKET, key, str(local))
    return a, b, big, local, stores.seaweed.url(key)


def test_closing_does_not_wait_for_the_copy_and_the_exit_does(stores, s3_proxy, tmp_path):
    """A file read in part (the first layer of two) leaves the rest of its copy to the cache's
    filler, which the proxy stalls (its first range, the object's top, waits out a timeout and
    is fetched again): closing the file returns without waiting for the copy, and
    wait_for_caches() returns when it is whole; the CLI's load (--layers 0) exits only once its
    copy is whole."""
    import time

    import torch
    a, b, big, local, url = two_layers(stores, tmp_path, "cache-background")
    size = os.path.getsize(local)

    def the_top(request):
        return request.headers.get("range", "").endswith(f"-{size - 1}")

    for form in ("python", "cli"):
        cache = tmp_path / form
        s3_proxy.reset_stats()
        s3_proxy.set_rules([Rule("stall", every=1, times=1, stall_s=10, after_bytes=0,
                                 match=the_top)])
        if form == "python":
            opts = stores.s3_options(endpoint=s3_proxy.url, **SMALL_OPEN, object_part_size=1 << 20,
                                     object_cache_dir=str(cache))
            with safe_open(url, framework="pt", storage_options=opts) as f:
                assert torch.equal(f.get_tensor(a), big[a])
            # The filler's turn comes when the file is closed; its first range is stalled:
            # nothing is in the cache yet.
            deadline = time.monotonic() + 10
            while s3_proxy.stats()["faults"]["stall"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert s3_proxy.stats()["faults"]["stall"] == 1
            assert not os.listdir(cache / "blobs")
            tensorferry.wait_for_caches()
        else:
            env = stores.seaweed.env(endpoint=s3_proxy.url)
            env["TENSORFERRY_OBJECT_HEADER_BYTES"] = "4096"
            env["TENSORFERRY_OBJECT_TIMEOUT_MS"] = "3000"
            env["TENSORFERRY_OBJECT_PART_SIZE"] = "1M"
            cli_load(url, "--layers", "0", "--object-cache-dir", str(cache), env=env)
            assert s3_proxy.stats()["faults"]["stall"] == 1
        (entry,) = [e for e in os.listdir(cache / "blobs") if not e.endswith(".json")]
        assert (cache / "blobs" / entry).read_bytes() == local.read_bytes(), form
        assert os.listdir(cache / "tmp") == []


def test_ctrl_c_in_wait_for_caches_gives_the_copies_up(stores, s3_proxy, tmp_path):
    """Ctrl-C while wait_for_caches() waits for a copy (its filler stalled by the proxy) raises
    KeyboardInterrupt and gives the copy up: it is removed once its request in flight ends, and
    the next load of the file makes a whole copy (copies begun later are not given up)."""
    import signal
    import threading

    import torch
    a, b, big, local, url = two_layers(stores, tmp_path, "cache-abandon")
    size = os.path.getsize(local)
    cache = tmp_path / "cache"
    opts = stores.s3_options(endpoint=s3_proxy.url, **SMALL_OPEN, object_part_size=1 << 20,
                             object_cache_dir=str(cache))
    s3_proxy.set_rules([Rule("stall", every=1, times=1, stall_s=10, after_bytes=0,
                             match=lambda r: r.headers.get("range", "").endswith(f"-{size - 1}"))])
    with safe_open(url, framework="pt", storage_options=opts) as f:
        assert torch.equal(f.get_tensor(a), big[a])
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            tensorferry.wait_for_caches()
    finally:
        timer.cancel()
    # The stalled request's retry ends the given-up copy, reported as such.
    (failure,) = tensorferry.wait_for_caches()
    assert url in failure and "given up" in failure, failure
    assert blobs(cache) == [] and os.listdir(cache / "tmp") == []
    s3_proxy.set_rules([])
    got, stats = load_with_stats(url, storage_options=opts)
    assert torch.equal(got[b], big[b]) and stats.cache_fills == 1
    (entry,) = blobs(cache)
    assert (cache / "blobs" / entry).read_bytes() == local.read_bytes()


def test_ctrl_c_while_the_cli_finishes_its_copies_gives_them_up(stores, s3_proxy, tmp_path):
    """The CLI's load is done and its copy is being finished (the filler's first range stalled
    by the proxy for 30 s): Ctrl-C gives the copy up: the CLI says so, removes the copy in
    progress (its request in flight ends at the 3 s timeout) and dies of SIGINT, long before the
    stall ends."""
    import signal
    import time
    a, b, big, local, url = two_layers(stores, tmp_path, "cache-cli-abandon")
    size = os.path.getsize(local)
    cache = tmp_path / "cache"
    s3_proxy.reset_stats()
    s3_proxy.set_rules([Rule("stall", every=1, times=1, stall_s=30, after_bytes=0,
                             match=lambda r: r.headers.get("range", "").endswith(f"-{size - 1}"))])
    env = dict(os.environ, **stores.seaweed.env(endpoint=s3_proxy.url))
    env.update(TENSORFERRY_OBJECT_HEADER_BYTES="4096", TENSORFERRY_OBJECT_PART_SIZE="1M",
               TENSORFERRY_OBJECT_TIMEOUT_MS="3000")
    proc = subprocess.Popen([CLI, "load", url, "--layers", "0", "--object-cache-dir", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while s3_proxy.stats()["faults"]["stall"] == 0 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        assert s3_proxy.stats()["faults"]["stall"] == 1
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=25)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGINT, err
    assert took < 20, took
    assert "the copies into the cache were given up" in err, err
    assert out.startswith("loaded 1 tensor in 1 batch"), out  # the load itself had ended
    assert blobs(cache) == [] and os.listdir(cache / "tmp") == []


def test_a_copy_that_fails_after_the_load_is_reported(stores, s3_proxy, tmp_path):
    """The rest of a file read in part is copied after its loader closed; when the store fails
    that copy (every request for the object's top answered 500, past the retries), the load
    that read the first layer is unaffected, nothing is left in the cache, and the failure is
    reported: by wait_for_caches() (naming the cache, the URL and the status, once), by the
    CLI (a warning line; exit status 0), and at the interpreter's exit."""
    import torch
    a, b, big, local, url = two_layers(stores, tmp_path, "cache-failure")
    size = os.path.getsize(local)
    s3_proxy.set_rules([Rule("status_500", every=1, match=lambda r: r.headers.get(
        "range", "").endswith(f"-{size - 1}"))])
    for form in ("python", "cli", "exit"):
        cache = tmp_path / form
        if form == "python":
            opts = stores.s3_options(endpoint=s3_proxy.url, **SMALL_OPEN, object_retries=1,
                                     object_part_size=1 << 20, object_cache_dir=str(cache))
            with safe_open(url, framework="pt", storage_options=opts) as f:
                assert torch.equal(f.get_tensor(a), big[a])
            (failure,) = tensorferry.wait_for_caches()
            assert tensorferry.wait_for_caches() == []  # taken once
            text = failure
        else:
            env = stores.seaweed.env(endpoint=s3_proxy.url)
            env.update(TENSORFERRY_OBJECT_HEADER_BYTES="4096", TENSORFERRY_OBJECT_RETRIES="1",
                       TENSORFERRY_OBJECT_PART_SIZE="1M", TENSORFERRY_OBJECT_TIMEOUT_MS="3000")
            if form == "cli":
                r = cli_load(url, "--layers", "0", "--object-cache-dir", str(cache), env=env)
            else:
                code = ("import sys, tensorferry\n"
                        "with tensorferry.safe_open(sys.argv[1], 'pt', storage_options="
                        "{'object_cache_dir': sys.argv[2]}) as f:\n"
                        f"    f.get_tensor({a!r})\n")
                r = subprocess.run([sys.executable, "-c", code, url, str(cache)],
                                   capture_output=True, text=True, timeout=120,
                                   env=dict(os.environ, **env))
                assert r.returncode == 0, r.stderr
            (text,) = [line for line in r.stderr.splitlines() if "warning" in line]
            assert text.startswith("tensorferry: warning: "), r.stderr
            assert text.endswith("(the next load downloads it again)"), r.stderr
        assert f"object cache {cache}" in text and url in text and "500" in text, text
        assert blobs(cache) == [] and os.listdir(cache / "tmp") == [], form


def test_what_the_disk_cannot_take_is_fetched_again_unless_fetch_once(stores, s3_proxy, tmp_path):
    """With no memory for bytes on their way to the local disk (object_cache_write_behind 0: a
    disk that never keeps up), every byte a load fetches for the copies is fetched again after
    the load, and cache_refetch_bytes says how many; with object_cache_fetch_once the load writes
    them itself and each byte crosses the network once. Both leave byte-exact copies, and the
    store served exactly cache_refetch_bytes more in the first case."""
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    want = load_all(stores.tiny)
    sizes = [os.path.getsize(os.path.join(stores.tiny, s)) for s in stores.shards]
    served = {}
    for fetch_once in (False, True):
        cache = tmp_path / f"once-{fetch_once}"
        opts = stores.s3_options(endpoint=s3_proxy.url, **SMALL_OPEN, object_cache_dir=str(cache),
                                 object_cache_write_behind=0, object_cache_fetch_once=fetch_once)
        s3_proxy.reset_stats()
        got, stats = load_with_stats(url, storage_options=opts)
        assert_same(got, want)
        assert stats.cache_fills == len(stores.shards)
        # Every tensor is read: each shard's bytes past the open's first 4096.
        expected = 0 if fetch_once else sum(n - 4096 for n in sizes)
        assert stats.cache_refetch_bytes == expected, fetch_once
        assert ("fetched again after the load" in stats.engine_reason) == (not fetch_once)
        assert {open(cache / "blobs" / b, "rb").read() for b in blobs(cache)} == \
            shard_bytes(stores)
        assert os.listdir(cache / "tmp") == []
        served[fetch_once] = s3_proxy.stats()["body_bytes"]
    assert served[False] - served[True] == sum(n - 4096 for n in sizes)

    # The CLI: the setting as a flag and a variable; --json and the text report say it.
    env = stores.seaweed.env()
    env["TENSORFERRY_OBJECT_HEADER_BYTES"] = "4096"
    env["TENSORFERRY_OBJECT_CACHE_WRITE_BEHIND"] = "0"
    report = json.loads(cli_load(url, "--json", "--object-cache-dir", str(tmp_path / "cli"),
                                 env=env).stdout)
    assert report["cache_refetch_bytes"] == sum(n - 4096 for n in sizes)
    text = cli_load(url, "--object-cache-dir", str(tmp_path / "cli2"), env=env).stdout
    assert "to fetch again after the load: the local disk could not take them in time" in text
    report = json.loads(cli_load(url, "--json", "--object-cache-dir", str(tmp_path / "cli3"),
                                 "--object-cache-fetch-once", "1", env=env).stdout)
    assert (report["cache_fills"], report["cache_refetch_bytes"]) == (len(sizes), 0)


def test_failed_download_leaves_no_entry(stores, s3_proxy, tmp_path):
    opts = stores.s3_options(endpoint=s3_proxy.url, **SMALL_OPEN, object_retries=1,
                             object_cache_dir=str(tmp_path))
    s3_proxy.set_rules([Rule("status_503_slowdown", every=1, only_ranged=True,
                             match=lambda r: not r.headers.get("range", "").startswith("bytes=0-"))])
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    with pytest.raises(OSError, match="gave up after 2 attempts") as e:
        load_all(url, storage_options=opts)
    assert f"{PREFIX}/tiny/" in str(e.value) and "SlowDown" in str(e.value)
    assert blobs(tmp_path) == [] and os.listdir(tmp_path / "tmp") == []
    s3_proxy.set_rules([])
    got, stats = load_with_stats(url, storage_options=opts)
    assert_same(got, load_all(stores.tiny))
    assert stats.cache_fills == len(stores.shards)


def test_damaged_copy_is_caught_by_the_checksums_and_replaced(stores, tmp_path):
    url, opts = tiny(stores, "s3", tmp_path)
    load_all(url, storage_options=opts)
    # One byte of tensor data changed in every entry, outside tensorferry: same size, so the
    # cache serves it; the per-tensor checksums `tensorferry gen` embedded catch it.
    for b in blobs(tmp_path):
        path = tmp_path / "blobs" / b
        raw = bytearray(path.read_bytes())
        header = int.from_bytes(raw[:8], "little")
        raw[8 + header + 1] ^= 0xFF
        path.write_bytes(bytes(raw))
    # Each failed load names the damaged copy and removes it; the next downloads that file again.
    healed = set()
    for _ in range(len(stores.shards) + 1):
        try:
            got = load_all(url, storage_options=opts)
            break
        except tensorferry.SafetensorError as e:
            assert e.code == "checksum_mismatch"
            assert "checksum mismatch in chunk 0" in str(e)
            m = re.search(r"its copy in the object cache, (\S+), which is now removed: the next "
                          r"open downloads the file again", str(e))
            assert m, str(e)
            assert not os.path.exists(m.group(1))
            healed.add(m.group(1))
    else:
        pytest.fail("the damaged copies were never all replaced")
    assert_same(got, load_all(stores.tiny))
    assert 1 <= len(healed) <= len(stores.shards)
    assert {open(tmp_path / "blobs" / b, "rb").read() for b in blobs(tmp_path)} == \
        shard_bytes(stores)


def test_cache_command_lists_and_prunes(stores, tmp_path):
    url, opts = tiny(stores, "s3", tmp_path)
    load_all(url, storage_options=opts)
    tensorferry.wait_for_caches()  # the copies finish after the load
    n = len(stores.shards)
    sizes = {os.path.getsize(os.path.join(stores.tiny, s)) for s in stores.shards}

    def cache_cmd(*args):
        r = subprocess.run([CLI, "cache", str(tmp_path), *args], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    listed = json.loads(cache_cmd("--json"))
    assert listed["files"] == n and len(listed["entries"]) == n
    assert sorted(e["url"] for e in listed["entries"]) == \
        sorted(f"{url}/{s}" for s in stores.shards)
    assert {e["size"] for e in listed["entries"]} == sizes
    assert all(e["etag"] and len(e["key"]) == 64 for e in listed["entries"])
    used = [e["last_used"] for e in listed["entries"]]
    assert used == sorted(used, reverse=True)  # most recently used first
    assert f"{tmp_path}: {n} files" in cache_cmd()
    # Pruned down to the most recently used file's size: the others go, oldest first.
    keep = listed["entries"][0]
    pruned = json.loads(cache_cmd("--prune", str(keep["size"]), "--json"))
    assert [e["url"] for e in pruned["entries"]] == [keep["url"]]
    assert [e["url"] for e in pruned["removed"]] == [e["url"] for e in listed["entries"][:0:-1]]
    assert "removed 1 file" in cache_cmd("--prune", "0")
    listed = json.loads(cache_cmd("--json"))
    assert listed["files"] == 0
    assert listed["downloads"] == {"running": 0, "running_bytes": 0, "left_over": 0,
                                   "left_over_bytes": 0}
    # What a download killed half-way (SIGKILL) leaves in tmp/ is counted apart, and a prune
    # removes it.
    (tmp_path / "tmp" / ("ab" * 32 + ".999.0")).write_bytes(b"x" * 100_000)
    listed = json.loads(cache_cmd("--json"))
    assert listed["downloads"]["left_over"] == 1, listed
    assert listed["downloads"]["left_over_bytes"] >= 100_000, listed
    assert "1 file left in tmp/ by interrupted downloads" in cache_cmd()
    assert json.loads(cache_cmd("--prune", "1G", "--json"))["downloads"]["left_over"] == 0
    assert os.listdir(tmp_path / "tmp") == []
    # The next load downloads them again.
    got, stats = load_with_stats(url, storage_options=opts)
    assert_same(got, load_all(stores.tiny))
    assert stats.cache_fills == n
    r = subprocess.run([CLI, "cache", str(tmp_path / "nothing")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "not an object cache (no blobs/)" in r.stderr

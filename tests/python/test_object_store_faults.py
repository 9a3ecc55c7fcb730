"""Object-storage loads under faults and with tensor parallelism (issue 13, points 4 and 5).

Faults come from fault_proxy.FaultProxy between tensorferry and the real server (SeaweedFS for
s3://, nginx for http://): resets mid-body, stalls, 503 SlowDown, 500 InternalError, truncated
bodies, and objects overwritten mid-load. Every load ends byte-exact or with a clear error; a batch
of a failed load is never handed out. Timeouts are short (object_timeout_ms 1500) so that stalls
cost seconds, not minutes."""
import contextlib
import json
import os
import subprocess
import time

import numpy as np
import pytest
import torch
from conftest import CLI, reference_slice
from fault_proxy import KINDS, Rule
from test_object_store import PREFIX, Stores, assert_same, clean_aws_env, load_all

import tensorferry
import tensorferry.torch
from tensorferry import ShardSpec

FAST = {"object_timeout_ms": 1500, "object_header_bytes": 4096}
STALL_S = 20.0  # a stall lasts this long, then the proxy resets the connection


@pytest.fixture(autouse=True)
def _no_ambient_aws(monkeypatch):
    clean_aws_env(monkeypatch)


@pytest.fixture(scope="module")
def stores(seaweed, nginx_http, tiny_checkpoint):
    return Stores(seaweed, nginx_http, tiny_checkpoint)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory, seaweed, nginx_http):
    """About 12 MB of F32 tensors in 3 shards with an index, on S3 and nginx (PREFIX/big)."""
    import safetensors.torch as st
    out = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(13)
    weight_map = {}
    for s in range(3):
        tensors = {f"layers.{s}.w{i}": torch.from_numpy(
            rng.standard_normal((256 + 64 * i, 1024 - 96 * i), dtype=np.float32))
            for i in range(4)}
        name = f"model-{s + 1:05d}-of-00003.safetensors"
        st.save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    seaweed.upload_dir(seaweed.BUCKET, f"{PREFIX}/big", str(out))
    nginx_http.copy_dir(str(out), f"{PREFIX}/big")
    return str(out)


def through_proxy(stores, request, store, rel, **more):
    """(proxy, URL of PREFIX/rel through it, storage_options) for "s3" or "http"."""
    if store == "s3":
        proxy = request.getfixturevalue("s3_proxy")
        return (proxy, stores.seaweed.url(f"{PREFIX}/{rel}"),
                stores.s3_options(endpoint=proxy.url, **FAST, **more))
    proxy = request.getfixturevalue("nginx_proxy")
    if not rel.endswith((".json", ".safetensors")):
        rel += "/model.safetensors.index.json"  # nginx cannot list, but a prefix finds its index
    return proxy, f"{proxy.url}/{PREFIX}/{rel}", dict(FAST, **more)


def not_the_open(request):
    """Not the first GET of a file (bytes 0-...), the one Checkpoint::Open makes."""
    return not request.headers.get("range", "").startswith("bytes=0-")


def fault_rule(kind, **kw):
    extra = {"stall_s": STALL_S} if kind == "stall" else {}
    extra.update(kw)
    return Rule(kind, only_ranged=True, **extra)


# --- 4. faults ------------------------------------------------------------------------------------

@pytest.mark.parametrize("store", ["s3", "http"])
@pytest.mark.parametrize("kind", KINDS)
def test_retried_fault_ends_in_a_byte_exact_load(stores, request, store, kind):
    proxy, url, opts = through_proxy(stores, request, store, "tiny")
    # Faults on the load's GETs (opens retry too, but count in no load's stats).
    proxy.set_rules([fault_rule(kind, every=2, times=1 if kind == "stall" else 3,
                                match=not_the_open)])
    with tensorferry.Loader(url, storage_options=opts) as loader:
        start = time.monotonic()
        got = loader.load()
        seconds = time.monotonic() - start
        stats = loader.stats
    assert_same(got, load_all(stores.tiny))
    assert proxy.stats()["faults"][kind] > 0
    if kind == "stall":  # given up after object_timeout_ms without a byte, not at the reset
        assert seconds < STALL_S / 2, seconds
    assert stats.remote_retries > 0 and stats.remote_requests > stats.remote_retries


def test_listing_and_index_probe_are_retried(stores, s3_proxy):
    """The first GETs of a load without index: the index probe (a ranged GET that ends in
    NoSuchKey) and the ListObjectsV2 request, each answered 503 SlowDown once."""
    opts = stores.s3_options(endpoint=s3_proxy.url, **FAST)
    s3_proxy.set_rules([
        Rule("status_503_slowdown", every=1, times=1, match=lambda r: "list-type=2" in r.target),
        Rule("status_503_slowdown", every=1, times=1,
             match=lambda r: r.target.endswith("model.safetensors.index.json"))])
    url = stores.seaweed.url(f"{PREFIX}/tiny-noindex")
    assert_same(load_all(url, storage_options=opts), load_all(stores.tiny_noindex))
    assert s3_proxy.stats()["faults"]["status_503_slowdown"] == 2


def test_cli_reports_retries_and_loads_byte_exact(stores, s3_proxy):
    s3_proxy.set_rules([fault_rule("reset_mid_body", every=2, times=3, match=not_the_open)])
    env = dict(os.environ)
    env.update(stores.seaweed.env(endpoint=s3_proxy.url))
    env["TENSORFERRY_OBJECT_HEADER_BYTES"] = "4096"
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    r = subprocess.run([CLI, "load", url, "--json", "--object-timeout-ms", "1500"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    want = subprocess.run([CLI, "load", stores.tiny, "--json"], capture_output=True, text=True,
                          timeout=60)
    assert got["checksum"] == json.loads(want.stdout)["checksum"]
    assert got["remote_retries"] > 0 and got["remote_requests"] > 0 and got["remote_bytes"] > 0


@pytest.mark.parametrize("store", ["s3", "http"])
@pytest.mark.parametrize("kind,why", [("status_503_slowdown", "HTTP 503 SlowDown"),
                                      ("status_500", "HTTP 500 InternalError"),
                                      ("reset_mid_body", "reset by peer")])
def test_persistent_fault_gives_up_naming_url_range_attempts_status(stores, request, store, kind,
                                                                    why):
    proxy, url, opts = through_proxy(stores, request, store, "tiny", object_retries=2)
    proxy.set_rules([fault_rule(kind, every=1, match=not_the_open)])
    loader = tensorferry.Loader(url, storage_options=opts)  # opens: not faulted
    files = loader.files
    with loader, pytest.raises(OSError) as e:
        loader.load()
    msg = str(e.value)
    shard_urls = [u for u in files if u in msg]
    assert len(shard_urls) == 1, msg
    assert "GET bytes " in msg and "gave up after 3 attempts" in msg and why in msg, msg
    # Opening faults the same way: the first GET of a file, named as such.
    proxy.set_rules([fault_rule(kind, every=1)])
    with pytest.raises(OSError) as e:
        tensorferry.Loader(url, storage_options=opts)
    msg = str(e.value)
    assert "open (GET bytes 0-4095)" in msg and "gave up after 3 attempts" in msg, msg


def test_persistent_stall_gives_up_after_the_timeouts(stores, s3_proxy):
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    opts = stores.s3_options(endpoint=s3_proxy.url, object_retries=1, **FAST)
    loader = tensorferry.Loader(url, storage_options=opts)
    s3_proxy.set_rules([fault_rule("stall", every=1, match=not_the_open)])
    start = time.monotonic()
    with loader, pytest.raises(OSError) as e:
        loader.load()
    seconds = time.monotonic() - start
    msg = str(e.value)
    assert "stalled: no byte received for 1500 ms" in msg and "gave up after 2 attempts" in msg
    assert seconds < STALL_S / 2, seconds  # two timeouts and a backoff, not the stall


def test_status_that_is_not_retried_fails_at_once(stores, s3_proxy):
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    opts = stores.s3_options(endpoint=s3_proxy.url, **FAST)
    opts["s3_secret_access_key"] = "not-the-secret"
    with pytest.raises(OSError, match="SignatureDoesNotMatch") as e:
        tensorferry.Loader(url, storage_options=opts)
    assert "attempts" not in str(e.value)
    assert s3_proxy.stats()["requests"] == 1


def test_an_http_prefix_whose_index_cannot_be_read_is_that_error(stores, nginx_proxy, tmp_path):
    """A folder with an index and a model.safetensors too: when the index cannot be read (503
    after the retries), that is the error, not a quiet load of the other file; when it is
    missing (or refused: a bucket served over HTTP), the single file is the checkpoint."""
    import shutil
    folder = tmp_path / "both"
    shutil.copytree(stores.tiny, folder)
    tensorferry.torch.save_file({"other": torch.zeros(3)}, str(folder / "model.safetensors"))
    stores.nginx.copy_dir(str(folder), f"{PREFIX}/both")
    url = f"{nginx_proxy.url}/{PREFIX}/both"
    opts = dict(FAST, object_retries=1)
    nginx_proxy.set_rules([Rule("status_503_slowdown", every=1,
                                match=lambda r: r.target.endswith("index.json"))])
    with pytest.raises(OSError, match=r"model.safetensors.index.json.*HTTP 503") as e:
        tensorferry.Loader(url, storage_options=opts)
    assert "model.safetensors:" not in str(e.value)  # the single file was not asked
    nginx_proxy.set_rules([])
    with tensorferry.Loader(url, storage_options=opts) as loader:
        assert "other" not in loader.keys()  # the index's checkpoint


def changed_copy(path, shorter):
    """The file's bytes with every data byte flipped: same header, other content; `shorter`:
    without its last 1000 bytes too."""
    raw = bytearray(open(path, "rb").read())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start:] = bytes(b ^ 0x5A for b in raw[start:])
    return bytes(raw[:-1000] if shorter else raw)


@pytest.mark.parametrize("shorter", [False, True], ids=["same-size", "shorter"])
@pytest.mark.parametrize("store", ["s3", "http"])
def test_object_overwritten_mid_load_is_reported_never_wrong_bytes(stores, request, store,
                                                                    shorter, big_checkpoint):
    shard = sorted(f for f in os.listdir(big_checkpoint) if f.endswith(".safetensors"))[0]
    local = os.path.join(big_checkpoint, shard)
    original = open(local, "rb").read()
    rel = f"overwrite-{store}-{int(shorter)}/{shard}"
    if store == "s3":
        stores.seaweed.upload(stores.seaweed.BUCKET, f"{PREFIX}/{rel}", original)

        def overwrite():
            stores.seaweed.overwrite(stores.seaweed.BUCKET, f"{PREFIX}/{rel}",
                                     changed_copy(local, shorter))
    else:
        stores.nginx.put(f"{PREFIX}/{rel}", original)

        def overwrite():
            stores.nginx.put(f"{PREFIX}/{rel}", changed_copy(local, shorter))
    proxy, url, opts = through_proxy(stores, request, store, rel, object_part_size=256 << 10)
    want = tensorferry.torch.load_file(local)
    loader = tensorferry.Loader(url, budget="2MiB", storage_options=opts)
    proxy.overwrite_after(3, overwrite)  # after the open and two data GETs
    delivered = deliver_until_error(loader, want, url,
                                    "file changed since the checkpoint was opened")
    assert proxy.stats()["overwrites"] == 1
    assert len(delivered) < len(want)


@pytest.mark.parametrize("store", ["s3", "http"])
def test_a_response_without_its_etag_is_never_used(stores, request, store, big_checkpoint):
    """A proxy that drops If-Match and the ETag could serve another version of the object of the
    same size: such bytes cannot be confirmed, so the load fails naming the object, and no batch
    of the other version is handed out (over S3 the signed If-Match stays, so the server answers
    the original's bytes, without their ETag: refused all the same)."""
    shard = sorted(f for f in os.listdir(big_checkpoint) if f.endswith(".safetensors"))[0]
    local = os.path.join(big_checkpoint, shard)
    rel = f"no-etag-{store}/{shard}"
    if store == "s3":
        stores.seaweed.upload(stores.seaweed.BUCKET, f"{PREFIX}/{rel}", open(local, "rb").read())

        overwrite = None
    else:
        stores.nginx.put(f"{PREFIX}/{rel}", open(local, "rb").read())

        def overwrite():
            stores.nginx.put(f"{PREFIX}/{rel}", changed_copy(local, False))
    proxy, url, opts = through_proxy(stores, request, store, rel, object_part_size=256 << 10)
    proxy.set_rules([Rule("no_etag", every=1, only_ranged=True, match=not_the_open)])
    want = tensorferry.torch.load_file(local)
    loader = tensorferry.Loader(url, budget="2MiB", storage_options=opts)
    if overwrite is not None:
        proxy.overwrite_after(1, overwrite)  # after the open: every data GET sees the new one
    delivered = deliver_until_error(loader, want, url, "without an ETag")
    assert delivered == []
    assert proxy.stats()["faults"]["no_etag"] >= 1


def deliver_until_error(loader, want, url, error):
    """Iterates the loader's batches until the OSError matching `error` and naming `url` (or one
    of its files); every batch handed out before it must be byte-exact: the bytes of the objects
    that were opened. Returns the names delivered."""
    delivered = []
    with loader, pytest.raises(OSError, match=error) as e:
        for batch in loader.iter_batches():
            assert_same(batch.tensors, {k: want[k] for k in batch.tensors})
            delivered += list(batch.tensors)
            del batch  # the budget counts what is still held
    assert url.rsplit("/", 1)[0] in str(e.value), str(e.value)
    return delivered


@pytest.mark.parametrize("store", ["s3", "http"])
def test_failed_batch_is_never_handed_out(stores, request, store, big_checkpoint):
    proxy, url, opts = through_proxy(stores, request, store, "big", object_retries=1,
                                     object_part_size=256 << 10)
    want = load_all(big_checkpoint)
    loader = tensorferry.Loader(url, budget="2MiB", storage_options=opts)
    # From the 12th data GET on, every response is a 503: the load fails part way.
    proxy.set_rules([fault_rule("status_503_slowdown", every=1, skip=12, match=not_the_open)])
    delivered = deliver_until_error(loader, want, url, "gave up after 2 attempts")
    assert 0 < len(delivered) < len(want)


@pytest.mark.parametrize("store", ["s3", "http"])
def test_one_reset_in_twenty_still_loads_byte_exact(stores, request, store, big_checkpoint):
    proxy, url, opts = through_proxy(stores, request, store, "big", object_part_size=256 << 10)
    proxy.set_rules([Rule("reset_mid_body", probability=0.05, seed=20, only_ranged=True)])
    with tensorferry.Loader(url, storage_options=opts) as loader:
        got = loader.load()
        stats = loader.stats
    assert_same(got, load_all(big_checkpoint))
    faults = proxy.stats()["faults"]["reset_mid_body"]
    assert faults > 0 and stats.remote_retries >= faults
    assert stats.remote_requests >= 12 << 20 >> 18  # 256 KB parts


# --- 5. tensor parallelism ------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_ranks_read_their_share_only(stores, world):
    import safetensors.torch as st
    full = {}
    for shard in stores.shards:
        full.update(st.load_file(os.path.join(stores.tiny, shard)))
    spec = ShardSpec.builtin()
    total = sum(t.numel() * t.element_size() for t in full.values())
    split = sum(t.numel() * t.element_size() for n, t in full.items()
                if "split" in spec.rule_for(n))
    share = split / world + (total - split)
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    for rank in range(world):
        kw = dict(tp_rank=rank, tp_size=world, shard_max_gap=0)
        with tensorferry.Loader(stores.tiny, engine="pread", **kw) as loader:
            want = loader.load()
            local_read = loader.stats.bytes_read
        with tensorferry.Loader(url, storage_options=stores.s3_options(), **kw) as loader:
            got = loader.load()
            stats = loader.stats
        assert_same(got, want)
        for name, t in full.items():
            assert torch.equal(got[name], reference_slice(t, spec.rule_for(name), rank, world))
        # The load's GETs carry the rank's bytes and nothing else (the headers were read when
        # the checkpoint was opened).
        assert stats.bytes_read == local_read
        assert stats.remote_bytes == stats.bytes_read
        assert stats.remote_bytes <= share * 1.01, (stats.remote_bytes, share)


def test_selected_tensors_transfer_their_bytes_only(stores):
    url = stores.seaweed.url(f"{PREFIX}/tiny")
    with tensorferry.Loader(stores.tiny) as loader:
        names = loader.keys()[1::3]
    want = load_all(stores.tiny, select=names)
    with tensorferry.Loader(url, select=names, storage_options=stores.s3_options()) as loader:
        got = loader.load()
        stats = loader.stats
    assert_same(got, want)
    assert stats.remote_bytes == stats.bytes_read
    assert stats.bytes == sum(t.numel() * t.element_size() for t in want.values())
    # Coalescing may read small gaps between the selected tensors, never the whole checkpoint.
    assert stats.remote_bytes < sum(os.path.getsize(os.path.join(stores.tiny, f))
                                    for f in stores.shards) / 2


@contextlib.contextmanager
def answering(respond):
    """An HTTP server on loopback whose every GET is answered by respond(path) -> (status,
    {header: value}, body); yields its URL. respond may instead return a callable, called with
    the request handler to answer in its own way (raw bytes on handler.wfile)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            answer = respond(self.path)
            if callable(answer):
                answer(self)
                return
            status, headers, body = answer
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_listing_that_repeats_its_token_ends_with_an_error():
    """A store whose ListObjectsV2 answers the same continuation token again would be asked for
    the same page forever: the second time it is an error naming the listing."""
    page = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name>'
            b'<Prefix>p/</Prefix><KeyCount>1</KeyCount><IsTruncated>true</IsTruncated>'
            b'<NextContinuationToken>again</NextContinuationToken><Contents>'
            b'<Key>p/a.safetensors</Key><Size>16</Size></Contents></ListBucketResult>')
    missing = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code>'
               b'<Message>no</Message></Error>')
    lists = []

    def respond(path):
        if "list-type=2" not in path:
            return 404, {"Content-Type": "application/xml"}, missing
        lists.append(path)
        return 200, {"Content-Type": "application/xml"}, page

    with answering(respond) as url:
        opts = {"s3_endpoint": url, "s3_anonymous": "1", "object_retries": 0}
        with pytest.raises(OSError, match="the same continuation token twice"):
            tensorferry.Loader("s3://b/p", storage_options=opts)
    assert len(lists) == 2, lists

def test_a_truncated_listing_without_a_token_is_an_error():
    """A page that says it is truncated but gives no NextContinuationToken (a server answering
    in ListObjects version 1's way) would end the listing early, its other files silently left
    out: an error naming the listing instead."""
    page = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name>'
            b'<Prefix>p/</Prefix><KeyCount>1</KeyCount><IsTruncated>true</IsTruncated>'
            b'<NextMarker>p/a.safetensors</NextMarker><Contents>'
            b'<Key>p/a.safetensors</Key><Size>16</Size></Contents></ListBucketResult>')
    missing = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code>'
               b'<Message>no</Message></Error>')

    def respond(path):
        if "list-type=2" not in path:
            return 404, {"Content-Type": "application/xml"}, missing
        return 200, {"Content-Type": "application/xml"}, page

    with answering(respond) as url:
        opts = {"s3_endpoint": url, "s3_anonymous": "1", "object_retries": 0}
        with pytest.raises(OSError, match='listing "p/": page 1 is truncated but carries no '
                                          'NextContinuationToken'):
            tensorferry.Loader("s3://b/p", storage_options=opts)


@pytest.mark.timeout(120)
def test_an_endless_error_body_is_cut_off(tmp_path):
    """A 503 whose body never ends (sent as fast as the client takes it: no stall, no slow
    transfer) is read up to what is kept of an error and no further, then retried; the load
    completes byte-exact."""
    tensorferry.torch.save_file({"w": torch.arange(50_000, dtype=torch.float32)},
                                str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    answered = {"endless": 0, "ranges": 0}

    def endless(handler):
        answered["endless"] += 1
        handler.send_response(503)
        handler.send_header("Content-Type", "application/xml")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        chunk = b"<Error><Code>SlowDown</Code><Message>" + b"x" * 65536 + b"</Message></Error>"
        framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        until = time.monotonic() + 60  # endless, as far as the client can tell
        try:
            while time.monotonic() < until:
                handler.wfile.write(framed)
        except OSError:
            pass  # the client hung up: what it should do
        handler.close_connection = True

    def respond(path):
        if "m.safetensors" not in path:
            return 404, {}, b""
        answered["ranges"] += 1
        if answered["ranges"] == 3:  # a data read (the open took the first)
            return endless

        def ranged(handler):
            first, last = map(int, handler.headers["Range"].split("=")[1].split("-"))
            last = min(last, len(data) - 1)
            body = data[first:last + 1]
            handler.send_response(206)
            handler.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
            handler.send_header("Content-Length", str(len(body)))
            handler.send_header("ETag", '"v1"')
            handler.end_headers()
            handler.wfile.write(body)
        return ranged

    with answering(respond) as url:
        opts = {"object_header_bytes": 4096, "object_part_size": "64KiB", "object_concurrency": 1,
                "object_timeout_ms": 30000}
        start = time.monotonic()
        with tensorferry.Loader(f"{url}/m.safetensors", storage_options=opts) as loader:
            got = loader.load()
            retries = loader.stats.remote_retries
        seconds = time.monotonic() - start
    assert answered["endless"] == 1
    assert retries >= 1
    assert torch.equal(got["w"], torch.arange(50_000, dtype=torch.float32))
    assert seconds < 30, seconds


def test_a_transfer_that_fails_after_its_last_byte_is_not_asked_again(tmp_path):
    """A ranged GET whose every byte arrived before the transfer failed (a chunked 206 whose end
    never came, then a reset) is complete: no request for the empty, inverted range that is left
    (which nginx answers 416, and a server ignoring an invalid Range with the whole object)."""
    import socket
    import struct

    tensorferry.torch.save_file({"w": torch.arange(50_000, dtype=torch.float32)},
                                str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    asked = []

    def respond(path):
        if "m.safetensors" not in path:
            return 404, {}, b""

        def ranged(handler):
            spec = handler.headers["Range"].split("=")[1]
            asked.append(spec)
            first, last = map(int, spec.split("-"))
            if first > last:
                handler.send_response(416)
                handler.send_header("Content-Range", f"bytes */{len(data)}")
                handler.send_header("Content-Length", "0")
                handler.end_headers()
                return
            last = min(last, len(data) - 1)
            body = data[first:last + 1]
            handler.send_response(206)
            handler.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
            handler.send_header("ETag", '"v1"')
            if len(asked) == 2:  # the first data read: every byte, then no end and a reset
                handler.send_header("Transfer-Encoding", "chunked")
                handler.end_headers()
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(body), body))
                handler.wfile.flush()
                time.sleep(0.2)
                handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                              struct.pack("ii", 1, 0))
                handler.close_connection = True
                handler.connection.close()
                return
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
        return ranged

    with answering(respond) as url:
        opts = {"object_header_bytes": 4096, "object_concurrency": 1, "object_retries": 2}
        with tensorferry.Loader(f"{url}/m.safetensors", storage_options=opts) as loader:
            got = loader.load()
    assert torch.equal(got["w"], torch.arange(50_000, dtype=torch.float32))
    inverted = [a for a in asked if int(a.split("-")[0]) > int(a.split("-")[1])]
    assert not inverted, asked


def test_a_server_that_ignores_ranges_is_named_so(tmp_path):
    """Python's http.server answers every GET with the whole file (HTTP 200): the error says the
    Range header was ignored, not only that more bytes came than asked for."""
    import functools
    import http.server
    import threading

    tensorferry.torch.save_file({"w": torch.zeros(300_000)}, str(tmp_path / "m.safetensors"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/m.safetensors"
        with pytest.raises(OSError, match="ignored the Range header"):
            tensorferry.Loader(url, storage_options={"object_header_bytes": 4096,
                                                     "object_retries": 0})
    finally:
        server.shutdown()
        server.server_close()


def test_a_bucket_in_another_region_is_named_with_its_region():
    """S3 answers a request for a bucket of another region with 301 PermanentRedirect and the
    x-amz-bucket-region header: the error says where the bucket is and how to ask there."""
    body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>PermanentRedirect</Code>'
            b'<Message>The bucket you are attempting to access must be addressed using the '
            b'specified endpoint.</Message><Endpoint>b.s3.eu-west-1.amazonaws.com</Endpoint>'
            b'</Error>')
    headers = {"x-amz-bucket-region": "eu-west-1", "Content-Type": "application/xml"}
    with answering(lambda path: (301, headers, body)) as url:
        opts = {"s3_endpoint": url, "s3_anonymous": "1", "object_retries": 0}
        with pytest.raises(OSError, match="the bucket is in region eu-west-1: set AWS_REGION"):
            tensorferry.Loader("s3://b/m.safetensors", storage_options=opts)

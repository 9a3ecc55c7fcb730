"""The AWS credential providers of s3:// loads (web identity, credential_process, container
credentials, EC2 instance metadata) against real servers on loopback:

* S3 and STS: SeaweedFS with its STS configured (SeaweedS3(sts=issuer), this module's own
  `seaweed`): AssumeRoleWithWebIdentity on the S3 port checks the JWT against the JWKS of our OIDC
  issuer and hands out session credentials, which S3 checks (x-amz-security-token) on every GET.
  The role reads BUCKET only; no static key of the checkpoint's reader is in any environment.
* the container credentials endpoint and IMDSv2: aws_credential_servers (loopback), handing out
  session credentials of that same STS, so that a load succeeds only with what they gave.
* a profile that assumes a role (role_arn with source_profile or credential_source =
  Environment): AssumeRole of SeaweedFS's ASSUMED_ROLE_ARN, SigV4-signed with ADMIN's keys (the
  role trusts ADMIN only), seen on its way by a recording proxy (AWS_ENDPOINT_URL_STS).

Each provider is exercised through the CLI (`load URL --json`) and Python (tensorferry.numpy in a
child process: the variables are the child's, never this process's), both compared byte for byte
with the local file, and through boto3, which implements every one of these providers: a boto3
failure says the servers or the environment are wrong, not tensorferry."""
import hashlib
import json
import os
import re
import subprocess
import sys
import urllib.parse

import numpy as np
import pytest
from aws_credential_servers import (ContainerCredentials, Imds, OidcIssuer, RecordingProxy,
                                    non_loopback_ipv4)
from botocore.exceptions import ClientError
from conftest import CLI, running
from objstore_servers import SeaweedS3

import tensorferry.numpy

KEY = "aws-credentials/model.safetensors"
SESSION_NAME = "tensorferry-env-session"
# A child process loading the URL in argv[1] with tensorferry.numpy and printing, as JSON, a list
# with one entry per load: {"tensors": [[name, dtype, shape, sha256]...]} or {"error", "message"},
# each with its start and end (time.time()). With more arguments (seconds, path, text): after the
# first load it writes text to path, sleeps that long and loads again. CHILD_STORAGE_OPTIONS in
# its environment (JSON), when set: the loads' storage_options.
CHILD = r"""
import hashlib, json, os, sys, time
import tensorferry.numpy

OPTIONS = json.loads(os.environ.get("CHILD_STORAGE_OPTIONS") or "null")

def load(url):
    start = time.time()
    try:
        arrays = tensorferry.numpy.load_file(url, storage_options=OPTIONS)
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "start": start, "end": time.time()}
    tensors = [[n, str(a.dtype), list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()]
               for n, a in arrays.items()]
    return {"tensors": tensors, "start": start, "end": time.time()}

out = [load(sys.argv[1])]
if len(sys.argv) > 2:
    with open(sys.argv[3], "w") as f:
        f.write(sys.argv[4])
    time.sleep(float(sys.argv[2]))
    out.append(load(sys.argv[1]))
print(json.dumps(out))
"""


# -- servers and the checkpoint --------------------------------------------------------------------
@pytest.fixture(scope="module")
def issuer():
    server = OidcIssuer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def seaweed(issuer):
    """This module's SeaweedFS (conftest's is without STS): STS trusting `issuer`."""
    yield from running(SeaweedS3(sts=issuer), "SeaweedFS")


class Checkpoint:
    """A small checkpoint (several dtypes) at KEY in BUCKET and PUBLIC_BUCKET, and what loading
    the local copy gives: through the CLI (checksum, tensors, bytes) and through CHILD."""

    def __init__(self, seaweed, local):
        self.local = local
        with open(local, "rb") as f:
            self.data = f.read()
        seaweed.upload(seaweed.BUCKET, KEY, local)
        seaweed.upload(seaweed.PUBLIC_BUCKET, KEY, local)
        self.url = seaweed.url(KEY)
        self.public_url = seaweed.url(KEY, seaweed.PUBLIC_BUCKET)
        r = subprocess.run([CLI, "load", local, "--json"], capture_output=True, text=True,
                           timeout=120, env=child_env({}))
        assert r.returncode == 0, r.stdout + r.stderr
        self.cli = json.loads(r.stdout)
        (self.tensors,) = run_child(local, {})
        assert "tensors" in self.tensors, self.tensors
        self.tensors = self.tensors["tensors"]


@pytest.fixture(scope="module")
def ckpt(seaweed, tmp_path_factory):
    rng = np.random.default_rng(7)
    arrays = {"embed.weight": rng.standard_normal((48, 32)).astype(np.float32),
              "norm.bias": rng.standard_normal(32).astype(np.float16),
              "ids": np.arange(17, dtype=np.int64) * 3 - 5,
              "mask": (rng.random((5, 7)) > 0.5)}
    path = str(tmp_path_factory.mktemp("aws-creds") / "model.safetensors")
    tensorferry.numpy.save_file(arrays, path)
    return Checkpoint(seaweed, path)


def session_creds(seaweed):
    """A callable handing out a fresh STS session of SeaweedFS at each call."""
    return lambda: seaweed.session_credentials(session_name="tensorferry-tests-servers")


@pytest.fixture
def container(seaweed):
    server = ContainerCredentials(session_creds(seaweed), tokens={"container-token-A"})
    yield server
    server.stop()


@pytest.fixture
def imds(seaweed):
    server = Imds(session_creds(seaweed))
    yield server
    server.stop()


@pytest.fixture
def sts_proxy(seaweed):
    """A recording proxy in front of SeaweedFS's STS (AWS_ENDPOINT_URL_STS)."""
    host, port = seaweed.endpoint[len("http://"):].rsplit(":", 1)
    server = RecordingProxy(host, int(port))
    yield server
    server.stop()


# -- environments ----------------------------------------------------------------------------------
def child_env(env):
    """This process's environment less every AWS_* variable, plus `env` (None values dropped)."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    out.update({k: v for k, v in env.items() if v is not None})
    return out


def base_env(seaweed, tmp_path, config="", credentials=""):
    """SeaweedS3.env() without its keys: AWS_ENDPOINT_URL (S3, and STS unless
    AWS_ENDPOINT_URL_STS is set), the region, IMDS disabled, and AWS_CONFIG_FILE /
    AWS_SHARED_CREDENTIALS_FILE written in tmp_path with `config` / `credentials`."""
    env = seaweed.env()
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    for var, name, text in (("AWS_CONFIG_FILE", "aws-config", config),
                            ("AWS_SHARED_CREDENTIALS_FILE", "aws-credentials", credentials)):
        path = tmp_path / name
        path.write_text(text)
        env[var] = str(path)
    return env


def write_file(path, text, mode=0o600):
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def web_identity_env(seaweed, tmp_path, token, sts_url=None):
    env = base_env(seaweed, tmp_path)
    env.update({"AWS_WEB_IDENTITY_TOKEN_FILE": write_file(tmp_path / "web-identity-token", token),
                "AWS_ROLE_ARN": seaweed.ROLE_ARN, "AWS_ROLE_SESSION_NAME": SESSION_NAME})
    if sts_url:
        env["AWS_ENDPOINT_URL_STS"] = sts_url
    return env


def credential_process_script(tmp_path, body):
    """An executable sh script in tmp_path; `body` is its text after the #! line."""
    return write_file(tmp_path / "credential-process.sh", "#!/bin/sh\n" + body, 0o700)


def container_env(seaweed, tmp_path, uri, token):
    env = base_env(seaweed, tmp_path)
    env.update({"AWS_CONTAINER_CREDENTIALS_FULL_URI": uri,
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE":
                    write_file(tmp_path / "container-token", token),
                "AWS_CONTAINER_AUTHORIZATION_TOKEN": "container-token-from-the-variable"})
    return env


def imds_env(seaweed, tmp_path, endpoint):
    env = base_env(seaweed, tmp_path)
    env.pop("AWS_EC2_METADATA_DISABLED")
    env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = endpoint
    return env


# -- running loads ---------------------------------------------------------------------------------
def run_cli(url, env, *args):
    return subprocess.run([CLI, "load", url, "--json", *args], capture_output=True, text=True,
                          timeout=180, env=child_env(env))


def named(profile, env):
    """The CLI's arguments and the environment (CHILD's storage_options) of loads under `env`
    that name `profile` in their options (--s3-profile, s3_profile); none when it is None."""
    if profile is None:
        return [], env
    return ["--s3-profile", profile], dict(env, CHILD_STORAGE_OPTIONS=json.dumps(
        {"s3_profile": profile}))


def run_child(url, env, *then):
    """CHILD's list of loads (see CHILD; `then`: seconds, path, text for a second load)."""
    r = subprocess.run([sys.executable, "-c", CHILD, url, *map(str, then)], capture_output=True,
                       text=True, timeout=180, env=child_env(env))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_loads(ckpt, url, env, profile=None):
    """The CLI and Python both load `url` under `env` (with `profile` named in their options),
    equal to the local file."""
    args, env = named(profile, env)
    r = run_cli(url, env, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout)
    for field in ("checksum", "tensors", "bytes"):
        assert got[field] == ckpt.cli[field], field
    (py,) = run_child(url, env)
    assert py.get("tensors") == ckpt.tensors, py


def failed_loads(url, env, profile=None):
    """The messages of the CLI's and Python's failed loads of `url` under `env` (with `profile`
    named in their options)."""
    args, env = named(profile, env)
    r = run_cli(url, env, *args)
    assert r.returncode == 1, r.stdout + r.stderr
    (py,) = run_child(url, env)
    assert "error" in py, py
    return [r.stdout + r.stderr, py["message"]]


def unsupported_loads(url, env):
    """The messages of the CLI's and Python's loads of `url` under `env`, refused as unsupported
    (the CLI's error code "unsupported", Python's UnsupportedError)."""
    r = run_cli(url, env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert json.loads(r.stdout)["error"]["code"] == "unsupported", r.stdout
    (py,) = run_child(url, env)
    assert py.get("error") == "UnsupportedError", py
    return [r.stdout + r.stderr, py["message"]]


def form(req):
    """The fields of a form-encoded request body."""
    return dict(urllib.parse.parse_qsl(req.body.decode(), keep_blank_values=True))


# -- boto3: the servers and the environments are right ---------------------------------------------
PROVIDERS = ["web-identity-env", "web-identity-profile", "credential-process", "container",
             "imds"]
BOTO3_METHOD = {"web-identity-env": "assume-role-with-web-identity",
                "web-identity-profile": "assume-role-with-web-identity",
                "credential-process": "custom-process", "container": "container-role",
                "imds": "iam-role"}


def provider_env(name, seaweed, tmp_path, issuer, sts_proxy, container, imds):
    """The environment of one provider's successful case (the tests below say more)."""
    if name == "web-identity-env":
        return web_identity_env(seaweed, tmp_path, issuer.token(), sts_proxy.url)
    if name == "web-identity-profile":
        token = write_file(tmp_path / "profile-token", issuer.token())
        return dict(base_env(seaweed, tmp_path, config=(
            f"[profile irsa]\nweb_identity_token_file = {token}\n"
            f"role_arn = {seaweed.ROLE_ARN}\n")), AWS_PROFILE="irsa")
    if name == "credential-process":
        creds = seaweed.session_credentials()
        doc = dict(creds, Version=1)
        write_file(tmp_path / "process-creds.json", json.dumps(doc))
        script = credential_process_script(tmp_path, (
            '[ "$1" = tensorferry-tests ] || exit 2\n'
            f'echo run >> "{tmp_path}/process-runs"\n'
            f'cat "{tmp_path}/process-creds.json"\n'))
        # Config-file keys of the same profile come after credential_process: they are wrong.
        return base_env(seaweed, tmp_path, config=(
            f"[default]\ncredential_process = {script} tensorferry-tests\n"
            "aws_access_key_id = AKIACONFIGFILEKEY000\n"
            "aws_secret_access_key = config-file-secret-that-must-not-be-used\n"))
    if name == "container":
        return container_env(seaweed, tmp_path, container.uri, "container-token-A")
    assert name == "imds"
    return imds_env(seaweed, tmp_path, imds.endpoint)


@pytest.mark.parametrize("name", PROVIDERS)
def test_boto3_reads_with_each_provider(name, seaweed, ckpt, issuer, sts_proxy, container, imds,
                                        tmp_path, monkeypatch):
    import boto3
    from botocore.config import Config
    env = provider_env(name, seaweed, tmp_path, issuer, sts_proxy, container, imds)
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    session = boto3.Session()
    assert session.get_credentials().method == BOTO3_METHOD[name]
    s3 = session.client("s3", config=Config(s3={"addressing_style": "path"}))
    body = s3.get_object(Bucket=seaweed.BUCKET, Key=KEY)["Body"].read()
    assert body == ckpt.data
    if name == "web-identity-env":
        (req,) = sts_proxy.requests
        assert form(req)["Action"] == "AssumeRoleWithWebIdentity"
        assert form(req)["RoleSessionName"] == SESSION_NAME
    if name == "container":
        assert [r.headers["authorization"] for r in container.fetches()] == ["container-token-A"]
    if name == "imds":
        assert [(r.method, r.path) for r in imds.requests][:2] == [
            ("PUT", Imds.TOKEN_PATH), ("GET", Imds.CREDS_PATH)]
        assert imds.requests[-1].path == Imds.CREDS_PATH + imds.role


def test_boto3_sees_the_sts_errors_and_the_session_rules(seaweed, ckpt, issuer):
    """What the web identity tests expect of SeaweedFS's STS, seen by boto3."""
    sts = seaweed.sts_client()

    def code(token):
        with pytest.raises(ClientError) as e:
            sts.assume_role_with_web_identity(RoleArn=seaweed.ROLE_ARN,
                                              RoleSessionName="tf-boto3", WebIdentityToken=token)
        return e.value.response["ResponseMetadata"]["HTTPStatusCode"], \
            e.value.response["Error"]["Code"]

    assert code(issuer.token(forged=True)) == (400, "InvalidParameterValue")
    assert code(issuer.token(lifetime_s=-600)) == (400, "ExpiredTokenException")
    assert code(issuer.token(audience="someone-else")) == (400, "InvalidParameterValue")
    c = seaweed.session_credentials()
    keys = (c["AccessKeyId"], c["SecretAccessKey"], c["SessionToken"])
    assert seaweed.client(keys=keys).get_object(Bucket=seaweed.BUCKET,
                                                Key=KEY)["Body"].read() == ckpt.data
    for bad in [keys[:2], (keys[0], keys[1], "bogus-session-token")]:  # the token is checked
        with pytest.raises(ClientError) as e:
            seaweed.client(keys=bad).get_object(Bucket=seaweed.BUCKET, Key=KEY)
        assert e.value.response["Error"]["Code"] == "InvalidAccessKeyId"
    with pytest.raises(ClientError) as e:  # the role reads BUCKET only
        seaweed.client(keys=keys).get_object(Bucket=seaweed.PUBLIC_BUCKET, Key=KEY)
    assert e.value.response["Error"]["Code"] == "AccessDenied"


# -- web identity ----------------------------------------------------------------------------------
def test_web_identity_from_the_environment(seaweed, ckpt, issuer, sts_proxy, container, imds,
                                           tmp_path):
    token = issuer.token()
    env = web_identity_env(seaweed, tmp_path, token, sts_proxy.url)
    # Container credentials and IMDS come after web identity: set, never asked.
    env.update(container_env(seaweed, tmp_path, container.uri, "container-token-A"))
    env.pop("AWS_EC2_METADATA_DISABLED")
    env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = imds.endpoint
    assert_loads(ckpt, ckpt.url, env)
    assert container.count == 0 and imds.count == 0
    reqs = sts_proxy.requests
    assert len(reqs) == 2, reqs  # one per process: the session is kept while it is valid
    for req in reqs:
        assert req.method == "POST" and req.path.split("?")[0] == "/", req
        assert "authorization" not in req.headers and "x-amz-security-token" not in req.headers
        assert req.headers["content-type"].startswith("application/x-www-form-urlencoded")
        assert form(req) == {"Action": "AssumeRoleWithWebIdentity", "Version": "2011-06-15",
                             "RoleArn": seaweed.ROLE_ARN, "RoleSessionName": SESSION_NAME,
                             "WebIdentityToken": token}


def test_web_identity_from_a_profile(seaweed, ckpt, issuer, sts_proxy, container, imds,
                                     tmp_path):
    # No role_session_name: the default one must be one STS accepts (2 to 64 characters). The
    # STS endpoint is AWS_ENDPOINT_URL's (SeaweedFS itself).
    env = provider_env("web-identity-profile", seaweed, tmp_path, issuer, sts_proxy, container,
                       imds)
    assert_loads(ckpt, ckpt.url, env)


@pytest.mark.parametrize("kind,status,code", [("forged", 400, "InvalidParameterValue"),
                                              ("expired", 400, "ExpiredTokenException")])
def test_a_refused_web_identity_token_names_sts_and_its_answer(seaweed, ckpt, issuer, tmp_path,
                                                               kind, status, code):
    token = issuer.token(forged=True) if kind == "forged" else issuer.token(lifetime_s=-600)
    env = web_identity_env(seaweed, tmp_path, token)
    for msg in failed_loads(ckpt.url, env):
        assert "AssumeRoleWithWebIdentity" in msg and code in msg and str(status) in msg, msg
        assert seaweed.endpoint in msg, msg  # where the credentials were asked for
        assert token not in msg and token.split(".")[2][:16] not in msg, msg


def test_web_identity_is_asked_again_with_the_token_file_read_again(seaweed, ckpt, issuer,
                                                                    tmp_path):
    """STS credentials that expire 4 s after they were handed out (the proxy rewrites their
    Expiration): a second load after that asks STS again, with the token file's new content."""
    host, port = seaweed.endpoint[len("http://"):].rsplit(":", 1)
    with RecordingProxy(host, int(port), expiration_s=4) as proxy:
        first, second = issuer.token(), issuer.token(subject="system:serviceaccount:ml:next")
        env = web_identity_env(seaweed, tmp_path, first, proxy.url)
        loads = run_child(ckpt.url, env, 4.5, env["AWS_WEB_IDENTITY_TOKEN_FILE"], second)
        assert [load.get("tensors") for load in loads] == [ckpt.tensors] * 2, loads
        tokens = [(req.time, form(req)["WebIdentityToken"]) for req in proxy.requests]
    assert any(token == first and t <= loads[0]["end"] for t, token in tokens), tokens
    assert any(token == second and loads[1]["start"] <= t <= loads[1]["end"]
               for t, token in tokens), tokens


def test_environment_keys_win_over_web_identity(seaweed, ckpt, sts_proxy, tmp_path):
    env = web_identity_env(seaweed, tmp_path, "never-read", sts_proxy.url)
    env["AWS_WEB_IDENTITY_TOKEN_FILE"] = str(tmp_path / "no-such-token-file")
    env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = seaweed.ADMIN_KEY
    assert_loads(ckpt, ckpt.url, env)
    assert sts_proxy.count == 0


# -- credential_process ----------------------------------------------------------------------------
def test_credential_process(seaweed, ckpt, issuer, sts_proxy, container, imds, tmp_path):
    env = provider_env("credential-process", seaweed, tmp_path, issuer, sts_proxy, container,
                       imds)
    assert_loads(ckpt, ckpt.url, env)
    # Once per process (the credentials are valid for an hour).
    assert (tmp_path / "process-runs").read_text().split() == ["run", "run"]


def test_a_failing_credential_process_names_its_exit_status_and_stderr(seaweed, ckpt, tmp_path):
    script = credential_process_script(tmp_path, (
        'echo \'{"Version": 1, "AccessKeyId": "AKIAPROCESS", '
        '"SecretAccessKey": "process-secret-never-shown"}\'\n'
        "echo 'credential helper says: boom' >&2\nexit 3\n"))
    env = base_env(seaweed, tmp_path, config=f"[default]\ncredential_process = {script}\n")
    for msg in failed_loads(ckpt.url, env):
        assert "boom" in msg and "credential_process" in msg, msg
        assert re.search(r"exit(ed)?( with)? (status|code) 3\b", msg, re.I), msg
        assert "process-secret-never-shown" not in msg, msg


# -- container credentials -------------------------------------------------------------------------
def test_container_credentials(seaweed, ckpt, container, imds, tmp_path):
    # The token file wins over AWS_CONTAINER_AUTHORIZATION_TOKEN; IMDS comes after: never asked.
    env = container_env(seaweed, tmp_path, container.uri, "container-token-A")
    env.pop("AWS_EC2_METADATA_DISABLED")
    env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = imds.endpoint
    assert_loads(ckpt, ckpt.url, env)
    fetches = container.fetches()
    assert [r.headers.get("authorization") for r in fetches] == ["container-token-A"] * 2
    assert container.count == 2 and imds.count == 0


def test_a_refused_container_token_names_the_uri_and_status(seaweed, ckpt, container, tmp_path):
    env = container_env(seaweed, tmp_path, container.uri, "container-token-WRONG")
    for msg in failed_loads(ckpt.url, env):
        assert container.uri in msg and "401" in msg, msg
        assert "container-token-WRONG" not in msg, msg
        assert "container-token-from-the-variable" not in msg, msg
    assert len(container.fetches()) == 2


def test_container_http_to_another_host_is_refused_before_any_request(seaweed, ckpt, tmp_path):
    # Plain http is allowed to loopback and the ECS / EKS link-local addresses only. Where this
    # machine has another address, a server listens there: it must see no request.
    addr = non_loopback_ipv4()
    server = ContainerCredentials(session_creds(seaweed), host=addr) if addr else None
    uri = server.uri if server else "http://10.1.2.3/v1/credentials/tensorferry"
    try:
        env = container_env(seaweed, tmp_path, uri, "container-token-A")
        for msg in failed_loads(ckpt.url, env):
            assert uri in msg, msg
            assert "container-token-A" not in msg, msg
        assert server is None or server.count == 0
    finally:
        if server:
            server.stop()


def test_container_credentials_are_fetched_again_when_they_expire(seaweed, ckpt, tmp_path):
    """Credentials that expire 4 s after they were handed out: a second load after that fetches
    again, with the token file's new content."""
    server = ContainerCredentials(session_creds(seaweed), tokens={"token-one", "token-two"},
                                  lifetime_s=4)
    try:
        env = container_env(seaweed, tmp_path, server.uri, "token-one")
        loads = run_child(ckpt.url, env, 4.5, env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"],
                          "token-two")
        assert [load.get("tensors") for load in loads] == [ckpt.tensors] * 2, loads
        seen = [(r.time, r.headers.get("authorization")) for r in server.fetches()]
    finally:
        server.stop()
    assert any(auth == "token-one" and t <= loads[0]["end"] for t, auth in seen), seen
    assert any(auth == "token-two" and loads[1]["start"] <= t <= loads[1]["end"]
               for t, auth in seen), seen


# -- EC2 instance metadata -------------------------------------------------------------------------
def test_instance_metadata(seaweed, ckpt, imds, tmp_path):
    assert_loads(ckpt, ckpt.url, imds_env(seaweed, tmp_path, imds.endpoint))
    reqs = imds.requests
    role_path = Imds.CREDS_PATH + imds.role
    assert [(r.method, r.path) for r in reqs] == [
        ("PUT", Imds.TOKEN_PATH), ("GET", Imds.CREDS_PATH), ("GET", role_path)] * 2, reqs
    for put in reqs[0::3]:
        assert put.headers["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    for get in reqs[1::3] + reqs[2::3]:
        assert get.headers["x-aws-ec2-metadata-token"] in imds.issued


def test_instance_metadata_disabled_is_never_asked(seaweed, ckpt, imds, tmp_path):
    env = dict(imds_env(seaweed, tmp_path, imds.endpoint), AWS_EC2_METADATA_DISABLED="true")
    for msg in failed_loads(ckpt.url, env):  # anonymous: the bucket is private
        assert "AccessDenied" in msg and "403" in msg, msg
    assert imds.count == 0


def test_an_instance_without_a_role_reads_anonymously(seaweed, ckpt, tmp_path):
    server = Imds(session_creds(seaweed), role=None)
    try:
        env = imds_env(seaweed, tmp_path, server.endpoint)
        assert_loads(ckpt, ckpt.public_url, env)
        for msg in failed_loads(ckpt.url, env):
            assert "AccessDenied" in msg and "403" in msg, msg
        paths = [(r.method, r.path) for r in server.requests]
    finally:
        server.stop()
    assert paths[:2] == [("PUT", Imds.TOKEN_PATH), ("GET", Imds.CREDS_PATH)], paths
    assert ("GET", Imds.CREDS_PATH) in paths and all(p[1] in (Imds.TOKEN_PATH, Imds.CREDS_PATH)
                                                     for p in paths), paths


def test_keys_are_kept_when_the_instance_metadata_service_does_not_answer_a_refresh(
        seaweed, ckpt, tmp_path):
    """Keys of 12 s (fetched again from 6 s on, used until 9 s): when the refresh gets no answer
    in time (the role list answers after 2 s, a throttled service), the keys held are used until
    they expire; they are not replaced by "no credentials here", whose unsigned requests the
    private bucket refuses."""
    server = Imds(session_creds(seaweed), lifetime_s=12)
    server.stall_after = 1
    try:
        env = imds_env(seaweed, tmp_path, server.endpoint)
        loads = run_child(ckpt.url, env, 6.5, str(tmp_path / "unused"), "")
        paths = [(r.method, r.path) for r in server.requests]
    finally:
        server.stop()
    assert [load.get("tensors") for load in loads] == [ckpt.tensors] * 2, loads
    assert paths.count(("GET", Imds.CREDS_PATH)) == 2, paths  # the refresh asked, and waited
    assert paths.count(("GET", Imds.CREDS_PATH + server.role)) == 1, paths


# -- a role a profile assumes with static keys (AssumeRole) ----------------------------------------
ASSUMER_SESSION = "tensorferry-assumer-session"
EXTERNAL_ID = "tensorferry-external-id-0042"
DURATION = "3600"  # botocore fetches a session of under 15 minutes again at each use


@pytest.fixture
def signed_sts_proxy(seaweed):
    """A recording proxy in front of SeaweedFS's STS that passes the client's Host header on
    (a signed AssumeRole's signature covers it)."""
    host, port = seaweed.endpoint[len("http://"):].rsplit(":", 1)
    server = RecordingProxy(host, int(port), keep_host=True)
    yield server
    server.stop()


def static_keys(keys):
    return f"aws_access_key_id = {keys[0]}\naws_secret_access_key = {keys[1]}\n"


def assume_role_env(seaweed, tmp_path, sts_url=None, source_keys=None, keys_in="credentials",
                    more=""):
    """AWS_PROFILE=assumer, a profile assuming ASSUMED_ROLE_ARN with source_profile = base, whose
    static keys (`source_keys`, default ADMIN_KEY) are [base] in the credentials file, or
    [profile base] in the config file (keys_in="config"); `more`: more lines of [profile
    assumer]. STS: `sts_url` (AWS_ENDPOINT_URL_STS), else AWS_ENDPOINT_URL (SeaweedFS)."""
    base = static_keys(source_keys or seaweed.ADMIN_KEY)
    config = (f"[profile assumer]\nrole_arn = {seaweed.ASSUMED_ROLE_ARN}\nsource_profile = base\n"
              + more)
    credentials = ""
    if keys_in == "credentials":
        credentials = "[base]\n" + base
    else:
        config += "\n[profile base]\n" + base
    env = dict(base_env(seaweed, tmp_path, config=config, credentials=credentials),
               AWS_PROFILE="assumer")
    if sts_url:
        env["AWS_ENDPOINT_URL_STS"] = sts_url
    return env


def environment_source_env(seaweed, tmp_path, sts_url):
    """[profile assumer] assuming ASSUMED_ROLE_ARN with credential_source = Environment, and
    ADMIN's keys in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. No AWS_PROFILE: the profile is
    named in the options (a profile named by AWS_PROFILE comes after the environment's keys)."""
    env = base_env(seaweed, tmp_path, config=(
        f"[profile assumer]\nrole_arn = {seaweed.ASSUMED_ROLE_ARN}\n"
        f"credential_source = Environment\nrole_session_name = {ASSUMER_SESSION}\n"))
    env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"] = seaweed.ADMIN_KEY
    env["AWS_ENDPOINT_URL_STS"] = sts_url
    return env


def assert_signed_assume_role(req, key_id, region, fields):
    """`req` is a POST of the AssumeRole form `fields` (exactly), SigV4-signed for STS with the
    static key `key_id` (no session token): a computed payload hash, never UNSIGNED-PAYLOAD."""
    assert req.method == "POST" and req.path.split("?")[0] == "/", req
    auth = req.headers.get("authorization", "")
    assert auth.startswith(f"AWS4-HMAC-SHA256 Credential={key_id}/"), auth
    assert f"/{region}/sts/aws4_request" in auth, auth
    assert "x-amz-date" in req.headers, req.headers
    assert req.headers.get("x-amz-content-sha256") in (None, hashlib.sha256(req.body).hexdigest())
    assert "x-amz-security-token" not in req.headers, req.headers
    assert req.headers["content-type"].startswith("application/x-www-form-urlencoded")
    assert form(req) == dict(fields, Action="AssumeRole", Version="2011-06-15"), form(req)


ASSUMERS = ["source-profile", "environment"]


@pytest.mark.parametrize("name", ASSUMERS)
def test_boto3_assumes_the_role_of_a_profile(name, seaweed, ckpt, signed_sts_proxy, tmp_path,
                                             monkeypatch):
    """What the tests below expect of SeaweedFS's STS and of these environments, seen by boto3
    (botocore's AssumeRoleProvider): AssumeRole signed with ADMIN's keys, through the proxy, and
    a session that reads BUCKET; a profile named by AWS_PROFILE leaves the environment's keys
    first, one named explicitly does not."""
    import boto3
    from botocore.config import Config
    if name == "source-profile":
        env = assume_role_env(seaweed, tmp_path, signed_sts_proxy.url, more=(
            f"role_session_name = {ASSUMER_SESSION}\nexternal_id = {EXTERNAL_ID}\n"
            f"duration_seconds = {DURATION}\n"))
    else:
        env = environment_source_env(seaweed, tmp_path, signed_sts_proxy.url)
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    if name == "environment":  # AWS_PROFILE naming it: the environment's keys, no STS
        monkeypatch.setenv("AWS_PROFILE", "assumer")
        assert boto3.Session().get_credentials().method == "env"
        monkeypatch.delenv("AWS_PROFILE")
    session = boto3.Session(profile_name="assumer" if name == "environment" else None)
    creds = session.get_credentials()
    assert creds.method == "assume-role"
    s3 = session.client("s3", config=Config(s3={"addressing_style": "path"}))
    assert s3.get_object(Bucket=seaweed.BUCKET, Key=KEY)["Body"].read() == ckpt.data
    frozen = creds.get_frozen_credentials()
    assert frozen.access_key.startswith("ASIA") and frozen.token
    with pytest.raises(ClientError) as e:  # the role reads BUCKET only
        s3.get_object(Bucket=seaweed.PUBLIC_BUCKET, Key=KEY)
    assert e.value.response["Error"]["Code"] == "AccessDenied"
    (req,) = signed_sts_proxy.requests
    fields = {"RoleArn": seaweed.ASSUMED_ROLE_ARN, "RoleSessionName": ASSUMER_SESSION}
    if name == "source-profile":
        fields.update(ExternalId=EXTERNAL_ID, DurationSeconds=DURATION)
    assert_signed_assume_role(req, seaweed.ADMIN_KEY[0], seaweed.REGION, fields)


def test_boto3_sees_assume_role_refused_to_another_identity(seaweed):
    """The role trusts ADMIN only: OTHER (a valid identity) is refused, 403 AccessDenied."""
    c = seaweed.assumed_role_credentials(session_name="tf-boto3")
    assert c["AccessKeyId"].startswith("ASIA") and c["SessionToken"]
    with pytest.raises(ClientError) as e:
        seaweed.assumed_role_credentials(keys=seaweed.OTHER_KEY, session_name="tf-boto3")
    status = e.value.response["ResponseMetadata"]["HTTPStatusCode"]
    assert (status, e.value.response["Error"]["Code"]) == (403, "AccessDenied")
    assert "is not authorized to assume role" in e.value.response["Error"]["Message"]


@pytest.mark.parametrize("keys_in", ["credentials", "config"])
def test_a_role_assumed_with_a_source_profile(seaweed, ckpt, signed_sts_proxy, tmp_path, keys_in):
    # From the credentials file: with every optional setting. From the config file: with none
    # but role_session_name (no ExternalId, no DurationSeconds in the form).
    more = f"role_session_name = {ASSUMER_SESSION}\n"
    fields = {"RoleArn": seaweed.ASSUMED_ROLE_ARN, "RoleSessionName": ASSUMER_SESSION}
    if keys_in == "credentials":
        more += f"external_id = {EXTERNAL_ID}\nduration_seconds = {DURATION}\n"
        fields.update(ExternalId=EXTERNAL_ID, DurationSeconds=DURATION)
    env = assume_role_env(seaweed, tmp_path, signed_sts_proxy.url, keys_in=keys_in, more=more)
    assert_loads(ckpt, ckpt.url, env)
    reqs = signed_sts_proxy.requests
    assert len(reqs) == 2, reqs  # one per process: the session is kept while it is valid
    for req in reqs:
        assert_signed_assume_role(req, seaweed.ADMIN_KEY[0], seaweed.REGION, fields)


def test_a_role_assumed_with_the_environments_keys(seaweed, ckpt, signed_sts_proxy, tmp_path):
    env = environment_source_env(seaweed, tmp_path, signed_sts_proxy.url)
    assert_loads(ckpt, ckpt.url, env, profile="assumer")
    reqs = signed_sts_proxy.requests
    assert len(reqs) == 2, reqs
    for req in reqs:
        assert_signed_assume_role(req, seaweed.ADMIN_KEY[0], seaweed.REGION, {
            "RoleArn": seaweed.ASSUMED_ROLE_ARN, "RoleSessionName": ASSUMER_SESSION})
    # Named by AWS_PROFILE instead, the profile comes after the environment's keys (as in
    # botocore): they are used as they are, and STS is never asked.
    signed_sts_proxy.reset()
    assert_loads(ckpt, ckpt.url, dict(env, AWS_PROFILE="assumer"))
    assert signed_sts_proxy.count == 0


def test_a_role_the_source_keys_may_not_assume_names_sts_and_its_answer(seaweed, ckpt,
                                                                         tmp_path):
    # OTHER's keys are valid, but the role does not trust OTHER. STS: AWS_ENDPOINT_URL's.
    env = assume_role_env(seaweed, tmp_path, source_keys=seaweed.OTHER_KEY)
    for msg in failed_loads(ckpt.url, env):
        assert "AssumeRole" in msg and "AccessDenied" in msg and "403" in msg, msg
        assert seaweed.endpoint in msg, msg  # where the credentials were asked for
        assert seaweed.OTHER_KEY[1] not in msg, msg


def test_an_assumed_role_that_needs_an_mfa_code_is_refused_before_sts(seaweed, ckpt,
                                                                      signed_sts_proxy, tmp_path):
    env = assume_role_env(seaweed, tmp_path, signed_sts_proxy.url,
                          more="mfa_serial = arn:aws:iam::000000000000:mfa/admin\n")
    for msg in unsupported_loads(ckpt.url, env):
        assert "mfa_serial" in msg, msg
        assert seaweed.ADMIN_KEY[1] not in msg, msg
    assert signed_sts_proxy.count == 0


@pytest.mark.parametrize("source", ["chain", "process"])
def test_a_source_profile_without_static_keys_is_refused_before_sts(seaweed, ckpt,
                                                                    signed_sts_proxy, tmp_path,
                                                                    source):
    """source_profile = middle, where middle assumes a role itself (a chain of roles) or gets
    its keys from a credential_process: unsupported, STS never asked, the process never run."""
    script = credential_process_script(tmp_path, f'echo run >> "{tmp_path}/process-runs"\n'
                                                 "exit 1\n")
    middle = (f"role_arn = {seaweed.ASSUMED_ROLE_ARN}\nsource_profile = base\n"
              if source == "chain" else f"credential_process = {script}\n")
    env = assume_role_env(seaweed, tmp_path, signed_sts_proxy.url, keys_in="config")
    config = (tmp_path / "aws-config").read_text().replace("source_profile = base\n",
                                                            "source_profile = middle\n", 1)
    (tmp_path / "aws-config").write_text(config + "\n[profile middle]\n" + middle)
    for msg in unsupported_loads(ckpt.url, env):
        assert "middle" in msg and "source_profile" in msg, msg
        assert seaweed.ADMIN_KEY[1] not in msg, msg
    assert signed_sts_proxy.count == 0
    assert not (tmp_path / "process-runs").exists()


# -- tensorferry doctor URL ------------------------------------------------------------------------
def run_doctor(url, env):
    r = subprocess.run([CLI, "doctor", "--quick", "--json", url], capture_output=True, text=True,
                       timeout=120, env=child_env(env))
    assert r.returncode == 0, r.stdout + r.stderr  # the report is the result
    return json.loads(r.stdout)["object_store"], r.stdout


def test_doctor_reports_fetched_keys_without_showing_them(seaweed, ckpt, issuer, sts_proxy,
                                                           tmp_path):
    token = issuer.token()
    env = web_identity_env(seaweed, tmp_path, token, sts_proxy.url)
    report, text = run_doctor(ckpt.url, env)
    assert report["settings"]["ok"] and report["store"] == "s3"
    assert report["endpoint"] == seaweed.endpoint and report["endpoint_from"] == "AWS_ENDPOINT_URL"
    assert report["credentials_from"].startswith("web identity (AWS_WEB_IDENTITY_TOKEN_FILE, role ")
    assert report["credentials_from"].endswith("via STS " + sts_proxy.url)
    assert report["credentials_status"]["ok"], report
    assert re.fullmatch(r"key \*\*\*\*\w{4} with a session token", report["credentials"]), report
    assert report["probe_status"]["ok"], report
    assert report["probe"].startswith(f"object of {os.path.getsize(ckpt.local)} bytes, ETag "), \
        report
    assert len(sts_proxy.requests) == 1
    assert token not in text
    # A refused identity token: the fetch's error, and no request to the store.
    env = web_identity_env(seaweed, tmp_path, issuer.token(forged=True), sts_proxy.url)
    report, text = run_doctor(ckpt.url, env)
    assert not report["credentials_status"]["ok"]
    assert "AssumeRoleWithWebIdentity" in report["credentials_status"]["message"]
    assert report["probe"] == "" and report["probe_seconds"] == 0


def test_doctor_reports_the_keys_of_an_assumed_role_without_showing_them(seaweed, ckpt,
                                                                         signed_sts_proxy,
                                                                         tmp_path):
    env = assume_role_env(seaweed, tmp_path, signed_sts_proxy.url,
                          more=f"role_session_name = {ASSUMER_SESSION}\n")
    report, text = run_doctor(ckpt.url, env)
    assert report["settings"]["ok"] and report["store"] == "s3"
    assert seaweed.ASSUMED_ROLE_ARN in report["credentials_from"], report
    assert report["credentials_status"]["ok"], report
    assert re.fullmatch(r"key \*\*\*\*\w{4} with a session token", report["credentials"]), report
    assert report["probe_status"]["ok"], report
    assert report["probe"].startswith(f"object of {os.path.getsize(ckpt.local)} bytes, ETag "), \
        report
    (req,) = signed_sts_proxy.requests
    assert_signed_assume_role(req, seaweed.ADMIN_KEY[0], seaweed.REGION, {
        "RoleArn": seaweed.ASSUMED_ROLE_ARN, "RoleSessionName": ASSUMER_SESSION})
    assert seaweed.ADMIN_KEY[1] not in text

"""gs:// checkpoints (Google Cloud Storage through its S3-compatible XML API), against real servers
on loopback. Google's own endpoints cannot be reached from here, so each part of the path is played
by the closest real thing:

* the bucket: SeaweedFS (conftest's `seaweed`), named as gs://BUCKET/KEY with the `s3_endpoint`
  option pointing at it. With HMAC keys the requests carry AWS Signature V4, which SeaweedFS
  checks as GCS does (with its own region: s3_region; GCS's default "auto" is not accepted there).
* OAuth 2: the fault proxy's bearer gate in front of SeaweedFS's public bucket accepts exactly the
  tokens a token server of this file issued and have not been revoked (401 otherwise).
* the token server (OAuthServer below) implements the three token endpoints tensorferry uses:
  the refresh-token grant (gcloud's authorized_user credentials), the JWT-bearer grant (service
  account keys: the RS256 signature is checked with the openssl CLI against the key's public
  half, and the claims are checked) and the metadata server's token URL (GKE / Compute Engine,
  Metadata-Flavor: Google required).

Every load is compared byte for byte with the local copy."""
import base64
import json
import os
import subprocess
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import CLI, raw_bytes

import tensorferry.torch
from tensorferry import safe_open

PREFIX = "gcs-tests"
GOOGLE_VARS = ("GOOGLE_OAUTH_ACCESS_TOKEN", "GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG",
               "GCE_METADATA_HOST")


@pytest.fixture(autouse=True)
def _no_ambient_google(monkeypatch, tmp_path):
    """No Google variable of the caller and no gcloud files: each test says what it uses."""
    for name in GOOGLE_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))


def _b64url_decode(text):
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class OAuthServer:
    """Google's token endpoints on loopback: POST /token (refresh_token and jwt-bearer grants)
    and GET /computeMetadata/v1/instance/service-accounts/default/token. Issued tokens are
    "ya29.test-N"; valid(token) says whether one was issued and not revoked."""

    CLIENT = ("tf-client.apps.googleusercontent.com", "tf-client-secret")
    REFRESH_TOKEN = "1//tf-refresh-token"
    EMAIL = "loader@tf-project.iam.gserviceaccount.com"

    def __init__(self, workdir, expires_in=3600):
        self.workdir = workdir
        self.expires_in = expires_in
        self.lock = threading.Lock()
        self.issued, self.revoked = [], set()
        self.failing = False  # the metadata server answers 500 (an outage) while set
        self.grants = []  # (kind, ok) per token request
        key = os.path.join(workdir, "sa-key.pem")
        subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt",
                        "rsa_keygen_bits:2048", "-out", key], check=True, capture_output=True)
        subprocess.run(["openssl", "pkey", "-in", key, "-pubout", "-out", key + ".pub"],
                       check=True, capture_output=True)
        with open(key) as f:
            self.private_key = f.read()
        self.public_key = key + ".pub"
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status, doc):
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                path = "/computeMetadata/v1/instance/service-accounts/default/token"
                if self.path != path:
                    return self._answer(404, {"error": "not_found"})
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._answer(403, {"error": "Missing Metadata-Flavor:Google header"})
                if server.failing:
                    with server.lock:
                        server.grants.append(("metadata", False))
                    return self._answer(500, {"error": "internal", "error_description": "down"})
                self._answer(200, server.issue("metadata"))

            def do_POST(self):
                n = int(self.headers.get("Content-Length", "0"))
                form = urllib.parse.parse_qs(self.rfile.read(n).decode(), strict_parsing=True)
                form = {k: v[0] for k, v in form.items()}
                status, doc = server.grant(form, f"http://127.0.0.1:{self.server.server_port}"
                                           f"{self.path}")
                self._answer(status, doc)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_port
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def token_uri(self):
        return f"http://127.0.0.1:{self.port}/token"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def issue(self, kind):
        with self.lock:
            token = f"ya29.test-{len(self.issued) + 1}"
            self.issued.append(token)
            self.grants.append((kind, True))
        return {"access_token": token, "expires_in": self.expires_in, "token_type": "Bearer"}

    def refuse(self, kind, description):
        with self.lock:
            self.grants.append((kind, False))
        return 400, {"error": "invalid_grant", "error_description": description}

    def grant(self, form, url):
        kind = form.get("grant_type")
        if kind == "refresh_token":
            if (form.get("client_id"), form.get("client_secret")) != self.CLIENT or \
                    form.get("refresh_token") != self.REFRESH_TOKEN:
                return self.refuse(kind, "Token has been expired or revoked.")
            return 200, self.issue(kind)
        if kind == "urn:ietf:params:oauth:grant-type:jwt-bearer":
            problem = self.check_jwt(form.get("assertion", ""), url)
            if problem:
                return self.refuse(kind, problem)
            return 200, self.issue(kind)
        return self.refuse(kind, f"unsupported grant_type {kind!r}")

    def check_jwt(self, jwt, url):
        """What is wrong with a service account's assertion, or None."""
        parts = jwt.split(".")
        if len(parts) != 3:
            return "not a JWT"
        header = json.loads(_b64url_decode(parts[0]))
        claims = json.loads(_b64url_decode(parts[1]))
        if header != {"alg": "RS256", "typ": "JWT", "kid": "tf-key-1"}:
            return f"header {header}"
        now = time.time()
        if claims.get("iss") != self.EMAIL or claims.get("aud") != url or \
                claims.get("scope") != "https://www.googleapis.com/auth/devstorage.read_only" or \
                claims["exp"] - claims["iat"] != 3600 or abs(claims["iat"] - now) > 60:
            return f"claims {claims}"
        with tempfile.NamedTemporaryFile(dir=self.workdir) as sig, \
                tempfile.NamedTemporaryFile(dir=self.workdir) as data:
            sig.write(_b64url_decode(parts[2]))
            sig.flush()
            data.write(f"{parts[0]}.{parts[1]}".encode())
            data.flush()
            check = subprocess.run(["openssl", "dgst", "-sha256", "-verify", self.public_key,
                                    "-signature", sig.name, data.name], capture_output=True)
        return None if check.returncode == 0 else "Invalid JWT Signature."

    def valid(self, token):
        with self.lock:
            return token in self.issued and token not in self.revoked

    def revoke_all(self):
        with self.lock:
            self.revoked.update(self.issued)

    def write_authorized_user(self, path, refresh_token=None):
        doc = {"type": "authorized_user", "client_id": self.CLIENT[0],
               "client_secret": self.CLIENT[1],
               "refresh_token": refresh_token or self.REFRESH_TOKEN,
               "token_uri": self.token_uri, "universe_domain": "googleapis.com"}
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    def write_service_account(self, path):
        doc = {"type": "service_account", "project_id": "tf-project",
               "private_key_id": "tf-key-1", "private_key": self.private_key,
               "client_email": self.EMAIL, "client_id": "1234",
               "token_uri": self.token_uri}
        with open(path, "w") as f:
            json.dump(doc, f)
        return path


@pytest.fixture
def oauth(tmp_path):
    server = OAuthServer(str(tmp_path))
    yield server
    server.close()


@pytest.fixture(scope="module")
def uploaded(seaweed, tiny_checkpoint):
    """The tiny sharded checkpoint in the private and the public bucket, under PREFIX/tiny."""
    seaweed.upload_dir(seaweed.BUCKET, f"{PREFIX}/tiny", tiny_checkpoint)
    seaweed.upload_dir(seaweed.PUBLIC_BUCKET, f"{PREFIX}/tiny", tiny_checkpoint)
    return tiny_checkpoint


@pytest.fixture
def gate(seaweed, oauth):
    """The bearer gate in front of SeaweedFS: only the oauth server's live tokens pass."""
    from fault_proxy import FaultProxy
    host, port = seaweed.endpoint[len("http://"):].rsplit(":", 1)
    with FaultProxy(host, int(port), bearer=oauth.valid) as proxy:
        yield proxy


def load(url, **options):
    """Every tensor of the checkpoint at `url` (a prefix, index or file), through a Loader."""
    with tensorferry.Loader(url, storage_options=options or None) as loader:
        return loader.load()


def local_tensors(folder):
    with tensorferry.Loader(folder) as loader:
        return loader.load()


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and tuple(got[name].shape) == tuple(w.shape), name
        assert raw_bytes(got[name]) == raw_bytes(w), name


def public_url(seaweed, rel="tiny"):
    return f"gs://{seaweed.PUBLIC_BUCKET}/{PREFIX}/{rel}"


@pytest.mark.parametrize("form", ["prefix", "index", "listing"])
def test_hmac_keys_read_a_sharded_checkpoint(seaweed, uploaded, form):
    """HMAC keys: Signature V4, path-style, as GCS's XML API takes them; a
    prefix finds its index, an index names its shards, and a prefix without index is listed
    (ListObjectsV2)."""
    rel = {"prefix": "tiny", "index": "tiny/model.safetensors.index.json", "listing": "tiny"}[form]
    if form == "listing":
        rel = "tiny-noindex"
        for shard in sorted(f for f in os.listdir(uploaded) if f.endswith(".safetensors")):
            seaweed.upload(seaweed.BUCKET, f"{PREFIX}/tiny-noindex/{shard}",
                           os.path.join(uploaded, shard))
    opts = {"s3_endpoint": seaweed.endpoint, "s3_access_key_id": seaweed.ADMIN_KEY[0],
            "s3_secret_access_key": seaweed.ADMIN_KEY[1],
            "s3_region": seaweed.REGION}  # SeaweedFS checks its own region; GCS takes "auto"
    url = f"gs://{seaweed.BUCKET}/{PREFIX}/{rel}"
    assert_same(load(url, **opts), local_tensors(uploaded))
    # The wrong secret: the store's own error, naming where the credentials came from.
    opts["s3_secret_access_key"] = "wrong"
    with pytest.raises(OSError) as e:
        load(url, **opts)
    message = str(e.value)
    assert "SignatureDoesNotMatch" in message and "credentials: options (HMAC key)" in message, \
        message
    assert "wrong" not in message.replace("wrong secret", "")


def test_aws_settings_do_not_apply_to_gs_urls(seaweed, uploaded, monkeypatch):
    """AWS_* keys and endpoints are for s3:// only: a gs:// URL in a public bucket is read
    anonymously (SeaweedFS would refuse the AWS keys below)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    got = load(public_url(seaweed), s3_endpoint=seaweed.endpoint)
    assert_same(got, local_tensors(uploaded))
    # Without an endpoint option, the default is Google's.
    with pytest.raises(OSError) as e:
        load(public_url(seaweed), object_retries=0, object_timeout_ms=2000)
    assert "storage.googleapis.com" in str(e.value)


def test_a_given_token(gate, oauth, seaweed, uploaded, monkeypatch):
    token = oauth.issue("given")["access_token"]
    opts = {"s3_endpoint": gate.url, "gcs_token": token}
    assert_same(load(public_url(seaweed), **opts), local_tensors(uploaded))
    assert gate.stats()["unauthorized"] == 0 and gate.stats()["forwarded"] > 0
    # From the environment, through safe_open.
    monkeypatch.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", token)
    shard = sorted(f for f in os.listdir(uploaded) if f.endswith(".safetensors"))[0]
    url = public_url(seaweed, f"tiny/{shard}")
    with safe_open(url, framework="pt", storage_options={"s3_endpoint": gate.url}) as f, \
            safe_open(os.path.join(uploaded, shard), framework="pt") as local:
        assert list(f.keys()) == list(local.keys())
        for name in local.keys():
            assert raw_bytes(f.get_tensor(name)) == raw_bytes(local.get_tensor(name)), name
    # A token the store refuses: one attempt (a given token cannot be replaced), a clear error.
    oauth.revoke_all()
    gate.reset_stats()
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
        load(public_url(seaweed), **opts)
    message = str(e.value)
    assert "HTTP 401 AuthenticationRequired" in message, message
    assert "credentials: options (token)" in message, message
    assert token not in message
    assert gate.stats()["unauthorized"] == 1 and time.monotonic() - t0 < 5


def test_authorized_user_credentials(gate, oauth, seaweed, uploaded, monkeypatch, tmp_path):
    """gcloud's application_default_credentials.json (found through CLOUDSDK_CONFIG): its refresh
    token is exchanged once for an access token that every request carries."""
    gcloud = tmp_path / "gcloud"
    gcloud.mkdir()
    oauth.write_authorized_user(str(gcloud / "application_default_credentials.json"))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(gcloud))
    got = load(public_url(seaweed), s3_endpoint=gate.url)
    assert_same(got, local_tensors(uploaded))
    assert oauth.grants == [("refresh_token", True)]
    assert gate.stats()["unauthorized"] == 0


def test_service_account_key(gate, oauth, seaweed, uploaded, monkeypatch, tmp_path):
    """GOOGLE_APPLICATION_CREDENTIALS naming a service account key: an RS256-signed JWT (checked
    by the token server with openssl) is exchanged for the token. The CLI reads the same way."""
    key_file = oauth.write_service_account(str(tmp_path / "sa.json"))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", key_file)
    got = load(public_url(seaweed), s3_endpoint=gate.url)
    assert_same(got, local_tensors(uploaded))
    assert oauth.grants == [("urn:ietf:params:oauth:grant-type:jwt-bearer", True)]
    out = subprocess.run([CLI, "load", public_url(seaweed), "--s3-endpoint", gate.url, "--json"],
                         capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    total = sum(os.path.getsize(os.path.join(uploaded, f)) for f in os.listdir(uploaded)
                if f.endswith(".safetensors"))
    assert report["bytes"] <= total and report["tensors"] == len(local_tensors(uploaded))
    assert len(oauth.grants) == 2 and all(ok for _, ok in oauth.grants)


def test_metadata_server(gate, oauth, seaweed, uploaded, monkeypatch):
    """GKE / Compute Engine: the token comes from the metadata server (GCE_METADATA_HOST)."""
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{oauth.port}")
    got = load(public_url(seaweed), s3_endpoint=gate.url)
    assert_same(got, local_tensors(uploaded))
    assert oauth.grants == [("metadata", True)]


def test_a_failed_early_refresh_keeps_the_token_that_is_still_good(gate, oauth, seaweed,
                                                                     uploaded, monkeypatch):
    """Tokens are refreshed before they expire (here: 12 s tokens, refreshed from 6 s, good
    until 9 s); a metadata server that fails then costs nothing while the token in hand is still
    good."""
    import time
    oauth.expires_in = 12
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{oauth.port}")
    before_grant = time.monotonic()
    assert_same(load(public_url(seaweed), s3_endpoint=gate.url), local_tensors(uploaded))
    oauth.failing = True
    # Past the refresh point, timed from before the grant (not from the end of a slow load):
    # the second load has until 9 s after the grant, 2.5 s or more.
    time.sleep(max(0.0, before_grant + 6.5 - time.monotonic()))
    assert_same(load(public_url(seaweed), s3_endpoint=gate.url), local_tensors(uploaded))
    assert oauth.grants[0] == ("metadata", True) and ("metadata", False) in oauth.grants


def test_a_refused_token_is_replaced_mid_load(gate, oauth, seaweed, uploaded, monkeypatch):
    """The store refuses a fetched token part-way through a load (revoked, or expired early): the
    next attempt fetches a new one and the load completes byte-exact."""
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{oauth.port}")
    gate.overwrite_after(2, oauth.revoke_all)  # after the second response, every token so far dies
    got = load(public_url(seaweed), s3_endpoint=gate.url, object_concurrency=1)
    assert_same(got, local_tensors(uploaded))
    assert [g for g in oauth.grants] == [("metadata", True), ("metadata", True)]
    assert gate.stats()["unauthorized"] >= 1


def test_token_errors_name_the_credentials_and_the_server_answer(oauth, seaweed, uploaded,
                                                                  monkeypatch, tmp_path):
    path = oauth.write_authorized_user(str(tmp_path / "adc.json"), refresh_token="1//revoked")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", path)
    with pytest.raises(OSError) as e:
        load(public_url(seaweed), s3_endpoint=seaweed.endpoint)
    message = str(e.value)
    assert f"authorized_user {path} (GOOGLE_APPLICATION_CREDENTIALS)" in message, message
    assert f"token request to {oauth.token_uri}" in message, message
    assert "HTTP 400 invalid_grant: Token has been expired or revoked." in message, message
    assert "1//revoked" not in message and OAuthServer.CLIENT[1] not in message
    assert len(oauth.grants) == 1  # a refusal is not retried
    # A credentials file that is not there.
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError) as e:
        load(public_url(seaweed), s3_endpoint=seaweed.endpoint)
    assert "missing.json, which does not exist" in str(e.value)
    # No metadata server listening.
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS")
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    with pytest.raises(OSError) as e:
        load(public_url(seaweed), s3_endpoint=seaweed.endpoint)
    assert "metadata server 127.0.0.1:9 (GCE_METADATA_HOST)" in str(e.value)
    assert "no response" in str(e.value)


def test_from_pretrained_of_a_gs_url(gate, oauth, seaweed, monkeypatch, tmp_path):
    """transformers' from_pretrained names the model by its gs:// URL inside
    tensorferry.transformers.loading(): configuration, generation config and the sharded weights
    come from the bucket with a metadata-server token; parameters equal the local model's."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import tensorferry.transformers as tft
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "m",
                                                                max_shard_size="60KB")
    seaweed.upload_dir(seaweed.PUBLIC_BUCKET, f"{PREFIX}/llama", str(tmp_path / "m"))
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{oauth.port}")
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    with tft.loading(storage_options={"s3_endpoint": gate.url}):
        got = AutoModelForCausalLM.from_pretrained(public_url(seaweed, "llama"),
                                                   dtype=torch.bfloat16)
    a, b = want.state_dict(), got.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert got.config.num_hidden_layers == 2
    # One token for every file the model's load read (config, index, shards): one per process.
    assert gate.stats()["unauthorized"] == 0 and oauth.grants == [("metadata", True)]

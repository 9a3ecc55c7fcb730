"""A model hub on loopback, shaped like the Hugging Face Hub's file endpoints, for the tests and the
benchmark of loading straight from an HTTP model hub.

Two servers, as the real hub has:
  - the hub (a Python HTTP server here): `GET|HEAD /<org>/<name>/resolve/<revision>/<path>`.
    Small files (JSON, tokenizer files) are answered with a relative redirect to the hub's own
    cache of them (`/api/resolve-cache/models/...`, the same origin, as huggingface.co does),
    which serves them (200, or 206 for a Range; gated as the repo is).
    Large files (`*.safetensors`, like the hub's LFS/Xet files) are answered with a 302 to a
    signed, expiring link on the CDN, with the hub's headers (`X-Repo-Commit`, `X-Linked-Etag`,
    `X-Linked-Size`, `ETag`), so that huggingface_hub's own `hf_hub_download` accepts it. A
    missing file is a 404 with `X-Error-Code: EntryNotFound`, and a gated repo's files a 401
    (`GatedRepo`) without its token (add_repo's `token`). Every request to a path is counted
    (`resolves`), and each may be delayed (`delay_s`: a resolver far away, or busy).
  - the CDN (nginx, objstore_servers.NginxHttp): blobs named by their SHA-256 under /blobs/,
    range requests and ETags as for every nginx test, links checked by nginx's secure_link
    module: an expired or forged link is a 403, as S3 presigned and CloudFront links are, and a
    request that also carries an Authorization header is a 400, as S3 refuses two authorizations.
    `link_ttl_s` sets how long the hub's links live; `cdn_rate` limits each CDN response's rate
    (nginx limit_rate), to make a load outlast its links.

Repositories have commits and branches: each `add_repo` publishes a new commit of the repo and
points a branch (`revision`, default main) at it; `/resolve/<revision>/` takes a branch or a commit
(`%2F` for a '/' in a branch name), and the hub's API answers
`GET /api/models/<repo>/revision/<revision>` with the commit a branch points to now (`"sha"`, as
huggingface_hub's model_info reads it; 401 RepositoryNotFound for a repository it does not have, 404
RevisionNotFound for a revision), `GET /api/models/<repo>` the same for its default branch (what
huggingface_hub's resolve_revision asks for revision=None), and
`GET /api/models/<repo>/tree/<revision>` with its files (as
snapshot_download lists them). `on_api`, when set, is called after each API answer (a branch
moved while a load runs). `log` lists every request as (kind, repo, revision, path), `connections`
counts the connections the hub accepted.

`repo_url(repo)` is the prefix `http://127.0.0.1:<port>/<repo>/resolve/main` that tensorferry
loads (it holds model.safetensors.index.json, or model.safetensors); `endpoint` is what
huggingface_hub's HF_ENDPOINT takes.
"""
import base64
import hashlib
import http.server
import json
import os
import shutil
import threading
import time
import urllib.parse

from objstore_servers import LOOPBACK, NginxHttp

_SECRET = "tensorferry-test-hub"


def git_blob_id(data):
    """git's id of a file's bytes (sha1 of "blob <size>\\0" + bytes): the hub's ETag and tree oid
    of a file stored in git, which huggingface_hub names the file's blob by and checks it with."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class ModelHub:
    def __init__(self, link_ttl_s=3600, cdn_rate=None, delay_s=0.0):
        self.link_ttl_s = link_ttl_s
        self.delay_s = delay_s
        self.commit = None  # the commit the last add_repo published
        self._files = {}  # (repo, commit, path) -> ("small", bytes, etag) | ("blob", sha256, size)
        self._refs = {}  # (repo, branch) -> commit
        self._tokens = {}  # gated repo -> its token
        self._lock = threading.Lock()
        self.resolves = {}  # "<repo>/<path>" -> requests to the hub for it
        self.log = []  # (kind "api"|"resolve", repo, revision, path) of every request
        self.connections = 0  # connections the hub (not its CDN) accepted
        self.on_api = None
        rate = f"limit_rate {cdn_rate}; sendfile_max_chunk 64k;" if cdn_rate else ""
        # secure_link: md5 (base64url) of "<expires><uri> <secret>"; "" = forged, "0" = expired.
        self.cdn = NginxHttp(extra_conf=f"""
        location /blobs/ {{
            secure_link $arg_md5,$arg_expires;
            secure_link_md5 "$secure_link_expires$uri {_SECRET}";
            if ($secure_link = "") {{ return 403; }}
            if ($secure_link = "0") {{ return 403; }}
            if ($http_authorization) {{ return 400; }}
            {rate}
        }}""")
        self._http = None
        self.cdn_base = None  # where links point instead of the CDN (a TLS front of it)

    # --- content ---------------------------------------------------------------------------

    def add_repo(self, repo, local_dir, token=None, revision="main"):
        """Publishes every file under local_dir as a new commit of <repo>, and points branch
        `revision` at it; returns the commit. With `token`, the repo is gated: its files are a 401
        unless a request carries "Authorization: Bearer <token>" (the CDN's links need none; the
        API answers without it, as the hub's does for gated models)."""
        if token:
            self._tokens[repo] = token
        with self._lock:
            commit = hashlib.sha1(f"{repo}@{revision}#{len(self._files)}".encode()).hexdigest()
        for dirpath, _, files in os.walk(local_dir):
            for name in sorted(files):
                src = os.path.join(dirpath, name)
                rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
                self.add_file(repo, rel, src, commit)
        with self._lock:
            self._refs[(repo, revision)] = commit
            self.commit = commit
        return commit

    def _commit(self, repo, revision):
        """The commit `revision` (a branch, or a commit of `repo`) names; None if none."""
        with self._lock:
            if (repo, revision) in self._refs:
                return self._refs[(repo, revision)]
            known = any(r == repo and c == revision for r, c, _ in self._files)
            return revision if known else None

    def add_file(self, repo, rel, src, commit):
        with open(src, "rb") as f:
            data = f.read()
        if rel.endswith(".safetensors"):
            sha = hashlib.sha256(data).hexdigest()
            blob = os.path.join(self.cdn.root, "blobs", sha)
            if not os.path.exists(blob):
                os.makedirs(os.path.dirname(blob), exist_ok=True)
                shutil.copyfile(src, blob)
            self._files[(repo, commit, rel)] = ("blob", sha, len(data))
        else:
            etag = '"' + git_blob_id(data) + '"'  # the hub's ETag of a git-stored file
            self._files[(repo, commit, rel)] = ("small", data, etag)

    def repo_url(self, repo, path=""):
        url = f"{self.endpoint}/{repo}/resolve/main"
        return url + ("/" + path if path else "")

    @property
    def endpoint(self):
        return f"http://{LOOPBACK}:{self._http.server_address[1]}"

    def resolve_count(self, repo, path):
        with self._lock:
            return self.resolves.get(f"{repo}/{path}", 0)

    def reset_counts(self):
        with self._lock:
            self.resolves.clear()
            self.log.clear()
            self.connections = 0

    def api_count(self):
        with self._lock:
            return sum(1 for x in self.log if x[0] == "api")

    def link(self, sha):
        """A signed CDN link to blob `sha`, valid for link_ttl_s from now."""
        uri = f"/blobs/{sha}"
        expires = int(time.time()) + int(self.link_ttl_s)
        digest = hashlib.md5(f"{expires}{uri} {_SECRET}".encode()).digest()
        md5 = base64.urlsafe_b64encode(digest).decode().rstrip("=")
        base = self.cdn_base or self.cdn.url("").rstrip("/")
        return f"{base}{uri}?md5={md5}&expires={expires}"

    # --- servers ---------------------------------------------------------------------------

    def start(self):
        self.cdn.start()
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._answer(head=True)

            def do_GET(self):
                self._answer(head=False)

            def _answer(self, head):
                path = urllib.parse.urlsplit(self.path).path
                parts = path.lstrip("/").split("/")
                if parts[:3] == ["api", "resolve-cache", "models"]:
                    # /api/resolve-cache/models/<repo>/<commit>/<path>: small files.
                    at = next((i for i in range(4, len(parts) - 1) if len(parts[i]) == 40), None)
                    if at is None:
                        return self._error(404, "EntryNotFound", "no such route")
                    repo, commit, rel = "/".join(parts[3:at]), parts[at], "/".join(parts[at + 1:])
                    entry = hub._files.get((repo, commit, rel))
                    if entry is None or entry[0] != "small":
                        return self._error(404, "EntryNotFound", f"{rel} not found in {repo}")
                    if not self._authorized(repo):
                        return self._error(401, "GatedRepo", f"access to {repo} is restricted")
                    return self._small(entry, head, commit)
                if parts[:2] == ["api", "models"] and "tree" in parts[3:5]:
                    # /api/models/<repo>/tree/<revision>: the files (snapshot_download lists).
                    at = parts.index("tree", 3)
                    repo = "/".join(parts[2:at])
                    revision = urllib.parse.unquote("/".join(parts[at + 1:]))
                    return self._tree(repo, revision, head)
                if parts[:2] == ["api", "models"] and len(parts) in (3, 4) and parts[-1]:
                    # /api/models/<repo>: the repository's information, its default branch's
                    # commit as "sha" (huggingface_hub's repo_info, resolve_revision(None)).
                    return self._api("/".join(parts[2:]), "main", head)
                if parts[:2] == ["api", "models"] and "revision" in parts[3:5]:
                    # /api/models/<repo>/revision/<revision>: the commit a branch points to.
                    at = parts.index("revision", 3)
                    repo = "/".join(parts[2:at])
                    revision = urllib.parse.unquote("/".join(parts[at + 1:]))
                    return self._api(repo, revision, head)
                # <repo>/resolve/<revision>/<path...>, repo "org/name" or "name"
                at = next((i for i in (1, 2) if len(parts) > i + 2 and parts[i] == "resolve"),
                          None)
                if at is None:
                    return self._error(404, "EntryNotFound", "no such route")
                repo, rel = "/".join(parts[:at]), "/".join(parts[at + 2:])
                revision = urllib.parse.unquote(parts[at + 1])
                with hub._lock:
                    key = f"{repo}/{rel}"
                    hub.resolves[key] = hub.resolves.get(key, 0) + 1
                    hub.log.append(("resolve", repo, revision, rel))
                if hub.delay_s:
                    time.sleep(hub.delay_s)
                if not any(r == repo for r, _ in hub._refs):
                    return self._error(401, "RepositoryNotFound", "Repository not found")
                if not self._authorized(repo):
                    return self._error(401, "GatedRepo", f"access to {repo} is restricted")
                commit = hub._commit(repo, revision)
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                entry = hub._files.get((repo, commit, rel))
                if entry is None:
                    return self._error(404, "EntryNotFound", f"{rel} not found in {repo}")
                if entry[0] == "blob":
                    _, sha, size = entry
                    self.send_response(302)
                    self.send_header("Location", hub.link(sha))
                    self.send_header("ETag", f'"{sha}"')
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(size))
                    self.send_header("X-Repo-Commit", commit)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                # Small files: a relative redirect to the hub's own cache of them, on the same
                # origin (as huggingface.co answers since 2025).
                _, data, etag = entry
                self.send_response(307)
                self.send_header("Location", f"/api/resolve-cache/models/{repo}/{commit}/"
                                             f"{rel}?etag={urllib.parse.quote(etag)}")
                self.send_header("ETag", etag)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None

            def _tree(self, repo, revision, head):
                commit = hub._commit(repo, revision)
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                items = []
                for (r, c, rel), entry in sorted(hub._files.items()):
                    if r != repo or c != commit:
                        continue
                    if entry[0] == "blob":
                        _, sha, size = entry
                        pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\n"
                                   f"size {size}\n").encode()
                        items.append({"type": "file", "path": rel, "size": size,
                                      "oid": git_blob_id(pointer),
                                      "lfs": {"oid": sha, "size": size,
                                              "pointerSize": len(pointer)}})
                    else:
                        _, data, etag = entry
                        items.append({"type": "file", "path": rel, "size": len(data),
                                      "oid": etag.strip('"')})
                return self._json(items, head)

            def _json(self, value, head):
                return self._send(200, {"Content-Type": "application/json"},
                                  json.dumps(value).encode(), head)

            def _send(self, status, headers, body, head):
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)
                return None

            def _api(self, repo, revision, head):
                with hub._lock:
                    hub.log.append(("api", repo, revision, ""))
                if not any(r == repo for r, _ in hub._refs):
                    return self._error(401, "RepositoryNotFound", "Repository not found")
                commit = hub._commit(repo, revision)
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                siblings = sorted(rel for r, c, rel in hub._files if r == repo and c == commit)
                info = {"id": repo, "sha": commit, "private": False,
                        "gated": "manual" if repo in hub._tokens else False,
                        "siblings": [{"rfilename": f} for f in siblings]}
                if hub.on_api is not None:
                    hub.on_api()  # before the answer: the branch has moved when it arrives
                return self._json(info, head)

            def _authorized(self, repo):
                want = hub._tokens.get(repo)
                return not want or self.headers.get("Authorization") == f"Bearer {want}"

            def _small(self, entry, head, commit):
                _, data, etag = entry
                first, last, status = 0, len(data) - 1, 200
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes=") and data:
                    a, _, b = rng[6:].partition("-")
                    first = int(a)
                    last = min(int(b), len(data) - 1) if b else len(data) - 1
                    if first >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return None
                    status = 206
                headers = {"ETag": etag, "X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
                if status == 206:
                    headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
                return self._send(status, headers, data[first:last + 1], head)

            def _error(self, status, code, message):
                body = message.encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

        class Server(http.server.ThreadingHTTPServer):
            def process_request(self, request, client_address):
                with hub._lock:
                    hub.connections += 1
                return super().process_request(request, client_address)

        self._http = Server((LOOPBACK, 0), Handler)
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def stop(self):
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.cdn.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

"""A local fake model hub speaking the parts of the Hugging Face HTTP API that huggingface-hub calls.

Serves model listings (/api/models), repo info with file sizes (/api/models/<repo>[/revision/<rev>]) and
files (/<repo>/resolve/<rev>/<file>) with HEAD, ETag, X-Repo-Commit and byte ranges. Faults are injected
per file: `truncate[name] = n` sends the headers of the whole file but only its first n bytes, then hangs up
(on every GET, or on the next `truncate_times[name]` GETs only).
Every request is recorded (method, path, Range header) for assertions. Loopback only.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import attrs


@attrs.define
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    sha: str = attrs.field(default="")
    listed_sizes: dict[str, int] = attrs.Factory(dict)  # sizes to report instead (header-only weight files)
    downloads: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.sha:
            digest = hashlib.sha1(self.repo_id.encode() + b"".join(sorted(self.files.values()))).hexdigest()
            self.sha = digest


@attrs.define
class FakeHub:
    repos: dict[str, FakeRepo] = attrs.Factory(dict)
    truncate: dict[str, int] = attrs.Factory(dict)
    truncate_times: dict[str, int] = attrs.Factory(dict)
    requests: list[tuple[str, str, str]] = attrs.Factory(list)
    url: str = ""

    def add(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.repo_id] = repo
        return repo


_INFO = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?/?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _json(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            url = urlparse(self.path)
            path = unquote(url.path)
            hub.requests.append((self.command, path, self.headers.get("Range", "")))
            if path == "/api/models":
                q = (parse_qs(url.query).get("search") or [""])[0].lower()
                limit = int((parse_qs(url.query).get("limit") or ["50"])[0])
                found = [r for r in hub.repos.values() if q in r.repo_id.lower()][:limit]
                self._json(
                    200, [{"id": r.repo_id, "modelId": r.repo_id, "downloads": r.downloads, "likes": 0} for r in found]
                )
                return
            m = _INFO.match(path)
            if m:
                repo = hub.repos.get(m.group(1))
                if repo is None:
                    self._json(404, {"error": "Repository not found"})
                    return
                siblings = [
                    {"rfilename": n, "size": repo.listed_sizes.get(n, len(b)), "blobId": hashlib.sha1(b).hexdigest()}
                    for n, b in repo.files.items()
                ]
                self._json(200, {"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha, "siblings": siblings,
                                 "private": False, "downloads": repo.downloads, "tags": []})  # fmt: skip
                return
            m = _RESOLVE.match(path)
            if m:
                repo = hub.repos.get(m.group(1))
                name = m.group(3)
                if repo is None or name not in repo.files or m.group(2) not in (repo.sha, "main"):
                    self._json(404, {"error": "Entry not found"})
                    return
                self._file(repo, name)
                return
            self._json(404, {"error": "not found"})

        def _file(self, repo: FakeRepo, name: str) -> None:
            data = repo.files[name]
            start, end = 0, len(data) - 1
            rng = self.headers.get("Range", "")
            ranged = False
            if rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                start = int(a) if a else 0
                end = min(int(b), len(data) - 1) if b else len(data) - 1
                ranged = True
            body = data[start : end + 1]
            self.send_response(206 if ranged else 200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
            self.send_header("X-Repo-Commit", repo.sha)
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            cut = hub.truncate.get(name)
            if cut is not None and name in hub.truncate_times:
                if hub.truncate_times[name] <= 0:
                    cut = None
                else:
                    hub.truncate_times[name] -= 1
            if cut is not None and self.command == "GET" and cut < end + 1:
                self.wfile.write(body[: max(0, cut - start)])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@contextmanager
def serve(hub: FakeHub) -> Iterator[FakeHub]:
    """Run the fake hub on 127.0.0.1 (a free port) for the duration of the block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def safetensors_bytes(tensors: dict[str, tuple[str, list[int]]], *, with_data: bool = True) -> bytes:
    """A safetensors file of zero-filled tensors ({name: (dtype, shape)}); `with_data=False` keeps only the
    header (enough for a fit estimate, which reads nothing else)."""
    from mlx_dspark.domain.fit import DTYPE_BYTES

    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = int(DTYPE_BYTES[dtype])
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    out = len(raw).to_bytes(8, "little") + raw
    return out + (bytes(offset) if with_data else b"")

"""A model hub over huggingface-hub's HTTP API: search, fit facts without downloading, resumable downloads.

The endpoint is explicit (the dashboard passes HF_ENDPOINT), so a local server speaking the hub's API
works the same as huggingface.co. Fit facts read `config.json` and only the JSON headers of the
safetensors files (two small ranged reads each); downloads go into the Hugging Face cache, where the
loader finds them by repo id. A dropped connection resumes with a ranged request from the last written
chunk; a download that still fails leaves no partial file behind (huggingface-hub writes each attempt to
a temporary file of its own), so trying again starts that file over.

Before any call the endpoint's host must accept a TCP connection within `REACH_TIMEOUT_S` (the answer is kept
for a while): offline, huggingface-hub's own retries held a search for 23 s and then said "not found", where
"hub unreachable" is the truth and can be said at once.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlx_dspark.adapters.hf.resolve import hf_offline
from mlx_dspark.domain import fit
from mlx_dspark.domain.dashboard import RepoFacts
from mlx_dspark.domain.errors import InvalidRequest, ModelUnavailable

Progress = Callable[[int, int], None]  # (bytes done, bytes total)

MAX_HEADER = 100 << 20
DEFAULT_ENDPOINT = "https://huggingface.co"
REACH_TIMEOUT_S = 3.0  # a TCP connect to the hub; longer means unreachable for an interactive page
REACH_KEEP_S = {True: 300.0, False: 15.0}  # how long a reachable / unreachable answer is trusted


def header_tensors(file: str, header: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{"file:tensor": (dtype, shape)} of one safetensors JSON header (its metadata entry left out)."""
    return {
        f"{file}:{key}": (str(value["dtype"]), tuple(value["shape"])) for key, value in header.items()
        if key != "__metadata__"
    }  # fmt: skip


class Reachability:
    """Whether an endpoint's host accepts a TCP connection, asked at most once per `REACH_KEEP_S`."""

    def __init__(self, endpoint: str) -> None:
        url = urllib.parse.urlsplit(endpoint)
        self.host = url.hostname or ""
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._lock = threading.Lock()
        self._known: tuple[bool, float] | None = None

    def check(self) -> bool:
        with self._lock:
            now = time.monotonic()
            if self._known is not None and now - self._known[1] < REACH_KEEP_S[self._known[0]]:
                return self._known[0]
            try:
                with socket.create_connection((self.host, self.port), timeout=REACH_TIMEOUT_S):
                    up = True
            except OSError:
                up = False
            self._known = (up, now)
            return up


class HfModelHub:
    """The ModelHub port.

    Args:
        endpoint: the hub's base URL (None = huggingface.co).
        cache_dir: the Hugging Face cache to download into (None = the environment's).
        token: an access token (None = huggingface-hub's own lookup).
    """

    def __init__(self, endpoint: str | None = None, *, cache_dir: str | None = None, token: str | None = None) -> None:
        self.endpoint = (endpoint or DEFAULT_ENDPOINT).rstrip("/")
        self._cache_dir = cache_dir
        self._token = token
        self._reach = Reachability(self.endpoint)

    def _api(self) -> Any:
        from huggingface_hub import HfApi

        self._online()
        return HfApi(endpoint=self.endpoint, token=self._token)

    def _online(self) -> None:
        if hf_offline():
            raise ModelUnavailable(message="the hub is off: HF_HUB_OFFLINE is set")
        if not self._reach.check():
            raise ModelUnavailable(
                message=f"hub unreachable: no connection to {self._reach.host}:{self._reach.port} (offline?)"
            )

    def search(self, query: str, limit: int = 20) -> list[dict[str, Any]]:
        """Repos whose id contains `query` (an empty query asks nothing and finds nothing)."""
        if not query.strip():
            return []
        self._online()
        try:
            models = self._api().list_models(search=query or None, limit=limit)
            return [
                {"id": m.id, "downloads": getattr(m, "downloads", None), "likes": getattr(m, "likes", None)}
                for m in models
            ]
        except Exception as exc:
            raise ModelUnavailable(message=f"hub search failed at {self.endpoint}: {_first_line(exc)}") from exc

    def _info(self, repo_id: str) -> Any:
        if not repo_id or repo_id.count("/") != 1:
            raise InvalidRequest(message="a repo id looks like 'owner/name'", param="repo_id")
        self._online()
        try:
            return self._api().model_info(repo_id, files_metadata=True)
        except Exception as exc:
            raise ModelUnavailable(message=f"{repo_id} not found at {self.endpoint}: {_first_line(exc)}") from exc

    def _get(self, repo_id: str, filename: str, revision: str, byte_range: tuple[int, int] | None = None) -> bytes:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session

        self._online()
        url = hf_hub_url(repo_id, filename, revision=revision, endpoint=self.endpoint)
        headers = build_hf_headers(token=self._token)
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        r = get_session().get(url, headers=headers, follow_redirects=True, timeout=30)
        if r.status_code >= 400:
            raise ModelUnavailable(message=f"{repo_id}/{filename}: HTTP {r.status_code} from {self.endpoint}")
        data: bytes = r.content
        if byte_range is not None and r.status_code == 200:  # a server that ignores Range sends everything
            data = data[byte_range[0] : byte_range[1] + 1]
        return data

    def facts(self, repo_id: str) -> RepoFacts:
        """Config shape and weight bytes from the safetensors headers (nothing is downloaded to disk).

        Raises:
            ModelUnavailable: the repo, its config or its safetensors headers cannot be read.
        """
        info = self._info(repo_id)
        revision = info.sha or "main"
        files = {s.rfilename: int(s.size or 0) for s in info.siblings or ()}
        if "config.json" not in files:
            raise ModelUnavailable(message=f"{repo_id} has no config.json")
        try:
            config = json.loads(self._get(repo_id, "config.json", revision))
            shape = fit.shape_from_config(config)
        except ValueError as exc:
            raise ModelUnavailable(message=f"{repo_id}: unreadable config.json: {exc}") from exc
        tensors: dict[str, tuple[str, Sequence[int]]] = {}
        for name in sorted(f for f in files if f.endswith(".safetensors")):
            (n,) = struct.unpack("<Q", self._get(repo_id, name, revision, (0, 7)))
            if not 0 < n <= MAX_HEADER:
                raise ModelUnavailable(message=f"{repo_id}/{name}: implausible safetensors header length {n}")
            header = json.loads(self._get(repo_id, name, revision, (8, 8 + n - 1)))
            tensors.update(header_tensors(name, header))
        if not tensors:
            raise ModelUnavailable(message=f"{repo_id} has no safetensors weights (GGUF-only repos are not estimated)")
        return RepoFacts(
            repo_id=repo_id,
            shape=shape,
            weight_bytes=fit.weight_bytes(tensors),
            active_weight_bytes=fit.active_weight_bytes(tensors, config),
            files=files,
            model_type=str(config.get("model_type") or ""),
        )

    def download(self, repo_id: str, progress: Progress | None = None, *, files: Sequence[str] | None = None) -> str:
        """Download every file of the repo (or `files`) at one commit; returns the snapshot folder.

        Raises:
            ModelUnavailable: the repo is unknown or a file failed after huggingface-hub's own resumes.
        """
        from huggingface_hub import hf_hub_download

        info = self._info(repo_id)
        revision = info.sha or "main"
        sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or ()}
        wanted = list(files) if files is not None else sorted(sizes)
        total = sum(sizes.get(f, 0) for f in wanted)
        finished = 0
        report = progress or (lambda _d, _t: None)
        bar = _bar_class(lambda n: report(finished + n, total))
        report(0, total)
        path = ""
        for name in wanted:
            try:
                local = hf_hub_download(
                    repo_id,
                    name,
                    revision=revision,
                    endpoint=self.endpoint,
                    cache_dir=self._cache_dir,
                    token=self._token,
                    tqdm_class=bar,
                )
            except Exception as exc:
                raise ModelUnavailable(message=f"downloading {repo_id}/{name} failed: {_first_line(exc)}") from exc
            finished += sizes.get(name, 0)
            report(finished, total)
            path = str(Path(str(local)).parents[len(Path(name).parts) - 1])  # the snapshot folder
        if not path:
            raise ModelUnavailable(message=f"{repo_id} has no files")
        return path


def _bar_class(on_bytes: Any) -> type:
    """A tqdm class that reports the current file's byte count (huggingface-hub drives it)."""
    from tqdm.auto import tqdm

    class Bar(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True  # no terminal output from a server thread
            super().__init__(*args, **kwargs)
            self._done = int(kwargs.get("initial") or 0)  # a resumed file starts at its partial size

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
            on_bytes(self._done)
            return None

    return Bar


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__

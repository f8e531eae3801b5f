"""Turn a model spec (local path or Hugging Face repo id) into a local snapshot, and name it stably.

The hub is optional: with `HF_HUB_OFFLINE=1`, or when it cannot be reached, the local HF cache is used.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path

from mlx_dspark.adapters.hf.cache import memo_sha256
from mlx_dspark.domain.errors import ModelUnavailable

_TRUE = {"1", "true", "yes", "on"}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")  # `org/name`, or a legacy bare `name`
# Files whose content decides what a local checkpoint computes (weights, architecture, vocabulary).
_IDENTITY_SUFFIXES = (".json", ".safetensors", ".model", ".tiktoken", ".jinja", ".txt", ".gguf", ".py")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hf_offline() -> bool:
    """Whether the environment forbids reaching the hub (read now, not at import time)."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache as the environment names it now (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def looks_like_path(spec: str) -> bool:
    """Whether `spec` is meant as a filesystem path rather than an `org/name` repo id."""
    return (
        spec.startswith(("/", ".", "~"))
        or spec.endswith(".gguf")
        or os.sep in spec.replace("/", "", 1)
        or not _REPO_ID.match(spec)
    )


def resolve_snapshot(spec: str, *, allow_patterns: Sequence[str] | None = None, revision: str | None = None) -> Path:
    """A local directory or file for `spec`.

    Args:
        spec: a local directory or file, or a Hugging Face repo id (`org/name`).
        allow_patterns: for repo ids, the files to fetch (glob patterns); None fetches everything.
        revision: for repo ids, a branch, tag or commit; None means `main`.

    Returns:
        The absolute path of the directory (or file) to load.

    Raises:
        ModelUnavailable: the path does not exist, or the repo is neither reachable nor in the local cache.
    """
    local = Path(spec).expanduser()
    if local.exists():
        return local.resolve()
    if looks_like_path(spec):
        raise ModelUnavailable(message=f"model {spec!r}: no such file or directory ({local.resolve()})")
    return _snapshot_from_hub(spec, allow_patterns=allow_patterns, revision=revision)


def _snapshot_from_hub(repo_id: str, *, allow_patterns: Sequence[str] | None, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    cache = hf_cache_dir()
    patterns = list(allow_patterns) if allow_patterns is not None else None
    tried: list[str] = [f"a local path ./{repo_id} (none)"]
    if not hf_offline():
        try:
            return Path(
                snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns)
            ).resolve()
        except Exception as exc:  # unreachable hub, unknown repo, gated repo...: fall back to the cache
            tried.append(f"the Hugging Face hub ({type(exc).__name__}: {_first_line(exc)})")
    else:
        tried.append("not the hub (HF_HUB_OFFLINE is set)")
    try:
        path = Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns, local_files_only=True
            )
        ).resolve()
    except Exception as exc:
        tried.append(f"the local HF cache {cache} ({type(exc).__name__})")
        rev = f" at revision {revision!r}" if revision else ""
        raise ModelUnavailable(
            message=f"model {repo_id!r}{rev} is unavailable; tried {'; '.join(tried)}. "
            "Download it where the hub is reachable, point HF_HUB_CACHE at a cache that holds it, or pass a local path."
        ) from exc
    if not path.is_dir():
        raise ModelUnavailable(message=f"model {repo_id!r}: cached snapshot {path} is missing")
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""


def _hub_repo_of(path: Path) -> tuple[str, str] | None:
    """(repo id, commit) when `path` is a snapshot inside an HF cache (`models--org--name/snapshots/<commit>`)."""
    parts = path.parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--") and _COMMIT.match(parts[i + 1]):
            return parts[i - 1][len("models--") :].replace("--", "/"), parts[i + 1]
    return None


def model_identity(
    path_or_repo: str | os.PathLike[str], revision: str | None = None, *, cache_dir: Path | None = None
) -> str:
    """A stable name for a checkpoint, fit for cache keys: never a bare basename.

    * a snapshot in the HF cache → `hf:org/name@<commit>`;
    * a repo id that is not on disk → `hf:org/name@<revision or main>`;
    * a local file → `<absolute path>@sha256:<content hash>`;
    * a local directory → `<absolute path>@sha256:<hash over its model files' names and content hashes>`.

    Args:
        path_or_repo: a local path or a repo id.
        revision: the repo revision (repo ids only).
        cache_dir: where content hashes are remembered (by size and mtime); None re-hashes.

    Returns:
        The identity string.
    """
    spec = os.fspath(path_or_repo)
    path = Path(spec).expanduser()
    if not path.exists():
        return f"hf:{spec}@{revision or 'main'}"
    path = path.resolve()
    hub = _hub_repo_of(path)
    if hub is not None:
        return f"hf:{hub[0]}@{hub[1]}"
    if path.is_file():
        return f"{path}@sha256:{memo_sha256(path, cache_dir)}"
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _IDENTITY_SUFFIXES):
        digest.update(f"{file.relative_to(path).as_posix()}\0{memo_sha256(file, cache_dir)}\n".encode())
    return f"{path}@sha256:{digest.hexdigest()}"

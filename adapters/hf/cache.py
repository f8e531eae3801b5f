"""The on-disk cache of converted models and file hashes: where it lives and how entries are written atomically.

An entry is a directory that appears by one `rename`, so a crash mid-write never leaves a half entry behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

_HASH_CHUNK = 8 << 20
_MEMO_FILE = "file-hashes.json"


def cache_root(configured: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: `configured`, else `$XDG_CACHE_HOME/mlx-dspark`, else `~/.cache/mlx-dspark`.

    Args:
        configured: an explicit directory (ModelSettings.cache_dir), or None.

    Returns:
        The directory (not created).
    """
    if configured:
        return Path(configured).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return (base / "mlx-dspark").resolve()


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `final`; on success rename it to `final`.

    On an exception the temporary directory is removed and `final` is untouched. If another process
    created `final` first, ours is dropped (both wrote the same content-keyed entry).

    Args:
        final: the entry's directory.

    Yields:
        The temporary directory to fill.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's content, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def memo_sha256(path: Path, cache_dir: Path | None) -> str:
    """The sha256 of `path`, remembered in `cache_dir` by absolute path, size and mtime.

    Re-hashing a multi-gigabyte model on every start would dominate start-up; a file that was
    rewritten changes its size or mtime and is hashed again.

    Args:
        path: the file.
        cache_dir: where the memo lives; None hashes without remembering.

    Returns:
        The hex digest.
    """
    path = path.resolve()
    if cache_dir is None:
        return sha256_file(path)
    memo_path = cache_dir / _MEMO_FILE
    memo: dict[str, dict[str, str]] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(memo_path.read_text())
        if isinstance(loaded, dict):
            memo = loaded
    key, stamp = str(path), _stamp(path)
    hit = memo.get(key)
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    digest = sha256_file(path)
    memo[key] = {"stamp": stamp, "sha256": digest}
    # A read-only cache only costs a re-hash next time.
    with contextlib.suppress(OSError):
        atomic_write_bytes(memo_path, json.dumps(memo, indent=1, sort_keys=True).encode())
    return digest

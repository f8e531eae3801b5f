"""Which servers this user runs: one small JSON file per serving process, so `top` finds the one that runs.

`serve` writes `servers/<pid>.json` (its URL, model and start time) into the cache folder when it starts and
removes it when it ends. A process that died without removing its file is recognised by its pid and its file
is dropped on the next read. Files are written to a temporary name and renamed, so a reader never sees half.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any


class ServerRegistry:
    """The running servers' files under `root/servers`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.folder = Path(root) / "servers"

    def register(self, url: str, model: str) -> Path:
        """Record this process as serving `model` at `url`; returns its file (for `unregister`)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        entry = {"url": url, "pid": os.getpid(), "model": model, "started": time.time()}
        tmp.write_text(json.dumps(entry), encoding="utf-8")
        os.replace(tmp, path)
        return path

    @staticmethod
    def unregister(path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()

    def live(self) -> list[dict[str, Any]]:
        """The servers whose process still runs, the newest first (files of dead processes are removed)."""
        out = []
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else ():
            try:
                entry = json.loads(path.read_text(encoding="utf-8"))
                pid = int(entry["pid"])
                str(entry["url"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if _running(pid):
                out.append(entry)
            else:
                self.unregister(path)
        return sorted(out, key=lambda e: -float(e.get("started") or 0))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process with that pid: alive
        return True
    return True

"""The calibration store: one JSON file of measured cost curves and race results, safe with two processes.

Writes go to a temporary file in the same folder, are fsynced, then `os.replace`d over the old file, so a
crash mid-write leaves the old file intact; a lock file (fcntl, where the platform has it) serializes
read-modify-write across processes so two writers never drop each other's entries.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mlx_dspark.domain.costmodel.calibration import CALIBRATION_SCHEMA, Calibration, CalibrationKey
from mlx_dspark.domain.costmodel.curves import CostCurves

try:  # POSIX only; elsewhere writes are still atomic, just not serialized across processes.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

Environment = Mapping[str, str]


class JsonCalibrationStore:
    """The CalibrationStore port over one JSON file.

    Args:
        path: the JSON file (its folder is created on first write).
        environment: returns the device description and MLX version ({"device", "mlx_version"});
            called once, lazily, so that building the store never imports MLX.
    """

    def __init__(self, path: str | os.PathLike[str], environment: Callable[[], Environment]) -> None:
        self.path = Path(path)
        self._environment_fn = environment
        self._environment: dict[str, str] | None = None

    # -- keys ---------------------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        if self._environment is None:
            env = dict(self._environment_fn())
            self._environment = {
                "device": str(env.get("device", "unknown")),
                "mlx_version": str(env.get("mlx_version", "unknown")),
            }
        return self._environment

    def key_fields(self, key: CalibrationKey) -> dict[str, Any]:
        """Every field an entry is valid for: schema, device, MLX version, target, drafter, bits."""
        return {
            "schema": CALIBRATION_SCHEMA,
            **self._env(),
            "target": key.target,
            "drafter": key.drafter,
            "drafter_bits": key.drafter_bits,
        }

    def _key_string(self, key: CalibrationKey) -> str:
        return json.dumps(self.key_fields(key), sort_keys=True, separators=(",", ":"))

    # -- file -----------------------------------------------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {"schema": CALIBRATION_SCHEMA, "entries": {}}
        except (OSError, ValueError):
            # A foreign or damaged file is treated as empty; the next write replaces it.
            return {"schema": CALIBRATION_SCHEMA, "entries": {}}
        if not isinstance(data, dict) or data.get("schema") != CALIBRATION_SCHEMA:
            return {"schema": CALIBRATION_SCHEMA, "entries": {}}
        if not isinstance(data.get("entries"), dict):
            data["entries"] = {}
        return data

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name(self.path.name + ".lock")
        with open(lock_path, "a+b") as lock:
            if fcntl is not None:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _write(self, data: Mapping[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        # Make the rename itself durable.
        with contextlib.suppress(OSError):
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    # -- port -----------------------------------------------------------------------------------------------

    def load(self, key: CalibrationKey) -> Calibration | None:
        """The stored calibration for `key` on this device and MLX version, or None."""
        entry = self._read()["entries"].get(self._key_string(key))
        if not isinstance(entry, dict):
            return None
        try:
            return _decode(entry)
        except (KeyError, TypeError, ValueError):
            return None

    def save(self, key: CalibrationKey, calibration: Calibration) -> None:
        """Store (or replace) the calibration for `key`; entries of other MLX versions on this device are dropped."""
        fields = self.key_fields(key)
        with self._locked():
            data = self._read()
            entries: dict[str, Any] = data["entries"]
            # Entries measured under another MLX version of this device can never match again.
            for name in [k for k, v in entries.items() if _stale(v, fields)]:
                del entries[name]
            entries[self._key_string(key)] = {"key": fields, **_encode(calibration)}
            self._write({"schema": CALIBRATION_SCHEMA, "updated": time.time(), "entries": entries})


def _stale(entry: Any, fields: Mapping[str, Any]) -> bool:
    key = entry.get("key") if isinstance(entry, dict) else None
    if not isinstance(key, dict):
        return True
    return bool(key.get("device") == fields["device"] and key.get("mlx_version") != fields["mlx_version"])


def _encode(cal: Calibration) -> dict[str, Any]:
    curves = None
    if cal.curves is not None:
        curves = {
            "verify_s": {str(k): v for k, v in sorted(cal.curves.verify_s.items())},
            "draft_s": {str(k): v for k, v in sorted(cal.curves.draft_s.items())},
            "slope_s_per_token": cal.curves.slope_s_per_token,
            "overhead_s": cal.curves.overhead_s,
        }
    return {"curves": curves, "race": dict(cal.race), "chosen": cal.chosen, "created": cal.created or time.time()}


def _decode(entry: Mapping[str, Any]) -> Calibration:
    raw = entry.get("curves")
    curves = None
    if raw is not None:
        curves = CostCurves(
            verify_s={int(k): float(v) for k, v in raw["verify_s"].items()},
            draft_s={int(k): float(v) for k, v in raw.get("draft_s", {}).items()},
            slope_s_per_token=float(raw.get("slope_s_per_token", 0.0)),
            overhead_s=float(raw.get("overhead_s", 0.0)),
        )
    race = {str(k): float(v) for k, v in (entry.get("race") or {}).items()}
    chosen = entry.get("chosen")
    return Calibration(
        curves=curves,
        race=race,
        chosen=str(chosen) if chosen is not None else None,
        created=float(entry.get("created", 0.0)),
    )

"""The JSON calibration store: round trip, full-identity keys, invalidation on version change, two
concurrent writer processes, and a writer killed between write and rename."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mlx_dspark.adapters.storage.calibration_store import JsonCalibrationStore
from mlx_dspark.domain.costmodel.calibration import Calibration, CalibrationKey
from mlx_dspark.domain.costmodel.curves import CostCurves

ENV = {"device": "cpu on test", "mlx_version": "0.32.4"}
CURVES = CostCurves(
    verify_s={1: 0.05, 2: 0.055, 8: 0.09}, draft_s={1: 0.01, 7: 0.03}, slope_s_per_token=1e-6, overhead_s=1e-4
)
KEY = CalibrationKey(target="org/model@abc123", drafter="dspark:org/drafter@def", drafter_bits=4)


def store(path: Path, **env: str) -> JsonCalibrationStore:
    return JsonCalibrationStore(path, lambda: {**ENV, **env})


def test_round_trip(tmp_path: Path) -> None:
    s = store(tmp_path / "cal.json")
    assert s.load(KEY) is None
    s.save(KEY, Calibration(curves=CURVES, race={"dspark": 30.5, "none": 20.0}, chosen="dspark", created=1.0))
    got = store(tmp_path / "cal.json").load(KEY)
    assert got is not None
    assert got.curves == CURVES
    assert got.race == {"dspark": 30.5, "none": 20.0} and got.chosen == "dspark"


def test_key_is_full_identity(tmp_path: Path) -> None:
    s = store(tmp_path / "cal.json")
    s.save(KEY, Calibration(curves=CURVES))
    # Same basename, another repo or revision, other bits, other drafter: all different entries.
    for other in (
        CalibrationKey(target="other/model@abc123", drafter=KEY.drafter, drafter_bits=4),
        CalibrationKey(target="org/model@abc124", drafter=KEY.drafter, drafter_bits=4),
        CalibrationKey(target=KEY.target, drafter=KEY.drafter, drafter_bits=None),
        CalibrationKey(target=KEY.target, drafter="dflash:x", drafter_bits=4),
    ):
        assert s.load(other) is None
    assert store(tmp_path / "cal.json", device="gpu on other").load(KEY) is None


def test_mlx_version_change_invalidates(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    store(path).save(KEY, Calibration(curves=CURVES))
    newer = store(path, mlx_version="0.33.0")
    assert newer.load(KEY) is None
    newer.save(KEY, Calibration(curves=CURVES))
    # The stale entry of the old version is dropped on the next write.
    data = json.loads(path.read_text())
    assert {e["key"]["mlx_version"] for e in data["entries"].values()} == {"0.33.0"}


def test_schema_change_invalidates(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    store(path).save(KEY, Calibration(curves=CURVES))
    data = json.loads(path.read_text())
    data["schema"] = 999
    path.write_text(json.dumps(data))
    assert store(path).load(KEY) is None


def test_damaged_file_reads_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text("{not json")
    s = store(path)
    assert s.load(KEY) is None
    s.save(KEY, Calibration(curves=CURVES))
    assert s.load(KEY) is not None


WRITER = textwrap.dedent(
    """
    import sys
    from mlx_dspark.adapters.storage.calibration_store import JsonCalibrationStore
    from mlx_dspark.domain.costmodel.calibration import Calibration, CalibrationKey
    from mlx_dspark.domain.costmodel.curves import CostCurves

    path, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    s = JsonCalibrationStore(path, lambda: {"device": "cpu on test", "mlx_version": "0.32.4"})
    for i in range(n):
        key = CalibrationKey(target=f"{name}/model-{i}", drafter="lookup")
        s.save(key, Calibration(curves=CostCurves(verify_s={1: float(i + 1)})))
    """
)


def test_two_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    n = 25
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(n)]) for name in ("alpha", "beta")]
    for p in procs:
        assert p.wait(timeout=60) == 0
    s = store(path)
    for name in ("alpha", "beta"):
        for i in range(n):
            got = s.load(CalibrationKey(target=f"{name}/model-{i}", drafter="lookup"))
            assert got is not None and got.curves is not None and got.curves.verify_s[1] == float(i + 1)
    assert not list(tmp_path.glob("*.tmp"))


CRASHER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import mlx_dspark.adapters.storage.calibration_store as mod
    from mlx_dspark.domain.costmodel.calibration import Calibration, CalibrationKey
    from mlx_dspark.domain.costmodel.curves import CostCurves

    path, marker = sys.argv[1], sys.argv[2]

    def stuck_replace(src, dst):
        # The new content is written and fsynced; hang before the rename until killed.
        Path(marker).write_text(src)
        time.sleep(60)

    mod.os.replace = stuck_replace
    s = mod.JsonCalibrationStore(path, lambda: {"device": "cpu on test", "mlx_version": "0.32.4"})
    s.save(CalibrationKey(target="new/model", drafter="lookup"), Calibration(curves=CostCurves(verify_s={1: 9.0})))
    """
)


def test_writer_killed_mid_write_leaves_old_file_valid(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    store(path).save(KEY, Calibration(curves=CURVES))
    before = path.read_bytes()
    marker = tmp_path / "marker"
    child = subprocess.Popen([sys.executable, "-c", CRASHER, str(path), str(marker)])
    try:
        deadline = time.monotonic() + 30
        while not marker.exists():
            assert child.poll() is None, "writer exited early"
            assert time.monotonic() < deadline, "writer never reached the rename"
            time.sleep(0.02)
        tmp_file = Path(marker.read_text())
        assert tmp_file.exists() and tmp_file.stat().st_size > 0
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    assert path.read_bytes() == before
    s = store(path)
    assert s.load(KEY) is not None
    assert s.load(CalibrationKey(target="new/model", drafter="lookup")) is None
    # The lock died with the writer: the next save goes through.
    s.save(CalibrationKey(target="new/model", drafter="lookup"), Calibration(curves=CURVES))
    assert s.load(CalibrationKey(target="new/model", drafter="lookup")) is not None

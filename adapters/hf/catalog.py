"""Local models: the embedded defaults, the mlx-dspark cache, the Hugging Face hub cache and LM Studio's folder.

Each entry reads only `config.json` (dtype, quantization bits, context) and file sizes; nothing is loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlx_dspark.adapters.hf.default_models import EMBEDDED, package_dir
from mlx_dspark.adapters.hf.loader import packaged_drafters
from mlx_dspark.adapters.hf.resolve import hf_cache_dir
from mlx_dspark.domain.dashboard import LocalModel

_WEIGHTS = (".safetensors", ".gguf", ".bin", ".npz")


def lm_studio_dirs() -> list[Path]:
    """LM Studio's models folder(s): LMSTUDIO_MODELS_DIR, ~/.lmstudio/models, ~/.cache/lm-studio/models."""
    dirs = [os.environ.get("LMSTUDIO_MODELS_DIR", "")]
    home = Path.home()
    dirs += [str(home / ".lmstudio" / "models"), str(home / ".cache" / "lm-studio" / "models")]
    return [Path(d).expanduser() for d in dirs if d]


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += (Path(root) / f).stat().st_size  # follows hub-cache symlinks to their blobs
    return total


def _config_facts(folder: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    text = cfg.get("text_config") or cfg
    quant = cfg.get("quantization") or cfg.get("quantization_config") or {}
    return {
        "dtype": str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or ""),
        "bits": quant.get("bits") if isinstance(quant, dict) else None,
        "context": text.get("max_position_embeddings") or cfg.get("max_position_embeddings"),
        "model_type": str(cfg.get("model_type") or ""),
    }


class LocalModelCatalog:
    """The ModelCatalog port.

    Args:
        project_cache: the mlx-dspark cache folder (converted models, installed drafters).
        hub_cache: the Hugging Face hub cache (default: as the environment names it).
        lm_studio: LM Studio model folders (default: lm_studio_dirs()).
    """

    def __init__(
        self, *, project_cache: Path, hub_cache: Path | None = None, lm_studio: list[Path] | None = None
    ) -> None:
        self._project = Path(project_cache)
        self._hub = hub_cache
        self._lm = lm_studio

    def local_models(self) -> list[LocalModel]:
        found = [*self._embedded(), *self._hub_cache(), *self._lm_studio(), *self._project_cache()]
        return found

    def _entry(self, name: str, path: Path, source: str, weights_at: Path | None = None) -> LocalModel:
        facts = _config_facts(path if path.is_dir() else path.parent)
        drafters = ("lookup", *sorted(packaged_drafters(name, self._project)))
        dtype = facts.get("dtype") or ("gguf" if path.suffix == ".gguf" else "")
        return LocalModel(
            name=name,
            path=str(path),
            source=source,
            size_bytes=_size(weights_at or path),
            dtype=dtype,
            bits=facts.get("bits"),
            context=facts.get("context"),
            model_type=facts.get("model_type", ""),
            drafters=drafters,
        )

    def _embedded(self) -> Iterator[LocalModel]:
        for name, model in EMBEDDED.items():
            pkg, rel = model.parts[0]
            root = package_dir(pkg)
            if root is not None and (root / rel).is_file():
                entry = self._entry(name, root / rel, "embedded")
                size = sum(_size(d / r) for p, r in model.parts if (d := package_dir(p)) is not None)
                yield LocalModel(**{**_fields(entry), "size_bytes": size, "bits": 4})

    def _hub_cache(self) -> Iterator[LocalModel]:
        root = self._hub or hf_cache_dir()
        if not root.is_dir():
            return
        for repo in sorted(root.glob("models--*")):
            snaps = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
            snap = next((s for s in snaps if (s / "config.json").exists()), None)
            if snap is None or not any(f.suffix in _WEIGHTS for f in snap.iterdir()):
                continue
            repo_id = repo.name[len("models--") :].replace("--", "/")
            yield self._entry(repo_id, snap, "huggingface cache", weights_at=repo / "blobs")

    def _lm_studio(self) -> Iterator[LocalModel]:
        for root in self._lm if self._lm is not None else lm_studio_dirs():
            if not root.is_dir():
                continue
            for config in sorted(root.glob("*/*/config.json")):
                yield self._entry(str(config.parent), config.parent, "lm studio")
            for gguf in sorted(root.glob("*/*/*.gguf")):
                yield self._entry(str(gguf), gguf, "lm studio")

    def _project_cache(self) -> Iterator[LocalModel]:
        if not self._project.is_dir():
            return
        for config in sorted(self._project.glob("*/*/config.json")):
            if "drafters" in config.parts:
                continue
            folder = config.parent
            if any(f.suffix in _WEIGHTS for f in folder.iterdir()):
                yield self._entry(str(folder), folder, "mlx-dspark cache")

    def delete(self, path: str) -> None:
        """Remove a model folder (a hub-cache snapshot removes the whole repo entry) or file."""
        p = Path(path)
        hub = self._hub or hf_cache_dir()
        with contextlib.suppress(ValueError):
            rel = p.relative_to(hub)
            p = hub / rel.parts[0]  # models--owner--name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def _fields(entry: LocalModel) -> dict[str, Any]:
    import attrs

    return attrs.asdict(entry, recurse=False)

"""Local models: the embedded defaults, the mlx-dspark cache, the Hugging Face hub cache and LM Studio's folder.

Each entry reads only `config.json` (dtype, quantization bits, context) and file sizes; nothing is loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mlx_dspark.adapters.hf.default_models import EMBEDDED, package_dir
from mlx_dspark.adapters.hf.hub import MAX_HEADER, header_tensors
from mlx_dspark.adapters.hf.loader import packaged_drafters
from mlx_dspark.adapters.hf.resolve import hf_cache_dir
from mlx_dspark.domain import fit
from mlx_dspark.domain.dashboard import LocalModel, RepoFacts
from mlx_dspark.domain.errors import ModelUnavailable

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


def _folder_facts(folder: Path) -> RepoFacts:
    """Shape from config.json and weight bytes from the local safetensors headers (no tensor is read)."""
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        shape = fit.shape_from_config(config)
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(message=f"{folder}: no readable config.json ({exc})") from exc
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    files = {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.is_file()}
    for name in (n for n in files if n.endswith(".safetensors")):
        try:
            with (folder / name).open("rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if not 0 < n <= MAX_HEADER:
                    raise ValueError(f"implausible header length {n}")
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as exc:
            raise ModelUnavailable(message=f"{folder / name}: unreadable safetensors header ({exc})") from exc
        tensors.update(header_tensors(name, header))
    if not tensors:
        raise ModelUnavailable(message=f"{folder} has no safetensors weights")
    return RepoFacts(
        repo_id=str(folder),
        shape=shape,
        weight_bytes=fit.weight_bytes(tensors),
        active_weight_bytes=fit.active_weight_bytes(tensors, config),
        files=files,
        model_type=str(config.get("model_type") or ""),
    )


def _gguf_facts(path: Path) -> RepoFacts:
    """Shape from the GGUF's metadata (as the loader converts it) and its tensors' stored bytes."""
    from mlx_dspark.adapters.hf import gguf

    reader = gguf.open_gguf(path)
    arch = gguf.gguf_architecture(reader, path)
    config = gguf.model_config(gguf.metadata(reader), arch, gguf.tensor_shapes(reader), path)
    try:
        shape = fit.shape_from_config(config)
    except ValueError as exc:
        raise ModelUnavailable(message=f"{path}: {exc}") from exc
    return RepoFacts(
        repo_id=str(path),
        shape=shape,
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
        files={path.name: path.stat().st_size},
        model_type=str(config.get("model_type") or arch),
    )


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

    def facts(self, spec: str) -> RepoFacts | None:
        """Fit facts of a local model (an mlx-lm / Hugging Face folder or a .gguf file), None when `spec` is not
        a path on this machine (then it names a hub repo).

        Raises:
            ModelUnavailable: the path exists but holds no readable config and weights.
        """
        path = Path(spec).expanduser()
        if not path.exists():
            return None
        if path.is_file() and path.suffix == ".gguf":
            return _gguf_facts(path)
        folder = path if path.is_dir() else path.parent
        return _folder_facts(folder)

    def local_models(self) -> list[LocalModel]:
        """Every local model once: a GGUF's converted copy in the project cache is shown on its source's row
        (its size is what loads), not as a second model named by a hash."""
        conversions = dict(self._conversions())
        shown: set[Path] = set()
        found = []
        for entry in [*self._embedded(), *self._hub_cache(), *self._lm_studio()]:
            copy = conversions.get(self._sha256(entry))
            if copy is not None:
                shown.add(copy)
                entry = LocalModel(**{**_fields(entry), "converted_path": str(copy), "converted_bytes": _size(copy)})
            found.append(entry)
        for entry in self._project_cache():
            if Path(entry.path) in shown:
                continue
            if Path(entry.path) in conversions.values():  # a copy whose source is not listed (a GGUF given by path)
                entry = LocalModel(**{**_fields(entry), "source": "converted GGUF", "converted_path": entry.path,
                                      "converted_bytes": entry.size_bytes})  # fmt: skip
            found.append(entry)
        return found

    def _conversions(self) -> Iterator[tuple[str, Path]]:
        """(the source GGUF's sha256, the converted folder) of each conversion in the project cache."""
        for config in sorted(self._project.glob("gguf/*/config.json")) if self._project.is_dir() else ():
            with contextlib.suppress(OSError, ValueError, AttributeError):
                source = str(json.loads(config.read_text()).get("mlx_dspark", {}).get("source", ""))
                if source.startswith("sha256:"):
                    yield source.removeprefix("sha256:"), config.parent

    @staticmethod
    def _sha256(entry: LocalModel) -> str:
        """The known sha256 of an entry's GGUF (embedded models are pinned; others are not hashed here)."""
        model = EMBEDDED.get(entry.name)
        return model.sha256 if model is not None and entry.source == "embedded" else ""

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

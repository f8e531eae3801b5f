"""Where MLX's CUDA backend keeps the kernels it compiles on first use: a folder that outlives the process.

MLX CUDA compiles many kernels at run time (NVRTC) and caches their PTX under `MLX_PTX_CACHE_DIR`, by default
the system's temp folder, which a reboot or a fresh container empties. A cold compile is slow: a training
call on the H200 spent ~150 s before its first steps and reached them in ~15 s once a second call shared the
folder, and single inference rounds have stalled 20-90 s on kernels met for the first time. So unless the
user chose a folder, the runtime points MLX at one in our cache, per MLX version and GPU (the entries are named
by kernel and shape only: another GPU's would be wrong). Metal and the CPU compile nothing this way.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from mlx_dspark.adapters.hf.cache import cache_root

ENV = "MLX_PTX_CACHE_DIR"


def default_root() -> Path:
    return cache_root() / "kernels"


def _cuda_identity() -> str | None:
    """ "mlx-<version>-<GPU name>" where MLX runs on CUDA, else None."""
    import mlx.core as mx

    if mx.default_device().type != mx.gpu or not mx.cuda.is_available():
        return None
    name = "cuda"
    with contextlib.suppress(AttributeError, RuntimeError):
        name = str(mx.device_info().get("device_name") or name)
    return f"mlx-{mx.__version__}-{name}"


def ensure_persistent(root: Path | None = None) -> Path | None:
    """Point MLX's CUDA kernel cache at a lasting folder (created) unless `MLX_PTX_CACHE_DIR` is set; returns
    the folder in use, or None off CUDA. Takes effect if no kernel was compiled yet in this process."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    ident = _cuda_identity()
    if ident is None:
        return None
    folder = (root or default_root()) / re.sub(r"[^A-Za-z0-9._-]+", "-", ident)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # MLX keeps its temp folder
    os.environ[ENV] = str(folder)
    return folder

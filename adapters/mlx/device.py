"""Device probes: what MLX runs on, its version, and the active BLAS with a measured GEMM rate."""

from __future__ import annotations

import contextlib
import platform
import statistics
import time
from typing import Any

from mlx_dspark.adapters.mlx.blas import blas_status, ensure_fast_blas


def describe_runtime() -> dict[str, Any]:
    """Device, MLX version and which BLAS fp32 GEMM uses (plus a measured GEMM rate)."""
    status = blas_status() or ensure_fast_blas()
    import mlx.core as mx

    device = mx.default_device()
    info: dict[str, Any] = {
        "device": str(device),
        "device_type": "gpu" if device.type == mx.gpu else "cpu",
        "mlx_version": mx.__version__,
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "blas": status.name,
        "blas_detail": status.detail,
        "metal_available": bool(getattr(mx, "metal", None) and mx.metal.is_available()),
        "cuda_available": bool(getattr(mx, "cuda", None) and mx.cuda.is_available()),
    }
    if device.type == mx.gpu:
        with contextlib.suppress(AttributeError, RuntimeError):
            info["device_info"] = {k: str(v) for k, v in mx.device_info().items()}
    a = mx.random.normal((64, 1024))
    b = mx.random.normal((1024, 1024))
    mx.eval(a, b)
    for _ in range(3):
        mx.eval(a @ b)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t0)
    info["fp32_gemm_gflops"] = round(2 * 64 * 1024 * 1024 / statistics.median(times) / 1e9, 1)
    return info


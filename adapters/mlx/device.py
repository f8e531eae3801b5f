"""Device probes: what MLX runs on, its version, and the active BLAS with a measured GEMM rate."""

from __future__ import annotations

import contextlib
import platform
import statistics
import time
from typing import Any

from mlx_dspark.adapters.mlx.blas import blas_status, ensure_fast_blas


def switch_mode(env: str) -> str:
    """The "auto" | "on" | "off" value of the environment variable `env` (unset or empty: auto).

    Raises:
        ValueError: another value.
    """
    import os

    mode = os.environ.get(env, "auto").strip().lower() or "auto"
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"{env} must be auto, on or off, got {mode!r}")
    return mode


def cuda_switch(env: str) -> bool:
    """An "auto" | "on" | "off" switch read from the environment variable `env`; auto means on where MLX runs on
    CUDA (the accelerator-path switches: key buckets, row products).

    Raises:
        ValueError: another value.
    """
    import mlx.core as mx

    mode = switch_mode(env)
    if mode != "auto":
        return mode == "on"
    return bool(mx.default_device().type == mx.gpu and mx.cuda.is_available())


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


PREFIX_CACHE_FRACTION = 0.25  # of the memory free at start: room for the model's own growth stays


def default_prefix_cache_bytes(fraction: float = PREFIX_CACHE_FRACTION) -> int:
    """The prefix cache's default memory budget: a fraction of what is free for MLX right now.

    GPUs report their recommended working set (device_info); on the CPU it is the OS's available memory.
    """
    import mlx.core as mx

    free = 0
    with contextlib.suppress(AttributeError, RuntimeError, TypeError, ValueError):
        if mx.default_device().type == mx.gpu:
            info = mx.device_info()
            limit = int(info.get("max_recommended_working_set_size") or info.get("memory_size") or 0)
            free = max(limit - mx.get_active_memory(), 0)
    if not free:
        free = _available_host_memory()
    return int(free * fraction)


def _available_host_memory() -> int:
    import os

    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(AttributeError, OSError, ValueError):
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 2  # half of RAM as free
    return 1 << 30

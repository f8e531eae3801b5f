"""The `Runtime` port over MLX: the optimized CPU BLAS swapped in before `mlx.core` loads, a lasting CUDA kernel
cache, and the device report.

Nothing here imports MLX at module level: `prepare` must run before the first `import mlx.core`.
"""

from __future__ import annotations

from typing import Any


class MlxRuntime:
    """The process runtime of every entrypoint (BLAS first, then the facts `doctor` and `bench` report)."""

    def prepare(self) -> str:
        from mlx_dspark.adapters.mlx.blas import ensure_fast_blas
        from mlx_dspark.adapters.mlx.kernel_cache import ensure_persistent

        blas = ensure_fast_blas().name
        ensure_persistent()  # CUDA: compiled kernels kept across processes and reboots
        return blas

    def report(self) -> dict[str, Any]:
        from mlx_dspark.adapters.mlx.device import describe_runtime

        return describe_runtime()

    def calibration_environment(self) -> dict[str, str]:
        """The device and MLX version that key saved calibrations (measured costs hold only there)."""
        import os
        import platform

        import mlx.core as mx

        machine = f"{platform.system()} {platform.machine()} {platform.processor()} cpus={os.cpu_count()}"
        version = str(getattr(mx, "__version__", "unknown"))
        device = f"{mx.default_device()} on {machine}"
        if mx.default_device().type == mx.cpu:
            # The CPU's costs are the BLAS's: a new shim (its file is named by its source) measures anew.
            from mlx_dspark.adapters.mlx.blas import blas_status

            status = blas_status()
            if status is not None:
                device += f" blas={status.name}:{os.path.basename(status.detail)}"
        return {"device": device, "mlx_version": version}

    def compiles_kernels(self) -> bool:
        """Metal and CUDA build kernels on first use (JIT, pipeline states); MLX's CPU backend does not."""
        import mlx.core as mx

        return bool(mx.default_device().type == mx.gpu)

"""Memory facts and a bandwidth benchmark through MLX: usable memory, memory in use, model bytes, copy GB/s.

Usable memory is Metal's recommended working set on a Mac (mx.device_info) and the kernel's MemAvailable
elsewhere. Measurements (bandwidth) must run on the engine thread like every other MLX call.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from typing import Any


class MlxMachineProbe:
    """The MachineProbe port."""

    def usable_memory(self) -> dict[str, Any]:
        import mlx.core as mx

        with contextlib.suppress(AttributeError, RuntimeError, TypeError, ValueError):
            if mx.default_device().type == mx.gpu:
                info = mx.device_info()
                for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
                    if info.get(key):
                        return {"bytes": int(info[key]), "source": f"mx.device_info()['{key}']"}
        available = _meminfo("MemAvailable")
        if available:
            return {"bytes": available, "source": "MemAvailable (/proc/meminfo)"}
        with contextlib.suppress(AttributeError, ValueError, OSError):
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return {"bytes": int(total), "source": "physical memory (sysconf)"}
        return {"bytes": 0, "source": "unknown"}

    def memory_in_use(self) -> dict[str, int]:
        import mlx.core as mx

        out = {"active": 0, "peak": 0, "cache": 0}
        for key, fn in (("active", "get_active_memory"), ("peak", "get_peak_memory"), ("cache", "get_cache_memory")):
            with contextlib.suppress(AttributeError, RuntimeError):
                out[key] = int(getattr(mx, fn)())
        return out

    def model_bytes(self, handle: Any) -> int:
        from mlx.utils import tree_flatten

        module = getattr(handle, "model", handle)
        params = getattr(module, "parameters", None)
        if params is None:
            return 0
        try:
            return int(sum(v.nbytes for _, v in tree_flatten(params())))
        except (AttributeError, TypeError):
            return 0

    def bandwidth(self, size_bytes: int = 256 << 20, repeats: int = 7) -> dict[str, Any]:
        """Bytes of weights read per second by a one-row product over a `size_bytes` float32 matrix: the very
        access a plain decoding step makes (an elementwise copy runs on one core of MLX's CPU backend, while
        the BLAS's matrix-vector product uses every core, so a copy understated the ceiling by 2x there)."""
        import mlx.core as mx

        cols = 4096
        rows = max(size_bytes // (4 * cols), 8)
        matrix = mx.ones((rows, cols), dtype=mx.float32)
        x = mx.ones((1, rows), dtype=mx.float32)
        mx.eval(matrix, x)
        mx.eval(x @ matrix)  # warm-up: allocation and kernel compile
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(x @ matrix)
            samples.append(time.perf_counter() - t0)
        median = statistics.median(samples)
        return {
            "bytes_per_s": matrix.nbytes / median,
            "size": matrix.nbytes,
            "samples_s": samples,
            "device": device_label(),
        }


def device_label() -> str:
    """The device as a person reads it: "CPU (x86_64)", "GPU (NVIDIA H200)", "GPU (Apple M3 Max)"."""
    import mlx.core as mx

    if mx.default_device().type != mx.gpu:
        return f"CPU ({platform.machine() or 'unknown'})"
    name = ""
    with contextlib.suppress(AttributeError, RuntimeError):
        name = str(mx.device_info().get("device_name", ""))
    return f"GPU ({name})" if name else "GPU"


def _meminfo(field: str) -> int:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0

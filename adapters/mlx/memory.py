"""Memory facts and a bandwidth benchmark through MLX: usable memory, memory in use, model bytes, copy GB/s.

Usable memory is Metal's recommended working set on a Mac (mx.device_info) and the kernel's MemAvailable
elsewhere. Measurements (bandwidth) must run on the engine thread like every other MLX call.
"""

from __future__ import annotations

import contextlib
import os
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

    def bandwidth(self, size_bytes: int = 256 << 20, repeats: int = 5) -> dict[str, Any]:
        """Bytes moved per second by an on-device copy (each copy reads and writes `size_bytes`)."""
        import mlx.core as mx

        n = max(size_bytes // 4, 1024)
        src = mx.ones((n,), dtype=mx.float32)
        mx.eval(src)
        mx.eval(src + 0)  # warm-up: allocation and kernel compile
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = src + 0  # reads n floats, writes n floats
            mx.eval(out)
            samples.append(time.perf_counter() - t0)
            del out
        median = statistics.median(samples)
        return {
            "bytes_per_s": 2 * n * 4 / median,
            "size": n * 4,
            "samples_s": samples,
            "device": str(mx.default_device()),
        }


def _meminfo(field: str) -> int:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0

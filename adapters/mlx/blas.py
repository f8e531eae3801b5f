"""Make MLX's fp32 GEMM use an optimized BLAS on Linux CPU (the mlx-cpu wheel bundles reference BLAS).

Must run before the first `import mlx.core` of the process: a globally loaded `cblas_sgemm` then wins over
the wheel's own. Harmless elsewhere: it only acts when the reference BLAS is what MLX would use.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import attrs

SHIM_SOURCE = """\
/* Forwards cblas_sgemm to the OpenBLAS that the scipy-openblas32 wheel ships (symbols prefixed scipy_). */
extern void scipy_cblas_sgemm(int, int, int, int, int, int, float, const float *, int,
                              const float *, int, float, float *, int);
void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  scipy_cblas_sgemm(o, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
"""

SYSTEM_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


@attrs.frozen
class BlasStatus:
    """Which BLAS MLX's fp32 GEMM will call.

    Attributes:
        name: "native" (MLX links no reference BLAS: Accelerate on macOS, GPU builds), "openblas-shim",
            "system-openblas", or "reference" (slow; speculation cannot win).
        detail: a path or the reason for a fallback.
    """

    name: str
    detail: str

    @property
    def fast(self) -> bool:
        return self.name != "reference"


_status: BlasStatus | None = None


def _reference_blas_bundled() -> bool:
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return False
    # Several locations when a stray `mlx` folder shadows part of the namespace; check them all.
    return any(
        glob.glob(str(Path(loc).parent / "mlx_cpu.libs" / "libblas-*.so*")) for loc in spec.submodule_search_locations
    )


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-dspark" / "blas"


def _openblas32_lib() -> Path | None:
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("lib/libscipy_openblas*.so*"))
    return libs[0] if libs else None


def _build_shim(openblas: Path) -> Path:
    """Compile the forwarding shim once per OpenBLAS build; written atomically into the cache."""
    key = hashlib.sha256((SHIM_SOURCE + str(openblas) + str(openblas.stat().st_size)).encode()).hexdigest()[:16]
    out = _cache_dir() / f"libsgemm_shim-{key}.so"
    if out.exists():
        return out
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc/gcc) to build the BLAS shim")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "shim.c"
        src.write_text(SHIM_SOURCE)
        built = Path(tmp) / out.name
        subprocess.run(
            [
                compiler,
                "-O2",
                "-shared",
                "-fPIC",
                "-o",
                str(built),
                str(src),
                str(openblas),
                f"-Wl,-rpath,{openblas.parent}",
            ],
            check=True,
            capture_output=True,
        )
        os.replace(built, out)
    return out


THREAD_TIMEOUT = "4"  # OpenBLAS: idle workers sleep after 2**4 cycles instead of 2**28


def ensure_fast_blas() -> BlasStatus:
    """Load an optimized `cblas_sgemm` globally if MLX would otherwise use reference BLAS.

    Chosen by MLX_DSPARK_BLAS: "auto" (default: the scipy-openblas32 shim, else system OpenBLAS),
    "shim", "system" or "none". Falls back with a warning, never fails.
    """
    global _status  # noqa: PLW0603 - once per process, like the dynamic loader itself
    if _status is not None:
        return _status
    choice = os.environ.get("MLX_DSPARK_BLAS", "auto").lower()
    # OpenBLAS workers spin ~0.1 s after each GEMM; between MLX's many small ops and NumPy's (cpu_kernels)
    # that spinning takes one of few cores (measured: a decoder layer's prefill chunk 130 -> 94 ms).
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    if not _reference_blas_bundled():
        _status = BlasStatus("native", "MLX does not bundle reference BLAS here")
        return _status
    if "mlx.core" in sys.modules:
        _status = BlasStatus("reference", "mlx.core was imported before the BLAS could be swapped")
        warnings.warn(_status.detail, RuntimeWarning, stacklevel=2)
        return _status
    errors: list[str] = []
    if choice in {"auto", "shim"}:
        lib = _openblas32_lib()
        if lib is None:
            errors.append("scipy-openblas32 is not installed")
        else:
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                shim = _build_shim(lib)
                ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
                _status = BlasStatus("openblas-shim", str(shim))
                return _status
            except (OSError, subprocess.CalledProcessError) as exc:
                errors.append(f"shim: {exc}")
    if choice in {"auto", "system"}:
        for path in SYSTEM_OPENBLAS:
            if Path(path).exists():
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    _status = BlasStatus("system-openblas", path)
                    return _status
                except OSError as exc:
                    errors.append(f"system: {exc}")
        errors.append("no system OpenBLAS found")
    if choice == "none":
        _status = BlasStatus("reference", "disabled by MLX_DSPARK_BLAS=none")
        return _status
    _status = BlasStatus("reference", "; ".join(errors) or f"unknown MLX_DSPARK_BLAS={choice!r}")
    warnings.warn(
        f"MLX will use reference BLAS (multi-token forwards cost ~k single ones): {_status.detail}",
        RuntimeWarning,
        stacklevel=2,
    )
    return _status


def blas_status() -> BlasStatus | None:
    """What ensure_fast_blas decided in this process (None if it was never called)."""
    return _status

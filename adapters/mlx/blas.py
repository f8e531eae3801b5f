"""Make MLX's fp32 GEMM use an optimized BLAS on Linux CPU (the mlx-cpu wheel bundles reference BLAS).

Must run before the first `import mlx.core` of the process: a globally loaded `cblas_sgemm` then wins over
the wheel's own. Harmless elsewhere: it only acts when the reference BLAS is what MLX would use.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import attrs

from mlx_dspark.adapters.hf.cache import cache_root

SHIM_SOURCE = r"""
/* Forwards cblas_sgemm to the OpenBLAS that the scipy-openblas32 wheel ships (symbols prefixed scipy_), with
   two faster paths for the few-row products of decoding (x @ W.T, W [n, k] row-major):

   - FEW_ROWS rows or fewer: our own kernel. OpenBLAS's GEMM packs the whole weight on every call, which at
     1-16 rows costs more than the product (3-10x on SmolLM2's projections); this reads it once, keeps every
     row's LANES partial sums in registers, and sums each (row, column) in the same order whatever the number
     of rows: a verify's rows equal a one-token step's bit for bit.
   - One row in another layout: OpenBLAS's GEMV, 3-4x its GEMM.

   Products of a few columns (k < MIN_K: a depthwise convolution's window) keep the GEMM, whose sums do not
   depend on the number of rows either. */
#include <string.h>
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
#endif
extern void scipy_cblas_sgemm(int, int, int, int, int, int, float, const float *, int,
                              const float *, int, float, float *, int);
extern void scipy_cblas_sgemv(int, int, int, int, float, const float *, int, const float *, int, float, float *,
                              int);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, FEW_ROWS = 16, MIN_K = 64 };
#define PARALLEL_FLOATS 65536L /* weight floats a thread: below two of these one thread runs (a fork costs more) */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline float lanes_sum(vf v) { float s = 0.0f; for (int j = 0; j < LANES; j++) s += v[j]; return s; }

/* MR rows of x against NR rows of w: y[i, j] = x[i] . w[j], every pair summed in one fixed order. */
#define TILE(MR, NR)                                                                                          \
  static void tile_##MR##_##NR(int k, const float *x, int lda, const float *w, int ldb, float *y, int ldc) { \
    vf acc[MR][NR];                                                                                         \
    for (int i = 0; i < MR; i++)                                                                            \
      for (int j = 0; j < NR; j++) acc[i][j] = (vf){0};                                                     \
    int t = 0;                                                                                              \
    for (; t + LANES <= k; t += LANES) {                                                                    \
      vf wv[NR];                                                                                            \
      for (int j = 0; j < NR; j++) {                                                                        \
        wv[j] = load(w + (size_t)j * ldb + t);                                                              \
        __builtin_prefetch(w + (size_t)j * ldb + t + 8 * LANES);                                            \
      }                                                                                                     \
      for (int i = 0; i < MR; i++) {                                                                        \
        vf xv = load(x + (size_t)i * lda + t);                                                              \
        for (int j = 0; j < NR; j++) acc[i][j] += xv * wv[j];                                               \
      }                                                                                                     \
    }                                                                                                       \
    for (int i = 0; i < MR; i++)                                                                            \
      for (int j = 0; j < NR; j++) {                                                                        \
        float s = lanes_sum(acc[i][j]);                                                                     \
        for (int u = t; u < k; u++) s += x[(size_t)i * lda + u] * w[(size_t)j * ldb + u];                   \
        y[(size_t)i * ldc + j] = s;                                                                         \
      }                                                                                                     \
  }
TILE(1, 8) TILE(2, 4) TILE(3, 4) TILE(4, 4) TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1)
typedef void (*tile_fn)(int, const float *, int, const float *, int, float *, int);
static const tile_fn ONE[5] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1};
#if LANES == 16
/* AVX-512's 32 registers hold wider tiles for a product of 2-4 rows: more sums a weight load (a 4-row product
   of the 1.5B's 8960x1536 weight on a 2-core EPYC: 2.1-2.2 -> 1.4-1.6 ms; its 151936-row head at 2 rows: 34-43
   -> 29-30 ms). AVX2's 16 would spill them. */
TILE(2, 8) TILE(3, 6) TILE(4, 6) TILE(1, 6) TILE(2, 6)
static const tile_fn FEW[5] = {0, tile_1_8, tile_2_8, tile_3_6, tile_4_6};
static const int FEW_WIDTH[5] = {0, 8, 8, 6, 6};
enum { BLOCK = 6 }; /* weight rows a block of a product of more rows (5-16: 2.8 -> 2.0 ms at 5 rows, as above) */
static const tile_fn GROUP[5] = {0, tile_1_6, tile_2_6, tile_3_6, tile_4_6};
#else
static const tile_fn FEW[5] = {0, tile_1_8, tile_2_4, tile_3_4, tile_4_4};
static const int FEW_WIDTH[5] = {0, 8, 4, 4, 4};
enum { BLOCK = 4 };
static const tile_fn GROUP[5] = {0, 0, tile_2_4, tile_3_4, tile_4_4}; /* one row: 4 one-column tiles */
#endif

/* Blocks of BLOCK weight rows outside, groups of 4 x rows inside: a block comes from memory once and from the cache
   for every later group (groups outside read the whole weight once a group: a 5-row product cost 1.6x a 4-row one
   on the 1.5B). Every (row, column) is summed by the same code in the same order whichever tile holds it. */
static void columns(int m, int n0, int n1, int k, const float *x, int lda, const float *w, int ldb, float *y,
                    int ldc) {
  int j = n0;
  if (m <= 4) { /* one group: its widest tile */
    int nr = FEW_WIDTH[m];
    for (; j + nr <= n1; j += nr) FEW[m](k, x, lda, w + (size_t)j * ldb, ldb, y + j, ldc);
  } else
    for (; j + BLOCK <= n1; j += BLOCK)
      for (int i = 0; i < m; i += 4) {
        int mr = m - i < 4 ? m - i : 4;
        const float *xi = x + (size_t)i * lda;
        float *yi = y + (size_t)i * ldc;
        if (GROUP[mr] == 0)
          for (int jj = j; jj < j + BLOCK; jj++) tile_1_1(k, xi, lda, w + (size_t)jj * ldb, ldb, yi + jj, ldc);
        else
          GROUP[mr](k, xi, lda, w + (size_t)j * ldb, ldb, yi + j, ldc);
      }
  for (; j < n1; j++)
    for (int i = 0; i < m; i += 4) {
      int mr = m - i < 4 ? m - i : 4;
      ONE[mr](k, x + (size_t)i * lda, lda, w + (size_t)j * ldb, ldb, y + (size_t)i * ldc + j, ldc);
    }
}

long mlx_dspark_few_rows = 0; /* products served by the kernel (read by the tests) */

static void few_rows(int m, int n, int k, const float *x, int lda, const float *w, int ldb, float *y, int ldc) {
  __atomic_fetch_add(&mlx_dspark_few_rows, 1, __ATOMIC_RELAXED);
#ifdef _OPENMP
  /* A thread per PARALLEL_FLOATS of weight at most: on a many-core host a small projection is not worth 64 forks. */
  long want = (long)n * k / PARALLEL_FLOATS, cap = omp_get_max_threads();
  int threads = (int)(want < cap ? want : cap);
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      int t = omp_get_thread_num(), nt = omp_get_num_threads();
      int per = ((n + nt - 1) / nt + 7) & ~7;
      int n0 = t * per, n1 = n0 + per > n ? n : n0 + per;
      if (n0 < n1) columns(m, n0, n1, k, x, lda, w, ldb, y, ldc);
    }
    return;
  }
#endif
  columns(m, 0, n, k, x, lda, w, ldb, y, ldc);
}

void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
  if (o == ROW_MAJOR && k >= MIN_K && m >= 1 && m <= FEW_ROWS) {
    if (ta == NO_TRANS && tb == TRANS && alpha == 1.0f && beta == 0.0f) {
      few_rows(m, n, k, a, lda, b, ldb, c, ldc);
      return;
    }
    if (m == 1) { /* c = alpha a op(b) + beta c; a's k values at stride 1 (lda when transposed) */
      int inc = ta == NO_TRANS ? 1 : lda;
      if (tb == TRANS)
        scipy_cblas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc, beta, c, 1);
      else
        scipy_cblas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc, beta, c, 1);
      return;
    }
  }
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
    return cache_root() / "blas"


def _openblas32_lib() -> Path | None:
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = sorted(Path(next(iter(spec.submodule_search_locations))).glob("lib/libscipy_openblas*.so*"))
    return libs[0] if libs else None


def _cpu_identity() -> str:
    """What `-march=native` compiled for: a shim built on another CPU (a shared home) must not be reused."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    return platform.machine() + flags


# The kernel's flags, then fallbacks: no OpenMP (one thread), then the compiler's default target.
_FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O2"])


def _build_shim(openblas: Path) -> Path:
    """Compile the forwarding shim once per OpenBLAS build and CPU; written atomically into the cache."""
    ident = SHIM_SOURCE + str(openblas) + str(openblas.stat().st_size) + _cpu_identity()
    out = _cache_dir() / f"libsgemm_shim-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.so"
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
        for i, flags in enumerate(_FLAG_SETS):
            cmd = [compiler, *flags, "-shared", "-fPIC", "-o", str(built), str(src), str(openblas)]
            try:
                subprocess.run([*cmd, f"-Wl,-rpath,{openblas.parent}"], check=True, capture_output=True)
                break
            except subprocess.CalledProcessError:
                if i == len(_FLAG_SETS) - 1:
                    raise
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

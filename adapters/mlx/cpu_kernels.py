"""CPU-device kernels for wide forwards: NumPy's vectorised `exp` instead of MLX's scalar one.

MLX's CPU backend evaluates transcendental functions one element at a time (~25-30 ns each on the 2-core
dev machine), so a prefill chunk spends most of its time in attention's softmax and the MLP's SiLU
(measured per 512-token chunk and layer at 4k context: 0.74 s of CPU for MLX's SDPA against 0.27 s here;
SiLU 24 ms against ~4 ms). While the target runs a forward (`active()`), on the CPU device only, for
float32 and above a size where the host round trip pays, these calls go through NumPy:
`mx.fast.scaled_dot_product_attention` (no mask or the "causal" mask, no sinks) and mlx-lm's `swiglu`
in the model's own modules (`install`). Everything else goes to MLX unchanged; GPUs never see it.

Both kernels split their work over one worker thread per core (NumPy's exp, reductions and small GEMMs
otherwise run on one core; OpenBLAS runs a GEMM this small on one thread anyway): each worker sets its
own OpenBLAS to one thread, so two workers never share a BLAS pool. Results equal MLX's within float32
rounding (tests bound the difference). Plain steps (one query row)
stay on MLX while wider verifies may not: like any change of GEMM shape, the two paths can round a near
tie differently at long contexts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

MIN_SWIGLU = 1 << 16  # gate elements below which MLX's own SiLU is as fast
MIN_SCORES = 1 << 18  # query rows x keys x heads below which MLX's own kernel is as fast
QUERY_TILE = 64  # query rows per NumPy tile: its scores stay in the last-level cache
MAX_WORKERS = 8  # attention worker threads at most (one per core below that)

_ORIGINAL = mx.fast.scaled_dot_product_attention
_state = threading.local()


def applies(q: Any, k: Any, mask: Any, sinks: Any) -> bool:
    """Whether this call takes the NumPy path."""
    if sinks is not None or not (mask is None or (isinstance(mask, str) and mask == "causal")):
        return False
    if q.dtype != mx.float32 or k.dtype != mx.float32 or q.ndim != 4:
        return False
    b, h, lq, _ = q.shape
    # One query row (a plain step) stays on MLX: the host round trip would stall its queued next step.
    return lq > 1 and b * h * lq * int(k.shape[2]) >= MIN_SCORES


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, causal: bool) -> mx.array:
    """Softmax(q k^T * scale) v for q [B, Hq, Lq, D], k/v [B, Hk, Lk, D] (Hq a multiple of Hk).

    The causal mask is aligned bottom-right, as MLX's: query i sees keys up to Lk - Lq + i. Keys past a
    tile's last query are never multiplied. Tiles (a key head's query heads x QUERY_TILE rows) are
    independent and spread over the cores, each worker with a single-threaded BLAS: a tile's GEMMs are
    small, and NumPy's exp and reductions run on one core.
    """
    qn = np.asarray(q)
    kn = np.asarray(k)
    vn = np.asarray(v)
    b, hq, lq, _ = qn.shape
    hk = kn.shape[1]
    out = np.empty((b, hq, lq, vn.shape[3]), dtype=np.float32)
    tiles = [(bi, h, start) for bi in range(b) for h in range(hk) for start in range(0, lq, QUERY_TILE)]
    work = _Tiles(qn, kn, vn, out, np.float32(scale), causal)
    pool = _pool()
    if pool is None or len(tiles) < 2:
        work.run(tiles)
    else:
        # Strided shares balance causal tiles, whose key ranges grow with the query row.
        n = min(pool.workers, len(tiles))
        for done in [pool.executor.submit(work.run, tiles[i::n]) for i in range(n)]:
            done.result()
    return mx.array(out)


class _Tiles:
    """One attention call's arrays; `run` fills the output rows of the given tiles."""

    def __init__(
        self, qn: np.ndarray, kn: np.ndarray, vn: np.ndarray, out: np.ndarray, scale: np.float32, causal: bool
    ) -> None:
        self.qn, self.kn, self.vn, self.out, self.scale, self.causal = qn, kn, vn, out, scale, causal
        self.group = qn.shape[1] // kn.shape[1]

    def run(self, tiles: list[tuple[int, int, int]]) -> None:
        qn, kn, vn, group = self.qn, self.kn, self.vn, self.group
        lq, d, lk = qn.shape[2], qn.shape[3], kn.shape[2]
        offset = lk - lq
        for bi, h, start in tiles:
            keys, values = kn[bi, h], vn[bi, h]
            heads = qn[bi, h * group : (h + 1) * group]  # [group, Lq, D]: the query heads sharing these keys
            stop = min(start + QUERY_TILE, lq)
            tile = stop - start
            end = offset + stop if self.causal else lk  # keys any query of this tile may see
            queries = (heads[:, start:stop] * self.scale).reshape(group * tile, d)
            scores = (queries @ keys[:end].T).reshape(group, tile, end)  # one GEMM for the group
            if self.causal:
                rows = np.arange(offset + start, offset + stop)[:, None]
                cols = np.arange(end - tile, end)[None, :]
                scores[:, :, end - tile :][:, cols > rows] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            total = scores.sum(axis=-1, keepdims=True)
            block = (scores.reshape(group * tile, end) @ values[:end]).reshape(group, tile, -1)
            block /= total
            self.out[bi, h * group : (h + 1) * group, start:stop] = block


class _Pool:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="mlx-dspark-attention", initializer=_one_blas_thread
        )


_POOL: list[_Pool | None] = []
_POOL_LOCK = threading.Lock()


def _after_fork() -> None:
    """A forked child has none of the parent's workers (and maybe a held lock): it starts its own."""
    global _POOL_LOCK  # noqa: PLW0603 - reset once per forked process
    _POOL_LOCK = threading.Lock()
    _POOL.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _pool() -> _Pool | None:
    """The attention workers, one per usable core (None on one core)."""
    with _POOL_LOCK:
        if not _POOL:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            _POOL.append(_Pool(min(cores, MAX_WORKERS)) if cores > 1 else None)
        return _POOL[0]


def _one_blas_thread() -> None:
    """This worker's NumPy GEMMs run in the worker itself (OpenBLAS's per-thread setting, where it has one)."""
    for lib in _numpy_openblas():
        fn = getattr(lib, "openblas_set_num_threads_local", None)
        if fn is not None:
            fn(1)


def _numpy_openblas() -> list[ctypes.CDLL]:
    root = Path(np.__file__).parent.parent
    libs = []
    for path in sorted((root / "numpy.libs").glob("libscipy_openblas*.so*")) + sorted(
        (root / "numpy" / ".dylibs").glob("libscipy_openblas*.dylib")
    ):
        with contextlib.suppress(OSError):
            libs.append(ctypes.CDLL(str(path)))
    return libs


def _sdpa(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any = None,
    sinks: Any = None,
    **kwargs: Any,
) -> mx.array:
    if kwargs or getattr(_state, "depth", 0) == 0 or not applies(q, k, mask, sinks):
        return _ORIGINAL(q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs)
    return attention(q, k, v, scale=scale, causal=mask is not None)


def _numpy_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    g = np.asarray(gate).reshape(-1, gate.shape[-1])
    xs = np.asarray(x).reshape(-1, x.shape[-1])
    out = np.empty_like(g)

    def rows(part: slice) -> None:
        o = out[part]
        np.exp(-g[part], out=o)
        o += 1
        np.divide(g[part], o, out=o)  # silu(g) = g / (1 + e^-g)
        o *= xs[part]

    pool = _pool()
    if pool is None or g.shape[0] < 2:
        rows(slice(None))
    else:
        n = min(pool.workers, g.shape[0])
        step = -(-g.shape[0] // n)
        for done in [pool.executor.submit(rows, slice(i, i + step)) for i in range(0, g.shape[0], step)]:
            done.result()
    return mx.array(out.reshape(gate.shape))


def _swiglu_for(original: Any) -> Any:
    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if (
            getattr(_state, "depth", 0) == 0
            or gate.dtype != mx.float32
            or x.dtype != mx.float32
            or gate.shape != x.shape
            or gate.size < MIN_SWIGLU
        ):
            return original(gate, x)
        return _numpy_swiglu(gate, x)

    swiglu.__wrapped__ = original  # type: ignore[attr-defined]
    return swiglu


def install(model: Any) -> None:
    """Route MLX's SDPA and the `swiglu` of `model`'s own mlx-lm modules through the wrappers (idempotent;
    CPU only). The wrappers hand every call outside `active()` to MLX unchanged (any thread, mlx-lm's own
    generate in the same process)."""
    if not on_cpu():
        return
    mx.fast.scaled_dot_product_attention = _sdpa
    names = {type(model).__module__}
    for layer in getattr(getattr(model, "model", model), "layers", None) or ():
        names.add(type(layer).__module__)
        mlp = getattr(layer, "mlp", None)
        if mlp is not None:
            names.add(type(mlp).__module__)
    for name in names:
        module = sys.modules.get(name)
        current = getattr(module, "swiglu", None)
        if module is None or current is None or hasattr(current, "__wrapped__"):
            continue
        module.swiglu = _swiglu_for(current)  # type: ignore[attr-defined]


def on_cpu() -> bool:
    return bool(mx.default_device() == mx.cpu)


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Serve the installed wrappers' wide calls through NumPy on this thread while the block runs."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth

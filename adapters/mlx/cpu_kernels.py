"""CPU-device kernels for wide forwards: vectorised `exp` instead of MLX's scalar one, and RoPE from one table.

MLX's CPU backend evaluates transcendental functions one element at a time (~25-30 ns each on the 2-core
dev machine), so a prefill chunk spends most of its time in attention's softmax, the MLP's SiLU and RoPE's
cos/sin, not in its GEMMs. While the target runs a forward (`active()`), on the CPU device only, for
float32 and above a size where the host round trip pays, these calls are served here:
`mx.fast.scaled_dot_product_attention` (no mask or the "causal" mask, no sinks) and mlx-lm's `swiglu` in the
model's own modules (`install`) go through NumPy GEMMs with numba-compiled softmax and SiLU loops
(`cpu_jit`; NumPy's own `exp` where numba is missing), and `mx.fast.rope` with an int offset rotates by one
cos/sin table per chunk that MLX's own kernel computes (bit for bit what it would use). Everything else goes
to MLX unchanged; GPUs never see it.

Attention and SwiGLU split their work over one worker thread per core (NumPy's reductions and small GEMMs
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
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

MIN_SWIGLU = 1 << 16  # gate elements below which MLX's own SiLU is as fast
MIN_SCORES = 1 << 18  # query rows x keys x heads below which MLX's own kernel is as fast
MIN_ROPE = 1 << 15  # rotated elements below which MLX's own RoPE is as fast
QUERY_TILE = 64  # query rows per NumPy tile: its scores stay in the last-level cache
MAX_WORKERS = 8  # attention worker threads at most (one per core below that)

_ORIGINAL = mx.fast.scaled_dot_product_attention
_ORIGINAL_ROPE = mx.fast.rope
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
        self.jit = jit()

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
            if self.jit is not None:
                # One GEMM for the group into this worker's scratch (a fresh buffer costs page faults).
                scores = _scratch(group * tile * end).reshape(group * tile, end)
                np.matmul(queries, keys[:end].T, out=scores)
                diag = end - tile if self.causal else end  # columns every row of the tile sees
                seen = scores[:, :diag].max(axis=1) if diag else np.full(group * tile, -np.inf, np.float32)
                totals = np.empty(group * tile, dtype=np.float32)
                self.jit.softmax_rows(scores, seen, diag, tile, self.causal, totals)
            else:
                scores = queries @ keys[:end].T  # one GEMM for the group
                if self.causal:
                    rows = np.arange(offset + start, offset + stop)[:, None]
                    cols = np.arange(end - tile, end)[None, :]
                    scores.reshape(group, tile, end)[:, :, end - tile :][:, cols > rows] = -np.inf
                scores -= scores.max(axis=-1, keepdims=True)
                np.exp(scores, out=scores)
                totals = scores.sum(axis=-1)
            block = scores @ values[:end]
            block /= totals[:, None]
            self.out[bi, h * group : (h + 1) * group, start:stop] = block.reshape(group, tile, -1)


_SCRATCH = threading.local()


def _scratch(size: int) -> np.ndarray:
    """This thread's reusable float32 buffer of at least `size` elements (grown, never shrunk, while a
    forward runs on it)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < size:
        buf = _SCRATCH.buf = np.empty(size, dtype=np.float32)
    return buf[:size]


_JIT: list[Any] = []
_JIT_LOCK = threading.Lock()
_WARMING: list[threading.Thread] = []


def jit() -> Any:
    """`cpu_jit`'s compiled loops, loaded once per process; None where numba is missing or fails to build
    for this CPU (the NumPy path serves then, with a warning)."""
    with _JIT_LOCK:
        if not _JIT:
            loops = None
            try:
                from mlx_dspark.adapters.mlx import cpu_jit

                cpu_jit.warm()
                loops = cpu_jit
            except Exception as exc:  # ImportError, or LLVM refusing this CPU
                warnings.warn(f"CPU kernels without numba ({exc!r}): NumPy's exp serves", RuntimeWarning, stacklevel=2)
            _JIT.append(loops)
        return _JIT[0]


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
    global _POOL_LOCK, _JIT_LOCK  # noqa: PLW0603 - reset once per forked process
    _POOL_LOCK = threading.Lock()
    _JIT_LOCK = threading.Lock()
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


def _rope(
    a: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float | None,
    scale: float,
    offset: Any,
    freqs: Any = None,
    **kwargs: Any,
) -> mx.array:
    if (
        kwargs
        or getattr(_state, "depth", 0) == 0
        or not isinstance(offset, int)  # per-row offsets (a batch) stay on MLX
        or a.dtype != mx.float32
        or a.ndim < 3
        or dims % 2
        or a.size < MIN_ROPE
    ):
        return _ORIGINAL_ROPE(a, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
    cos, sin = _rope_table(a.ndim, a.shape[-2], dims, traditional, base, scale, offset, freqs)
    half = dims // 2
    if traditional:  # rotates consecutive pairs
        pairs = a[..., :dims].reshape(*a.shape[:-1], half, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rotated = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(*a.shape[:-1], dims)
    else:  # rotates the first half against the second
        x1, x2 = a[..., :half], a[..., half:dims]
        rotated = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rotated if dims == a.shape[-1] else mx.concatenate([rotated, a[..., dims:]], axis=-1)


def _rope_table(
    ndim: int, length: int, dims: int, traditional: bool, base: float | None, scale: float, offset: int, freqs: Any
) -> tuple[mx.array, mx.array]:
    """cos and sin of this chunk's angles, [1, ..., length, dims / 2], from MLX's own kernel (so its exact
    bits): it rotates (1, 0) pairs. Every layer of a forward asks for the same table, q and k alike."""
    key = (ndim, length, dims, traditional, base, scale, offset)
    cached = getattr(_state, "rope", None)
    if cached is not None and cached[0] == key and cached[1] is freqs:
        return cached[2]
    half = dims // 2
    ones, zeros = mx.ones((length, half, 1)), mx.zeros((length, half, 1))
    unit = mx.concatenate([ones, zeros], axis=-1 if traditional else 1).reshape(*([1] * (ndim - 2)), length, dims)
    both = _ORIGINAL_ROPE(unit, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
    if traditional:
        pairs = both.reshape(*both.shape[:-1], half, 2)
        table = (pairs[..., 0], pairs[..., 1])
    else:
        table = (both[..., :half], both[..., half:])
    _state.rope = (key, freqs, table)
    return table


def _numpy_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    g = np.asarray(gate).reshape(-1, gate.shape[-1])
    xs = np.asarray(x).reshape(-1, x.shape[-1])
    out = np.empty_like(g)

    loops = jit()

    def rows(part: slice) -> None:
        o = out[part]
        if loops is not None:
            loops.swiglu(g[part].reshape(-1), xs[part].reshape(-1), o.reshape(-1))
            return
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
    if not _JIT and not _WARMING:  # numba and its cached loops (~1 s) load beside the model, not in a prefill
        _WARMING.append(threading.Thread(target=jit, name="mlx-dspark-jit", daemon=True))
        _WARMING[0].start()
    mx.fast.scaled_dot_product_attention = _sdpa
    mx.fast.rope = _rope
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

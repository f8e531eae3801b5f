"""CPU-device kernels for wide forwards: NumPy's vectorised `exp` instead of MLX's scalar one.

MLX's CPU backend evaluates transcendental functions one element at a time (~25-30 ns each on the 2-core
dev machine), so a prefill chunk spends most of its time in attention's softmax and the MLP's SiLU
(measured per 512-token chunk and layer at 4k context: 0.74 s of CPU for MLX's SDPA against 0.27 s here;
SiLU 24 ms against ~4 ms). While the target runs a forward (`active()`), on the CPU device only, for
float32 and above a size where the host round trip pays, these calls go through NumPy:
`mx.fast.scaled_dot_product_attention` (no mask or the "causal" mask, no sinks) and mlx-lm's `swiglu`
in the model's own modules (`install`). Everything else goes to MLX unchanged; GPUs never see it.

Results equal MLX's within float32 rounding (tests bound the difference). Plain steps (one query row)
stay on MLX while wider verifies may not: like any change of GEMM shape, the two paths can round a near
tie differently at long contexts.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np

MIN_SWIGLU = 1 << 16  # gate elements below which MLX's own SiLU is as fast
MIN_SCORES = 1 << 18  # query rows x keys x heads below which MLX's own kernel is as fast
QUERY_TILE = 64  # query rows per NumPy tile: its scores stay in the last-level cache

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
    tile's last query are never multiplied.
    """
    qn = np.asarray(q)
    kn = np.asarray(k)
    vn = np.asarray(v)
    b, hq, lq, d = qn.shape
    hk, lk = kn.shape[1], kn.shape[2]
    group = hq // hk
    out = np.empty((b, hq, lq, vn.shape[3]), dtype=np.float32)
    offset = lk - lq
    scale32 = np.float32(scale)
    for bi in range(b):
        for h in range(hk):
            keys, values = kn[bi, h], vn[bi, h]
            heads = qn[bi, h * group : (h + 1) * group]  # [group, Lq, D]: the query heads sharing these keys
            for start in range(0, lq, QUERY_TILE):
                stop = min(start + QUERY_TILE, lq)
                tile = stop - start
                end = offset + stop if causal else lk  # keys any query of this tile may see
                queries = (heads[:, start:stop] * scale32).reshape(group * tile, d)
                scores = (queries @ keys[:end].T).reshape(group, tile, end)  # one GEMM for the group
                if causal:
                    rows = np.arange(offset + start, offset + stop)[:, None]
                    cols = np.arange(end - tile, end)[None, :]
                    scores[:, :, end - tile :][:, cols > rows] = -np.inf
                scores -= scores.max(axis=-1, keepdims=True)
                np.exp(scores, out=scores)
                total = scores.sum(axis=-1, keepdims=True)
                block = (scores.reshape(group * tile, end) @ values[:end]).reshape(group, tile, -1)
                block /= total
                out[bi, h * group : (h + 1) * group, start:stop] = block
    return mx.array(out)


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
    g = np.asarray(gate)
    out = np.exp(-g)
    out += 1
    np.divide(g, out, out=out)  # silu(g) = g / (1 + e^-g)
    out *= np.asarray(x)
    return mx.array(out)


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

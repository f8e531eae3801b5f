"""Numba-compiled loops for the CPU kernels: softmax rows and SwiGLU with a vectorised float32 `exp`.

NumPy's float32 `exp` costs 4-9 ns an element on the x86 dev machine (an add costs 0.3), and a 4k-token
prefill takes ~2.3G of them in attention alone. Here one LLVM-vectorised loop computes `exp` as
2^t · p(f) (Cephes' degree-6 polynomial, within 2 ulp of float64's exp over the normal range) fused with
the row max, the causal limit and the row sum: one pass where NumPy made four.

Importing this module imports numba (~0.5 s) and compiles on first call (~2 s, then cached on disk), so
`cpu_kernels` imports it lazily and only on the CPU device. Numba is a Linux dependency only: Apple
Silicon runs Metal, and MLX's CPU backend there vectorises `exp` through Accelerate.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

# No nnan/ninf: the loops clamp and compare, and must see real infinities as such.
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}
_f32 = np.float32
_LO, _HI = _f32(-87.3), _f32(88.0)  # exp stays a normal, finite float32 in between


@intrinsic  # type: ignore[untyped-decorator]
def _as_float32(typingctx: Any, bits: Any) -> Any:
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@numba.njit(fastmath=_FAST, error_model="numpy", nogil=True, cache=True, inline="always")  # type: ignore[untyped-decorator]
def exp32(x: Any) -> Any:
    """exp(x) for a float32 x: 0 below -87.3, exp(88) above 88."""
    xc = min(max(x, _LO), _HI)
    t = np.floor(xc * _f32(1.4426950408889634) + _f32(0.5))
    f = xc - t * _f32(0.693359375) + t * _f32(2.12194440e-4)  # ln 2 in two parts keeps f exact
    p = _f32(1.9875691500e-4)
    p = p * f + _f32(1.3981999507e-3)
    p = p * f + _f32(8.3334519073e-3)
    p = p * f + _f32(4.1665795894e-2)
    p = p * f + _f32(1.6666665459e-1)
    p = p * f + _f32(5.0000001201e-1)
    y = (p * f * f + f + _f32(1.0)) * _as_float32((np.int32(t) + np.int32(127)) << np.int32(23))
    return y if x >= _LO else _f32(0.0)


@numba.njit(fastmath=_FAST, error_model="numpy", nogil=True, cache=True)  # type: ignore[untyped-decorator]
def softmax_rows(scores: Any, seen: Any, diag: int, tile: int, causal: bool, totals: Any) -> None:
    """Rows of the 2-D float32 `scores` become exp(s - row max) in place, and `totals` gets each row's sum.

    `seen[r]` is row r's max over its first `diag` columns (NumPy's reduction is faster than this loop's);
    the loop takes the rest up to the row's limit: `diag + r % tile + 1` with `causal`, else all columns.
    Columns past the limit become 0 unread."""
    n = scores.shape[1]
    for r in range(scores.shape[0]):
        row = scores[r]
        limit = min(n, diag + r % tile + 1) if causal else n
        m = seen[r]
        for j in range(diag, limit):
            m = max(m, row[j])
        acc = _f32(0.0)
        for j in range(limit):
            y = exp32(row[j] - m)
            row[j] = y
            acc += y
        for j in range(limit, n):
            row[j] = _f32(0.0)
        totals[r] = acc


@numba.njit(fastmath=_FAST, error_model="numpy", nogil=True, cache=True)  # type: ignore[untyped-decorator]
def swiglu(gate: Any, x: Any, out: Any) -> None:
    """out = silu(gate) · x over flat float32 arrays."""
    for j in range(gate.size):
        g = gate[j]
        out[j] = g / (_f32(1.0) + exp32(-g)) * x[j]


def warm() -> None:
    """Compile (or load from the disk cache) on the caller's thread, before any worker calls in."""
    probe = np.zeros((2, 4), np.float32)
    softmax_rows(probe, probe[:, 0], 1, 2, True, np.empty(2, np.float32))
    flat = probe.reshape(-1)
    swiglu(flat, flat, np.empty_like(flat))

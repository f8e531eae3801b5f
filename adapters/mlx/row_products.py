"""Projections of a few rows as one-row products, for backends whose matrix multiply costs host time per call.

MLX's CUDA backend sends a product of more than one row to cuBLASLt, and builds its call from scratch every
time: descriptors, an algorithm heuristic (`cublasLtMatmulAlgoGetHeuristic`, not cached), a workspace and a
graph capture, all on the host. A one-row product runs MLX's own matrix-vector kernel instead. A 28-layer
verify has ~196 projections, so an 8-row round spent ~8 ms in dispatch where a plain step spent ~2.3 ms (H200,
2026-12-03). Here a projection of 2..`MAX_ROWS` rows runs as a batch of one-row products, `W @ x_i`: MLX's
batched matrix-vector kernel, the same per-row arithmetic as a plain step's projection, with the weight read
once per row. Written as `x_i @ W.T` it would not work: MLX folds a batch of one-row products against one matrix
back into a single GEMM.

Reading the weight once per row is cheap while it comes from the L2 cache and the device would idle anyway; for a
large model it is device time, and a GEMM's host cost hides behind the device's own work. So a projection takes
the row path only while rows x weight bytes stays within `MAX_BYTES`. On the H200 (bf16, 2026-12-03), every
projection row products at widths 4-16: 30 layers of SmolLM2-135M (weights <= 1.8 MB, <= 28 MB re-read) went
from 10.7 to 7.3 ms a round, while a Qwen3-4B shape (5-50 MB weights) went from 9.3-11.2 to 11.4-27.4 ms and a
32B shape's oracle speedup fell from 4.2x to 1.4x; the budget keeps the first and leaves the others' GEMMs.

With `MLX_DSPARK_SKINNY=on` a projection of 2..`SKINNY_ROWS` rows runs one kernel of our own instead (`skinny`,
through `mx.fast.cuda_kernel`): each warp reads its weight rows once, 16 bytes a lane, and keeps every row's sum
in registers (fp32), at the host cost of one launch. `install` checks it against MLX's product
once per weight dtype and falls back to the row products above if it fails to compile or disagrees. It is off
by default because it has not won yet: its first version compiled and agreed on the H200 (bf16), tied row
products on SmolLM2 (DSpark rounds 7.0 against 7.2 ms) and lost to cuBLAS on a Qwen3-4B shape on the H100
(8-row rounds 12.6-13.8 against 9.4-9.8 ms), every warp re-reading all of x from L2. This version stages x in
shared memory (not yet run on a device).

Metal and the CPU have no such per-call cost (and the CPU's BLAS is faster on one GEMM), so "auto" installs this
on CUDA only. `install` changes the class of a model's own `nn.Linear` modules, so it is per model, not a
process-wide patch: another model in the same process keeps MLX's path.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import mlx.core as mx
from mlx import nn

from mlx_dspark.adapters.mlx.device import cuda_switch, switch_mode

ENV = "MLX_DSPARK_ROW_PRODUCTS"  # "auto" (CUDA only), "on", "off"
SKINNY_ENV = "MLX_DSPARK_SKINNY"  # the few-row kernel: "on" (CUDA); "auto" and "off" keep it off
SKINNY_ROWS = 16  # widest projection the few-row kernel runs (a verify of 15 drafts, a DFlash block)
MAX_ROWS = 32  # widest projection run as row products: a verify or a draft block, not a prefill chunk
# rows x weight bytes a projection may re-read (see the module docstring); MLX_DSPARK_ROW_BYTES sets it for a bench
MAX_BYTES = int(os.environ.get("MLX_DSPARK_ROW_BYTES") or 32 << 20)
_LINEAR = nn.Linear.__call__  # MLX's own projection


def enabled() -> bool:
    """Whether models loaded in this process run their few-row projections as row products."""
    return cuda_switch(ENV)


def product(weight: mx.array, x: mx.array) -> mx.array:
    """x [..., in] @ weight.T for weight [out, in], as one matrix-vector product per row of x."""
    rows = x.size // x.shape[-1]
    y = weight[None] @ x.reshape(rows, x.shape[-1], 1)  # [rows, out, 1]: the matrix broadcast, never folded
    return y.reshape(*x.shape[:-1], weight.shape[0])


def project(module: nn.Linear, x: mx.array) -> mx.array:
    """`module(x)`, with 2..SKINNY_ROWS rows of x through the few-row kernel where it is verified, else 2..MAX_ROWS
    rows as row products within the byte budget (MLX's own projection otherwise)."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    weight = module.weight
    if 1 < rows <= SKINNY_ROWS and _skinny_fits(weight, x):
        y = skinny(weight, x)
    elif not 1 < rows <= MAX_ROWS or rows * weight.nbytes > MAX_BYTES:
        return _LINEAR(module, x)
    else:
        y = product(weight, x)
    return y + module["bias"] if "bias" in module else y


# The few-row kernel: y[m, n] = sum_k x[m, k] w[n, k] for x [M, K], w [N, K]. A block of WARPS warps serves
# WARPS * COLS output columns, COLS a warp. x is staged in shared memory a tile of TK columns at a time, so the
# block's warps read it from there (the first version had every warp re-read all of x from L2, which on a 4B
# shape cost more than cuBLAS's GEMM). Within a tile, lane l reads 16 bytes of each of its weight rows at
# k = l·VEC, l·VEC + 32·VEC, ... (coalesced) and keeps M fp32 sums a column; a butterfly reduction at the end,
# then lane m writes row m. Each (row, column) is summed in the same order whatever M is; M is read at run time
# (up to ROWS), so one kernel per dtype serves every width and nothing compiles mid-request.
_WARPS, _COLS, _TK = 8, 2, 256
_SKINNY_SOURCE = f"""
    constexpr int VEC = 16 / sizeof(T);
    constexpr int WARPS = {_WARPS}, COLS = {_COLS}, TK = {_TK};
    __shared__ __align__(16) unsigned char xs_bytes[ROWS * TK * sizeof(T)];  // raw: T may be a class type
    T* xs = reinterpret_cast<T*>(xs_bytes);
    const int M = x_shape[0];
    const int N = w_shape[0];
    const int K = w_shape[1];
    const int lane = threadIdx.x & 31;
    const long n0 = (long(blockIdx.x) * WARPS + (threadIdx.x >> 5)) * COLS;
    float acc[COLS][ROWS];
    #pragma unroll
    for (int c = 0; c < COLS; ++c)
        #pragma unroll
        for (int m = 0; m < ROWS; ++m) acc[c][m] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TK) {{
        const int tk = min(TK, K - k0);
        const int per_row = tk / VEC;
        for (int i = threadIdx.x; i < M * per_row; i += blockDim.x) {{
            const int m = i / per_row, v = i - m * per_row;
            *reinterpret_cast<uint4*>(&xs[m * TK + v * VEC]) =
                *reinterpret_cast<const uint4*>(x + long(m) * K + k0 + v * VEC);
        }}
        __syncthreads();
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {{
            const long n = n0 + c;
            if (n >= N) break;
            const T* wr = w + n * K + k0;
            for (int k = lane * VEC; k < tk; k += 32 * VEC) {{
                const uint4 wv = *reinterpret_cast<const uint4*>(wr + k);
                const T* wp = reinterpret_cast<const T*>(&wv);
                float wf[VEC];
                #pragma unroll
                for (int j = 0; j < VEC; ++j) wf[j] = static_cast<float>(wp[j]);
                #pragma unroll
                for (int m = 0; m < ROWS; ++m) {{
                    if (m >= M) break;
                    const uint4 xv = *reinterpret_cast<const uint4*>(&xs[m * TK + k]);
                    const T* xp = reinterpret_cast<const T*>(&xv);
                    float s = 0.0f;
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) s += wf[j] * static_cast<float>(xp[j]);
                    acc[c][m] += s;
                }}
            }}
        }}
        __syncthreads();
    }}
    #pragma unroll
    for (int c = 0; c < COLS; ++c) {{
        const long n = n0 + c;
        #pragma unroll
        for (int m = 0; m < ROWS; ++m) {{
            if (m >= M) break;
            float v = acc[c][m];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == m && n < N) y[long(m) * N + n] = static_cast<T>(v);
        }}
    }}
"""
_SKINNY_DTYPES = (mx.bfloat16, mx.float16, mx.float32)

_skinny_ok: dict[mx.Dtype, bool] = {}  # weight dtype -> the kernel passed its check (install)


def skinny_enabled() -> bool:
    """Whether few-row projections may run the kernel in this process: `SKINNY_ENV` "on" (on CUDA); "auto" and
    "off" keep it off until it measurably wins (see the module docstring).

    Raises:
        ValueError: another value.
    """
    return switch_mode(SKINNY_ENV) == "on"


def _skinny_fits(weight: mx.array, x: mx.array) -> bool:
    """The kernel takes this product: checked for the weight's dtype, x of the same dtype, rows of whole 16-byte
    vectors."""
    return (
        _skinny_ok.get(weight.dtype, False)
        and x.dtype == weight.dtype
        and weight.ndim == 2
        and weight.shape[1] % (16 // weight.dtype.size) == 0
    )


@functools.cache
def _kernel() -> Any:
    return mx.fast.cuda_kernel(name="dspark_skinny", input_names=["x", "w"], output_names=["y"], source=_SKINNY_SOURCE)


def skinny(weight: mx.array, x: mx.array) -> mx.array:
    """x [..., K] @ weight.T for weight [N, K], 2..SKINNY_ROWS rows, as one launch of the few-row kernel."""
    rows, k, n = x.size // x.shape[-1], x.shape[-1], weight.shape[0]
    (y,) = _kernel()(
        inputs=[x.reshape(rows, k), weight],
        template=[("T", weight.dtype), ("ROWS", SKINNY_ROWS)],
        grid=(-(-n // (_WARPS * _COLS)) * 32 * _WARPS, 1, 1),  # threads: a block per WARPS * COLS columns
        threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[weight.dtype],
    )
    return y.reshape(*x.shape[:-1], n)


def check_skinny(dtype: mx.Dtype) -> bool:
    """Run the kernel once for `dtype` against MLX's product (fp32 sums of the same inputs) and remember whether
    it may serve: a kernel that does not compile, or whose sums are off by more than the dtype's rounding,
    never does. Needs a device that runs `mx.fast.cuda_kernel`."""
    if dtype in _skinny_ok:
        return _skinny_ok[dtype]
    ok = False
    if dtype in _SKINNY_DTYPES:
        try:
            key = mx.random.key(7)
            w = mx.random.normal((200, 512), key=key).astype(dtype)
            x = mx.random.normal((2, 3, 512), key=mx.random.split(key)[0]).astype(dtype)
            got = skinny(w, x).astype(mx.float32)
            want = x.astype(mx.float32) @ w.astype(mx.float32).T
            # the output's own rounding (one ulp of a sum of ~sqrt(512) ~ 23) plus fp32 sums in another order
            ok = bool(mx.allclose(got, want, atol=0.5 if dtype != mx.float32 else 1e-3, rtol=1e-2).item())
            if not ok:
                warnings.warn(f"the few-row kernel disagrees with MLX in {dtype}: row products serve", stacklevel=2)
        except (RuntimeError, ValueError) as exc:
            warnings.warn(f"the few-row kernel is unavailable ({exc}): row products serve", stacklevel=2)
    _skinny_ok[dtype] = ok
    return ok


class RowLinear(nn.Linear):
    """`nn.Linear` whose few-row projections run as row products (`project`; same weights, same state)."""

    def __call__(self, x: mx.array) -> mx.array:
        return project(self, x)


def install(model: Any) -> int:
    """Give `model`'s plain `nn.Linear` modules the row-product path where `enabled()`; returns how many it
    changed (0 when off). Quantized and other projection kinds are left as they are."""
    if not enabled():
        return 0
    changed = 0
    kernel = skinny_enabled()
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = RowLinear
            changed += 1
        if kernel and type(module) is RowLinear:
            check_skinny(module.weight.dtype)  # before any forward is traced (the check evaluates)
    return changed

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

Metal and the CPU have no such per-call cost (and the CPU's BLAS is faster on one GEMM), so "auto" installs this
on CUDA only. `install` changes the class of a model's own `nn.Linear` modules, so it is per model, not a
process-wide patch: another model in the same process keeps MLX's path.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
from mlx import nn

from mlx_dspark.adapters.mlx.device import cuda_switch

ENV = "MLX_DSPARK_ROW_PRODUCTS"  # "auto" (CUDA only), "on", "off"
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
    """`module(x)`, with 2..MAX_ROWS rows of x as row products within the byte budget (MLX's own projection
    otherwise)."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    if not 1 < rows <= MAX_ROWS or rows * module.weight.nbytes > MAX_BYTES:
        return _LINEAR(module, x)
    y = product(module.weight, x)
    return y + module["bias"] if "bias" in module else y


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
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = RowLinear
            changed += 1
    return changed

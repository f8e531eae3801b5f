"""A target's GEMM work per forward, counted from its modules, and its own GEMM rate, timed on its weights.

The prefill bench divides our prefill by the limit these give (domain/costmodel/prefill.py): the weights of
every linear map in the decoder layers, the query width of their attention, and the rate of the model's
widest layer-0 projection at the prefill chunk's width, measured on the model itself, in the same run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import mlx.core as mx
from mlx import nn

from mlx_dspark.adapters.mlx import fused_projections
from mlx_dspark.domain.costmodel.prefill import ForwardCost


def _linears(layer: Any) -> Iterable[tuple[str, Any, int, int]]:
    """(name, module, inputs, outputs) of each dense or quantized linear map in a decoder layer."""
    for name, module in layer.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            out, packed = module.weight.shape
            yield name, module, packed * 32 // module.bits, out
        elif isinstance(module, nn.Linear):
            out, inputs = module.weight.shape
            yield name, module, inputs, out


def forward_cost(layers: Iterable[Any]) -> ForwardCost:
    params = width = 0
    for layer in layers:
        for _, _, inputs, out in _linears(layer):
            params += inputs * out
        for name, module in layer.named_modules():
            if name.endswith("q_proj"):
                width += fused_projections.projection_width(module) or 0
    return ForwardCost(weight_params=params, attention_width=width)


def gemm_flops_per_s(layers: Iterable[Any], rows: int, repeats: int = 10) -> float:
    """FLOP/s of the first layer's widest linear map over `rows` tokens, the best of `repeats`: the limit
    is what the BLAS can do, and a busy machine only ever slows a run down."""
    first = next(iter(layers), None)
    maps = list(_linears(first)) if first is not None else []
    if not maps:
        return 0.0
    _, module, inputs, out = max(maps, key=lambda m: m[2] * m[3])
    dtype = module.scales.dtype if isinstance(module, nn.QuantizedLinear) else module.weight.dtype
    x = mx.random.normal((1, rows, inputs)).astype(dtype)
    mx.eval(x)
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        mx.eval(module(x))
        if i >= 2:  # two warm-ups: the first calls pay allocation and BLAS thread start
            times.append(time.perf_counter() - start)
    return 2.0 * rows * inputs * out / min(times)

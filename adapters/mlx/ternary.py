"""BitNet b1.58 ternary projections on every backend.

mlx-lm's `BitLinear` multiplies with a Metal-only kernel, so a BitNet checkpoint cannot run on the CPU or on
CUDA. Ternary weights fit MLX's 2-bit affine format exactly: codes w + 1 in {0, 1, 2}, with scale s and bias
-s per group, dequantize to {-s, 0, +s}. `portable_ternary` swaps each BitLinear of a model for that
QuantizedLinear, which MLX runs on every backend at 2 bits per weight (BitLinear's own packing density).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten

GROUPS = (128, 64, 32)  # MLX's group sizes, widest first


def unpack_ternary(packed: mx.array, out_features: int) -> mx.array:
    """BitLinear's [ceil(out/4), in] uint8 into the ternary matrix [out, in] (int8): row r + k·out/4 sits in
    bits 2k..2k+1 of packed row r, stored as w + 1."""
    parts = [((packed.astype(mx.uint32) >> (2 * k)) & 3).astype(mx.int8) - 1 for k in range(4)]
    return mx.concatenate(parts, axis=0)[:out_features]


def ternary_linear(ternary: mx.array, scale: float, bias: mx.array | None) -> nn.QuantizedLinear:
    """An exact 2-bit QuantizedLinear computing scale · (x @ ternary.T) (+ bias)."""
    out_features, in_features = ternary.shape
    group = next((g for g in GROUPS if in_features % g == 0), None)
    if group is None:
        raise ValueError(f"a ternary projection {in_features} wide fits no 2-bit group size {GROUPS}")
    layer = nn.QuantizedLinear(in_features, out_features, bias=bias is not None, group_size=group, bits=2)
    codes = (ternary.astype(mx.int32) + 1).astype(mx.uint32).reshape(out_features, in_features // 16, 16)
    layer.weight = (codes << (2 * mx.arange(16, dtype=mx.uint32))).sum(axis=-1).astype(mx.uint32)
    s = mx.full((out_features, in_features // group), scale, dtype=mx.float32)
    layer.scales, layer.biases = s, -s
    if bias is not None:
        layer.bias = bias
    return layer


def portable_ternary(model: nn.Module) -> int:
    """Replace every mlx-lm BitLinear of `model` by its exact 2-bit QuantizedLinear; returns how many."""
    from mlx_lm.models.bitlinear_layers import BitLinear

    swaps: list[tuple[str, Any]] = []
    for name, module in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if not isinstance(module, BitLinear):
            continue
        scale = float(module.weight_scale.astype(mx.float32).reshape(-1)[0].item())
        if module.invert_weight_scales:
            scale = 1.0 / scale
        ternary = unpack_ternary(module.weight, module.out_features)
        swaps.append((name, ternary_linear(ternary, scale, module.bias)))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
        mx.eval(model.parameters())
    return len(swaps)

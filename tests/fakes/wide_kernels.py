"""Accelerator-like kernels for CPU tests: Linear layers whose multi-row forward sums its inputs in two halves.

MLX's CPU kernels give a row the same bits whatever the number of rows beside it (measured on the tiny
targets and the default model, in bf16, fp16 and fp32, verify widths 2-8: not one logit differed from the
one-token step's), so on the CPU a verify never rounds differently from a plain step. GPU GEMMs choose tiles
and split-K by the problem's shape, so there the number of rows changes the accumulation order. This fake does
the same in miniature: with more than one row, each half of the input dimension's partial product is stored
in the layer's dtype before the two are added (one extra rounding, of the size a different order gives).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn


class _SplitWhenWide(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows <= 1:
            return super().__call__(x)
        half = x.shape[-1] // 2
        w = self.weight
        y = x[..., :half] @ w[:, :half].T + x[..., half:] @ w[:, half:].T
        return y + self.bias if "bias" in self else y


def split_when_wide(model: Any) -> Any:
    """Give every plain Linear of `model` the width-dependent sum (in place); returns the model."""
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = _SplitWhenWide
    return model

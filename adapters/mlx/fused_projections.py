"""Sibling projections of one input fused into one: attention's q/k/v and the MLP's gate/up.

A decoder layer of the common families runs seven matrix products; three read the attention's input and two the
MLP's. Concatenating each set's weights along the output axis leaves four products a layer: fewer launches
where a forward is launch-bound (a GPU running a small model, or a verify's few rows on MLX CUDA, where every
product of more than one row pays a cuBLAS call built on the host), one larger product where it is not. Each
output column is the same dot product over the same weights as before, so results do not move: bit for bit
on this CPU's kernels (tested), and a plain step and a verify always share the fused weights anyway.

The family's own attention and MLP code stays as it is. Each former projection becomes a `FusedPart`: called
with the input, it returns its columns of the fused product, computed once for that input (the same array
object) and shared with its siblings; the shared product is dropped as soon as every part has been handed out,
so a prefill chunk's products are never held past their layer. A part called with another input computes the
fused product for that input: never wrong, only slower (a family that feeds q and k different inputs).

`install` fuses only plain `nn.Linear` or `nn.QuantizedLinear` siblings of one configuration (dtype, input
width, bias, quantization); anything else, sharded and LoRA projections included, is left alone. It evaluates
each fused weight as it goes and releases the originals, so memory never holds both copies of more than one
group: a lazily loaded model is therefore read in full by it, which a tensor-parallel rank must not do (its
loader does not fuse). `MLX_DSPARK_FUSE=off` keeps the model as loaded (for an A/B).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import mlx.core as mx
from mlx import nn

ENV = "MLX_DSPARK_FUSE"  # "on" (the default) or "off"
# siblings that read one input, and the name their fused projection takes beside them
GROUPS = {("q_proj", "k_proj", "v_proj"): "qkv_fused", ("gate_proj", "up_proj"): "gate_up_fused"}
_KINDS = (nn.Linear, nn.QuantizedLinear)


def enabled() -> bool:
    """Whether models loaded in this process fuse their sibling projections.

    Raises:
        ValueError: `MLX_DSPARK_FUSE` is neither on nor off.
    """
    mode = os.environ.get(ENV, "on").strip().lower() or "on"
    if mode not in ("on", "off"):
        raise ValueError(f"{ENV} must be on or off, got {mode!r}")
    return mode == "on"


class _Shared:
    """The fused product of the last input, per thread, until each part has taken its columns."""

    def __init__(self, fused: nn.Module, widths: list[int]) -> None:
        self.fused = fused
        self.widths = widths
        self.bounds = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
        self._local = threading.local()

    def part(self, x: mx.array, index: int) -> mx.array:
        memo = self._local
        if getattr(memo, "x", None) is not x:
            memo.x, memo.parts, memo.left = x, mx.split(self.fused(x), self.bounds, axis=-1), len(self.widths)
        part = memo.parts[index]
        memo.left -= 1
        if memo.left <= 0:  # every part served: hold nothing past the layer
            memo.x = memo.parts = None
        return part


class FusedPart(nn.Module):
    """One former projection: its columns of the fused product of its input (see the module docstring)."""

    def __init__(self, shared: _Shared, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "_holder", (shared, index))  # outside the module tree: the fused one is in it

    @property
    def output_dims(self) -> int:
        shared, index = self._holder
        return shared.widths[index]

    def __call__(self, x: mx.array) -> mx.array:
        shared, index = self._holder
        return shared.part(x, index)


def _signature(module: nn.Module) -> tuple[Any, ...] | None:
    """What siblings must share to be fused (None: not a kind this fuses)."""
    if type(module) not in _KINDS:
        return None
    arrays = sorted((k, v.dtype, v.shape[1:]) for k, v in module.items() if isinstance(v, mx.array))
    options = tuple(getattr(module, k, None) for k in ("group_size", "bits", "mode"))
    return (type(module), tuple(arrays), options)


def _fuse(modules: list[nn.Module]) -> nn.Module:
    """One module of the siblings' kind whose arrays are theirs, concatenated along the output axis."""
    first = modules[0]
    fused = type(first).__new__(type(first))
    nn.Module.__init__(fused)
    for key, value in vars(first).items():  # quantization options, frozen and training flags
        setattr(fused, key, set(value) if isinstance(value, set) else value)
    for key, value in first.items():
        if isinstance(value, mx.array):
            fused[key] = mx.concatenate([m[key] for m in modules], axis=0)
    mx.eval(fused.parameters())
    return fused


def install(model: nn.Module) -> int:
    """`fuse(model)` where `enabled()`; returns how many groups it fused (0 when off)."""
    return fuse(model) if enabled() else 0


def fuse(model: nn.Module) -> int:
    """Fuse every group of `GROUPS` found in `model`, whatever the switch; returns how many groups it fused."""
    fused_groups = 0
    # The parents only: a list of every module would hold each replaced projection's weights to the end.
    parents = [m for _, m in model.named_modules() if any(isinstance(m.get(g[0]), nn.Module) for g in GROUPS)]
    for parent in parents:
        for names, fused_name in GROUPS.items():
            modules = [parent.get(n) for n in names]
            if not all(isinstance(m, nn.Module) for m in modules):
                continue
            signatures = {_signature(m) for m in modules}
            if len(signatures) != 1 or None in signatures:
                continue
            shared = _Shared(_fuse(modules), [int(m.weight.shape[0]) for m in modules])
            parent[fused_name] = shared.fused
            for i, name in enumerate(names):
                parent[name] = FusedPart(shared, i)
            del modules
            fused_groups += 1
    return fused_groups


def projection_width(module: nn.Module) -> int | None:
    """The output width of a projection, fused part or not (None: not a projection)."""
    if isinstance(module, FusedPart):
        return module.output_dims
    if isinstance(module, nn.QuantizedLinear | nn.Linear):
        return int(module.weight.shape[0])
    return None

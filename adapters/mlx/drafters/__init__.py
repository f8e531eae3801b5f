"""MLX drafters that read target features: DFlash (z-lab) and DSpark (DeepSpec, speculators, SpecForge).

`load_drafter` is the public entry; the nn.Modules (`DFlashDrafter`, `DSparkDrafter`) and config parsers
are exported for training, which reuses the same forward.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn

from mlx_dspark.adapters.mlx.drafters.backbone import ContextCache, DrafterBackbone
from mlx_dspark.adapters.mlx.drafters.checkpoint import default_bits, read_checkpoint, resolve_path
from mlx_dspark.adapters.mlx.drafters.config import (
    BackboneConfig,
    DFlashConfig,
    DSparkConfig,
    parse_dflash,
    parse_dspark,
)
from mlx_dspark.adapters.mlx.drafters.dflash import DFlashDrafter, DFlashDraftSource
from mlx_dspark.adapters.mlx.drafters.dspark import DSparkDrafter, DSparkDraftSource

__all__ = [
    "BackboneConfig",
    "ContextCache",
    "DFlashConfig",
    "DFlashDraftSource",
    "DFlashDrafter",
    "DSparkConfig",
    "DSparkDraftSource",
    "DSparkDrafter",
    "DrafterBackbone",
    "default_bits",
    "load_drafter",
    "parse_dflash",
    "parse_dspark",
]

KINDS = ("dflash", "dspark")


def load_drafter(
    kind: str,
    spec: str,
    target_model: nn.Module,
    *,
    target: Any = None,
    bits: int | None = None,
    confidence_threshold: float = 0.0,
    proposal: str = "sample",
    dtype: mx.Dtype | None = None,
) -> DFlashDraftSource | DSparkDraftSource:
    """Load a drafter checkpoint and return it as a DraftSource bound to the target.

    Args:
        kind: "dflash" or "dspark".
        spec: a local checkpoint directory or an HF repo id.
        target_model: the mlx-lm target module (embedding, head and sizes are read from it).
        target: the `MlxTargetModel`; when given, it also captures this drafter's layers (those of
            drafters loaded before stay captured: each drafter reads its own columns).
        bits: quantize the drafter to 4 or 8 bits (group 64), 0 for none, None for the device default.
        confidence_threshold: DSpark only; > 0 truncates blocks on the running confidence product.
        proposal: "sample" (drafts drawn from q, q reported) or "argmax" (one-hot q); both lossless.
        dtype: parameter dtype; None picks float32 on CPU and the checkpoint's dtype on accelerators.

    Returns:
        A `DraftSource`.

    Raises:
        ModelUnavailable: the checkpoint is missing, malformed or an unsupported variant.
        IncompatibleDrafter: it does not fit the target.
        ValueError: an unknown kind or proposal mode.
    """
    if kind not in KINDS:
        raise ValueError(f"drafter kind must be one of {KINDS}, got {kind!r}")
    path = resolve_path(spec)
    raw, weights = read_checkpoint(path)
    where = f"{kind} drafter {spec}"
    source: DFlashDraftSource | DSparkDraftSource
    if kind == "dflash":
        if confidence_threshold > 0:
            raise ValueError("DFlash drafters have no confidence head")
        dflash = DFlashDrafter.from_weights(
            parse_dflash(raw, where), weights, target_model, bits=bits, dtype=dtype, where=where
        )
        source = DFlashDraftSource(dflash, proposal=proposal)
    else:
        dspark = DSparkDrafter.from_weights(
            parse_dspark(raw, where), weights, target_model, bits=bits, dtype=dtype, where=where
        )
        source = DSparkDraftSource(dspark, proposal=proposal, confidence_threshold=confidence_threshold)
    if target is not None:
        target.add_capture(list(source.target_layer_ids))
        source.bind_features(target.feature_columns)
    return source

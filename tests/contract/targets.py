"""The targets the port contract suites run on: the oracle fake and the MLX adapter over tiny models."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from mlx_dspark.adapters.mlx.target import MlxTargetModel
from tests.fakes.oracle import OracleTarget
from tests.fakes.tiny_models import tiny_model


@functools.cache
def shared_model(family: str) -> Any:
    """One tiny model per family for the whole session (building them is the slow part)."""
    return tiny_model(family, seed=3)


def make_target(kind: str, capture_layers: Sequence[int]) -> Any:
    """"oracle", "mlx-<family>" (a tiny model shared by every test), or "mlx-llama-q8" (8-bit KV cache)."""
    if kind == "oracle":
        return OracleTarget()
    if kind == "mlx-llama-q8":
        model = tiny_model("llama", seed=3, head_dim=32)
        return MlxTargetModel(model, capture_layers=tuple(capture_layers), kv_bits=8, kv_group_size=32)
    return MlxTargetModel(shared_model(kind.removeprefix("mlx-")), capture_layers=tuple(capture_layers))

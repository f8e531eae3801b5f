"""Fixtures the MLX integration tests share."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from mlx_dspark.adapters.mlx.compiled_forward import CompiledForward


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every compiled forward (the target's verifies and plain steps, a draft model's steps)."""
    seen: list[int] = []
    original = CompiledForward.__call__

    def spy(self: Any, tokens: mx.array, caches: Any, layers: Any) -> Any:
        seen.append(int(tokens.shape[0]))
        return original(self, tokens, caches, layers)

    monkeypatch.setattr(CompiledForward, "__call__", spy)
    return seen

"""mlx-dspark: lossless speculative decoding on MLX.

    >>> from mlx_dspark import load
    >>> model = load("default", mode="auto")
    >>> model.generate("Hello", max_tokens=32).text

Kept tiny: importing mlx_dspark.domain (or anything else) runs this file first, so nothing heavy here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load"]


def load(model: str = "default", **kwargs: Any) -> Any:
    """Load a model (and its draft source) and return a SpeculativeModel; see mlx_dspark.entrypoints.api.load."""
    from mlx_dspark.entrypoints.api import load as _load

    return _load(model, **kwargs)

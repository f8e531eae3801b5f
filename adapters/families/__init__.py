"""Model-family codecs: render neutral conversations through a chat template, parse output incrementally."""

from mlx_dspark.adapters.families.base import FamilyCodec, RenderedPrompt, StreamParser
from mlx_dspark.adapters.families.select import select_codec

__all__ = ["FamilyCodec", "RenderedPrompt", "StreamParser", "select_codec"]

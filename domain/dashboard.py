"""Plain values of the dashboard: saved chat sessions and messages, local models, hub repo facts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mlx_dspark.domain.errors import InvalidRequest
from mlx_dspark.domain.fit import ModelShape


@attrs.define(auto_exc=True, kw_only=True)
class SessionNotFound(InvalidRequest):
    """No saved session has this id (answered with 404)."""


@attrs.frozen(kw_only=True)
class SessionInfo:
    id: str
    title: str
    created: float
    updated: float
    settings: Mapping[str, Any] = attrs.field(factory=dict)
    messages: int = 0


@attrs.frozen(kw_only=True)
class StoredMessage:
    id: int
    session_id: str
    role: str  # "user" | "assistant"
    content: str
    thinking: str = ""
    stats: Mapping[str, Any] = attrs.field(factory=dict)
    created: float = 0.0


@attrs.frozen(kw_only=True)
class LocalModel:
    name: str  # what `--model` accepts (repo id or path)
    path: str
    source: str  # "mlx-dspark cache" | "huggingface cache" | "lm studio" | "embedded"
    size_bytes: int
    dtype: str = ""
    bits: int | None = None
    context: int | None = None
    model_type: str = ""
    drafters: tuple[str, ...] = ()
    # A GGUF is converted once into this device's format; that copy is what loads into memory, so its size (not
    # the file's) is what the model takes. Empty / 0: not converted yet, or loaded as it is stored.
    converted_path: str = ""
    converted_bytes: int = 0


@attrs.frozen(kw_only=True)
class RepoFacts:
    """What a fit estimate needs from a hub repo (config + safetensors headers; nothing downloaded)."""

    repo_id: str
    shape: ModelShape
    weight_bytes: int
    files: Mapping[str, int]  # file name → size
    model_type: str = ""
    active_weight_bytes: int = 0  # MoE: the weights one token reads (0: dense, all of them)

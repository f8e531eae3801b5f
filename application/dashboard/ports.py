"""Ports of the dashboard's use cases and the plain values they exchange (adapters implement them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from mlx_dspark.domain.fit import ModelShape


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


class SessionStore(Protocol):
    """Chat sessions on disk; every write is one transaction (a crash never loses a committed message)."""

    def create(self, title: str, settings: Mapping[str, Any] | None = None) -> SessionInfo: ...

    def get(self, session_id: str) -> SessionInfo | None: ...

    def list(self) -> list[SessionInfo]: ...

    def rename(self, session_id: str, title: str) -> bool: ...

    def update_settings(self, session_id: str, settings: Mapping[str, Any]) -> bool: ...

    def delete(self, session_id: str) -> bool: ...

    def append(
        self,
        session_id: str,
        role: str,
        content: str,
        *,
        thinking: str = "",
        stats: Mapping[str, Any] | None = None,
    ) -> StoredMessage: ...

    def messages(self, session_id: str) -> list[StoredMessage]: ...


Listener = Callable[[dict[str, Any]], None]


class TelemetryFeed(Protocol):
    """Live decode events as JSON-ready dicts (see adapters.telemetry.broadcast)."""

    def subscribe(self, listener: Listener, *, replay: int = 0) -> Callable[[], None]: ...

    def summary(self, request_id: str) -> dict[str, Any] | None: ...

    def snapshot(self) -> dict[str, Any]: ...


class MachineProbe(Protocol):
    """Memory and bandwidth facts of this machine and of a loaded model (MLX; engine thread for measurements)."""

    def usable_memory(self) -> dict[str, Any]:
        """{"bytes": usable bytes, "source": how it was found}."""
        ...

    def memory_in_use(self) -> dict[str, int]:
        """{"active": bytes, "peak": bytes, "cache": bytes} as MLX reports them (0 where unknown)."""
        ...

    def model_bytes(self, handle: Any) -> int:
        """Bytes of a loaded model's parameters (0 when unknown)."""
        ...

    def bandwidth(self, size_bytes: int = 256 << 20, repeats: int = 5) -> dict[str, Any]:
        """A copy benchmark: {"bytes_per_s", "size", "samples_s"} (engine thread only)."""
        ...


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


@attrs.frozen(kw_only=True)
class RepoFacts:
    """What a fit estimate needs from a hub repo (config + safetensors headers; nothing downloaded)."""

    repo_id: str
    shape: ModelShape
    weight_bytes: int
    files: Mapping[str, int]  # file name → size
    model_type: str = ""


class ModelCatalog(Protocol):
    """Local models on this machine and their deletion."""

    def local_models(self) -> list[LocalModel]: ...

    def delete(self, path: str) -> None: ...


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class ModelHub(Protocol):
    """A model hub speaking the Hugging Face HTTP API (HF_ENDPOINT honoured)."""

    def search(self, query: str, limit: int = 20) -> list[dict[str, Any]]: ...

    def facts(self, repo_id: str) -> RepoFacts: ...

    def download(self, repo_id: str, progress: Progress | None = None, *, files: Sequence[str] | None = None) -> str:
        """Download a repo into the Hugging Face cache (resuming partial files); returns the snapshot path."""
        ...

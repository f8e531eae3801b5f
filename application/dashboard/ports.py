"""Ports of the dashboard's use cases (adapters implement them); the values they exchange are in the domain."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from mlx_dspark.domain.dashboard import LocalModel, RepoFacts, SessionInfo, StoredMessage

__all__ = [
    "LocalModel",
    "MachineProbe",
    "ModelCatalog",
    "ModelHub",
    "Progress",
    "RepoFacts",
    "SessionInfo",
    "SessionStore",
    "StoredMessage",
    "TelemetryFeed",
]


class SessionStore(Protocol):
    """Chat sessions on disk; every write is one transaction (a crash never loses a committed message)."""

    def create(self, title: str, settings: Mapping[str, Any] | None = None) -> SessionInfo: ...

    def get(self, session_id: str) -> SessionInfo | None: ...

    def sessions(self) -> list[SessionInfo]:
        """Every session, most recently updated first."""
        ...

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

    def truncate(self, session_id: str, message_id: int) -> int:
        """Remove that message and every later one (regenerate, edit and resend); returns how many went."""
        ...


Listener = Callable[[dict[str, Any]], None]


class TelemetryFeed(Protocol):
    """Live decode events as JSON-ready dicts (see adapters.telemetry.broadcast)."""

    def subscribe(self, listener: Listener, *, replay: int = 0, after: int | None = None) -> Callable[[], None]:
        """Deliver recent events (numbered past `after`, else the last `replay`), then every new one."""
        ...

    def summary(self, request_id: str) -> dict[str, Any] | None: ...

    def snapshot(self) -> dict[str, Any]: ...


class MachineProbe(Protocol):
    """Memory and bandwidth facts of this machine and of a loaded model (MLX; engine thread for measurements)."""

    def usable_memory(self) -> dict[str, Any]:
        """{"bytes": usable bytes, "source": how it was found}."""
        ...

    def memory_in_use(self) -> dict[str, int]:
        """{"active": bytes, "peak": bytes, "cache": bytes} as MLX reports them (0 where unknown).

        Counter reads, safe from any thread: the gauge reads them live, never through the engine."""
        ...

    def model_bytes(self, handle: Any) -> int:
        """Bytes of a loaded model's parameters (0 when unknown)."""
        ...

    def bandwidth(self, size_bytes: int = 256 << 20, repeats: int = 7) -> dict[str, Any]:
        """Weight bytes read per second by a one-row product: {"bytes_per_s", "size", "samples_s", "device"}
        (engine thread only)."""
        ...


class ModelCatalog(Protocol):
    """Local models on this machine and their deletion."""

    def local_models(self) -> list[LocalModel]: ...

    def facts(self, spec: str) -> RepoFacts | None:
        """Fit facts of the local model at path `spec` (a folder or .gguf file); None when it is no local path."""
        ...

    def delete(self, path: str) -> None: ...


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class ModelHub(Protocol):
    """A model hub speaking the Hugging Face HTTP API (HF_ENDPOINT honoured)."""

    def search(self, query: str, limit: int = 20) -> list[dict[str, Any]]: ...

    def facts(self, repo_id: str) -> RepoFacts: ...

    def download(self, repo_id: str, progress: Progress | None = None, *, files: Sequence[str] | None = None) -> str:
        """Download a repo into the Hugging Face cache; returns the snapshot path."""
        ...

"""Ports the core calls, as typing.Protocols; adapters satisfy them structurally (checked by mypy in bootstrap)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.events import DecodeEvent
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.outcome import Acceptance


class RollbackKind(enum.Enum):
    """How a target undoes the rows of rejected drafts."""

    TRIM = "trim"  # plain KV caches: drop trailing rows
    SNAPSHOT = "snapshot"  # recurrent or wrapped sliding-window state: restore and recompute


class TargetModel(Protocol):
    """The model whose distribution is the ground truth.

    One request at a time: `prefill` starts (or extends a reused prefix), each round is one `verify`
    followed by one `commit`. Uniforms are supplied by the caller so that sampling is reproducible and
    the fast path can be pinned to the domain reference.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def rollback_kind(self) -> RollbackKind: ...

    @property
    def cached_tokens(self) -> int:
        """Tokens whose rows are in the cache (the position of the next row)."""
        ...

    @property
    def cached_ids(self) -> Sequence[int]:
        """The token ids of the cached rows, in order (prefix reuse compares against them)."""
        ...

    def reset(self, keep: int = 0) -> int:
        """Drop every cached row past the first `keep` (0 = a fresh request).

        Returns:
            The rows really kept: a cache that cannot cut exactly at `keep` keeps fewer (or none).
        """
        ...

    def prefill(self, tokens: Sequence[int], sampling: SamplingParams, uniform: float) -> int:
        """Append `tokens` to the cache (all rows kept) and return the first sampled or argmax token."""
        ...

    def verify(
        self, anchor: int, block: DraftBlock, sampling: SamplingParams, uniforms: Sequence[float]
    ) -> Acceptance:
        """Run [anchor, drafts...] in one forward and decide acceptance (one host sync)."""
        ...

    def commit(self, keep_rows: int) -> None:
        """Keep the first `keep_rows` rows of the last verify, exactly undoing the rest."""
        ...

    def take_features(self) -> Any:
        """Captured target features of rows committed since the last call (opaque), or None."""
        ...


class DraftSource(Protocol):
    """Proposes tokens for the target to verify."""

    @property
    def name(self) -> str: ...

    @property
    def max_block(self) -> int:
        """The most drafts one call can propose."""
        ...

    @property
    def uses_features(self) -> bool:
        """Whether the source reads target features (the target then captures them)."""
        ...

    def begin(self, prompt: Sequence[int]) -> None:
        """Start a new request."""
        ...

    def propose(
        self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]
    ) -> DraftBlock:
        """Up to `cap` drafts after ctx.anchor, with their q (None = one-hot).

        With `cap` 0 a feature-reading source only takes ctx.features in (the decode loop replays rows it
        missed while another source ran) and proposes nothing.
        """
        ...


class Clock(Protocol):
    """Monotonic seconds."""

    def now(self) -> float: ...


class TelemetrySink(Protocol):
    """Receives decode events of a request."""

    def emit(self, request_id: str, event: DecodeEvent) -> None: ...

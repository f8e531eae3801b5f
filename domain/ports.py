"""Ports the core calls, as typing.Protocols; adapters satisfy them structurally (checked by mypy in bootstrap)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mlx_dspark.domain.costmodel.prefill import ForwardCost
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.events import TelemetryEvent
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.outcome import Acceptance

if TYPE_CHECKING:  # the decoder's work values name these ports' rows
    from mlx_dspark.domain.decoder import Prefill, Verify


class RollbackKind(enum.Enum):
    """How a target undoes the rows of rejected drafts."""

    TRIM = "trim"  # plain KV caches: drop trailing rows
    SNAPSHOT = "snapshot"  # recurrent or wrapped sliding-window state: restore and recompute


class CacheState(Protocol):
    """A saved copy of a target's cached rows (KV, recurrent state, captured features); opaque handle."""

    @property
    def length(self) -> int:
        """Rows it holds."""
        ...

    @property
    def nbytes(self) -> int:
        """Memory it keeps alive."""
        ...

    @property
    def min_length(self) -> int:
        """The shortest prefix it can be cut back to exactly (0 for plain KV, `length` for recurrent state)."""
        ...


@runtime_checkable
class ForwardCostProbe(Protocol):
    """A target that counts its forward's GEMM work and times its own GEMM: the prefill bench's limit."""

    def forward_cost(self) -> ForwardCost: ...

    def gemm_flops_per_s(self) -> float: ...


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

    def reset(self, keep: int = 0, *, capture: bool = True) -> int:
        """Drop every cached row past the first `keep` (0 = a fresh request).

        Args:
            keep: leading rows to keep (prefix reuse).
            capture: whether this request reads target features; without it a target records none
                (plain decoding pays nothing for drafters loaded beside it).

        Returns:
            The rows really kept: a cache that cannot cut exactly at `keep` keeps fewer (or none).
        """
        ...

    def prefill(self, tokens: Sequence[int], sampling: SamplingParams, uniform: float) -> int:
        """Append `tokens` to the cache (all rows kept) and return the first sampled or argmax token."""
        ...

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens` to the cache without choosing a next token (a prefill up to a snapshot point)."""
        ...

    @property
    def state_tag(self) -> str:
        """Saved states load only into a target with the same tag (it covers the capture layers).

        "" means this target cannot save or load states now (a row inside a batch): it reuses only live rows.
        """
        ...

    def save_state(self) -> CacheState:
        """The cached rows as a state that later forwards never change (cheap: shares buffers)."""
        ...

    def load_state(self, state: CacheState, keep: int) -> int:
        """Replace the cache by `state` cut to `keep` rows; returns the rows kept (0 when it cannot be exact)."""
        ...

    def verify(
        self,
        anchor: int,
        block: DraftBlock,
        sampling: SamplingParams,
        uniforms: Sequence[float],
        *,
        ahead: float | None = None,
    ) -> Acceptance:
        """Run [anchor, drafts...] in one forward and decide acceptance (one host sync).

        `ahead`, given only for an empty block whose next round is known to be another plain step
        (with that uniform): the target may queue that step from its own token before reading it back.
        A queued step is invisible: any other next call drops it exactly. Targets may ignore it.
        """
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

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        """Up to `cap` drafts after ctx.anchor, with their q (None = one-hot).

        With `cap` 0 a feature-reading source only takes ctx.features in (the decode loop replays rows it
        missed while another source ran) and proposes nothing.
        """
        ...


@runtime_checkable
class StoppingDraftSource(Protocol):
    """A draft source whose blocks can end before the cap at a cost that depends on where (a draft model's
    confidence stop: each draft is one more step of its model)."""

    def without_stop(self) -> DraftSource:
        """The same source (weights shared, state of its own) whose blocks always run to the cap: what
        calibration times, so that the cost measured at a cap is the cost of that many drafts."""
        ...


@runtime_checkable
class RowsDraftSource(Protocol):
    """A draft source whose per-request forks can draft together (the batch scheduler's greedy rows)."""

    def fork(self) -> DraftSource:
        """The same source with its own per-request state (weights shared)."""
        ...

    def propose_rows(self, rows: Sequence[tuple[DraftSource, DraftContext, int]]) -> list[DraftBlock]:
        """Greedy drafts for every (fork, context, cap) row in one batched call, in order.

        The drafts may differ from each fork's own `propose` in rounding; a greedy verify's output does not
        depend on them, a sampled one's does (so sampled rows draft alone).
        """
        ...


class Clock(Protocol):
    """Monotonic seconds."""

    def now(self) -> float: ...


class TelemetrySink(Protocol):
    """Receives a request's decode events (and the batch scheduler's ticks, under its own id)."""

    def emit(self, request_id: str, event: TelemetryEvent) -> None: ...


# The step engine's rows: a target whose requests' forwards run together (application/engine/step.py).


class Row(Protocol):
    """One request's row: the TargetModel port's bookkeeping (its forwards are the backend's)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...

    @property
    def cached_ids(self) -> tuple[int, ...]: ...

    @property
    def rollback_kind(self) -> RollbackKind: ...

    @property
    def state_tag(self) -> str: ...

    def reset(self, keep: int = 0, *, capture: bool = True) -> int: ...

    def take_features(self) -> Any: ...

    def save_state(self) -> Any: ...

    def load_state(self, state: Any, keep: int) -> int: ...


class RowsBackend(Protocol):
    """A target as rows whose forwards the step engine runs together."""

    @property
    def capacity(self) -> int:
        """Rows open at once (1: one request at a time)."""
        ...

    @property
    def speculative(self) -> bool:
        """Whether rows may verify drafts while others are open (else a batch of them steps plainly)."""
        ...

    def open(self) -> Row:
        """A new row for one request."""
        ...

    def close(self, row: Row) -> None:
        """The request ended (or failed): its row leaves at once."""
        ...

    def prefill(self, row: Row, piece: Prefill) -> tuple[bool, int | None]:
        """The next chunk of `piece` (the same piece until done): (done, the first token when `piece.last`)."""
        ...

    def verify(self, calls: Mapping[Row, Verify]) -> dict[Row, Acceptance]:
        """Every row's [anchor, drafts...] in one forward (a row of a batch: all of its rows at once)."""
        ...

    def commit(self, keep: Mapping[Row, int]) -> None:
        """Keep the first `keep[row]` verified rows of each verified row; exactly undo the rest."""
        ...

    @property
    def stats(self) -> Mapping[str, int]:
        """Counters of the backend's own (for example rows moved into a batch)."""
        ...

"""A proposed block of draft tokens and the context a draft source drafts from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs


class PendingTokens(Protocol):
    """Draft tokens still being computed on a device (an adapter's handle).

    A target that can read them itself (one readback with its verdict) does; anyone else calls `read`,
    which waits for them once.
    """

    def __len__(self) -> int: ...

    def read(self) -> tuple[int, ...]:
        """The token ids (a host sync the first time, unless a verify already read them)."""
        ...

    def head(self, n: int) -> PendingTokens:
        """The first `n` of them, still pending."""
        ...


@attrs.frozen(kw_only=True)
class DraftBlock:
    """Up to `cap` proposed tokens that follow the anchor.

    Attributes:
        tokens: the proposed token ids, in order (read from `pending` when the block has one).
        q: the proposal distributions, one row per token, as an opaque handle owned by the adapter that
            made them (a list of float rows in the reference implementation). None means the proposal is
            deterministic (one-hot q), as for lookup drafts and argmax drafts.
        source: the name of the draft source, for telemetry.
        pending: the tokens while they are still on a device (None: `tokens` holds them); lets a round
            queue its verify behind the draft and read both back at once.
    """

    _tokens: tuple[int, ...] = attrs.field(default=(), alias="tokens")
    q: Any = None
    source: str = "none"
    pending: PendingTokens | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        return self._tokens if self.pending is None else self.pending.read()

    def __len__(self) -> int:
        return len(self._tokens) if self.pending is None else len(self.pending)

    def truncated(self, n: int) -> DraftBlock:
        """The first `n` proposals (q rows are sliced lazily by whoever reads them)."""
        if n >= len(self):
            return self
        if self.pending is not None:
            return attrs.evolve(self, pending=self.pending.head(n), q=_slice_rows(self.q, n))
        return attrs.evolve(self, tokens=self._tokens[:n], q=_slice_rows(self.q, n))


def _slice_rows(q: Any, n: int) -> Any:
    if q is None:
        return None
    return q[:n]


EMPTY_BLOCK = DraftBlock()


@attrs.frozen(kw_only=True)
class DraftContext:
    """What a draft source may look at when it proposes a block.

    Attributes:
        anchor: the last committed token; its target row does not exist yet.
        position: the absolute position of the anchor (= tokens already in the target's cache).
        history: every committed token id so far (prompt + generated), anchor last.
        features: target features of rows committed since the previous call (opaque handle), or None.
    """

    anchor: int
    position: int
    history: Sequence[int]
    features: Any = None

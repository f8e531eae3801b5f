"""A proposed block of draft tokens and the context a draft source drafts from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class DraftBlock:
    """Up to `cap` proposed tokens that follow the anchor.

    Attributes:
        tokens: the proposed token ids, in order.
        q: the proposal distributions, one row per token, as an opaque handle owned by the adapter that
            made them (a list of float rows in the reference implementation). None means the proposal is
            deterministic (one-hot q), as for lookup drafts and argmax drafts.
        source: the name of the draft source, for telemetry.
    """

    tokens: tuple[int, ...] = ()
    q: Any = None
    source: str = "none"

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> DraftBlock:
        """The first `n` proposals (q rows are sliced lazily by whoever reads them)."""
        if n >= len(self.tokens):
            return self
        return attrs.evolve(self, tokens=self.tokens[:n], q=_slice_rows(self.q, n))


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

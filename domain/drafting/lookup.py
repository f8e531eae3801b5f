"""Drafter-free n-gram (prompt-lookup) drafts: continue the most recent earlier occurrence of the suffix.

Proposals are deterministic (one-hot q), so they are lossless under sampling too.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_dspark.domain.drafting.block import EMPTY_BLOCK, DraftBlock, DraftContext
from mlx_dspark.domain.tokens import SamplingParams


class NgramIndex:
    """The latest end position of every n-gram (min_n..max_n) of a growing token sequence."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._last: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in the table

    def reset(self) -> None:
        self._last.clear()
        self._indexed = 0

    def _index_until(self, seq: Sequence[int], end: int) -> None:
        for i in range(self._indexed, end):
            for n in range(self.min_n, self.max_n + 1):
                if i - n + 1 >= 0:
                    self._last[tuple(seq[i - n + 1 : i + 1])] = i
        self._indexed = max(self._indexed, end)

    def continuation(self, seq: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix match seen earlier in `seq`."""
        if limit <= 0 or len(seq) < self.min_n + 1:
            return []
        # Index every n-gram except the ones ending at the last token (that is the query).
        self._index_until(seq, len(seq) - 1)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            pos = self._last.get(tuple(seq[len(seq) - n :]))
            if pos is not None:
                return list(seq[pos + 1 : pos + 1 + limit])
        return []


class LookupDraftSource:
    """The DraftSource port over an n-gram index of prompt + generated tokens."""

    def __init__(self, block: int = 8, min_n: int = 2, max_n: int = 4) -> None:
        self._block = block
        self._index = NgramIndex(min_n, max_n)

    @property
    def name(self) -> str:
        return "lookup"

    @property
    def max_block(self) -> int:
        return self._block

    @property
    def uses_features(self) -> bool:
        return False

    def begin(self, prompt: Sequence[int]) -> None:
        self._index.reset()

    def fork(self) -> LookupDraftSource:
        """A source with the same settings and its own index (one per batched request)."""
        return LookupDraftSource(self._block, self._index.min_n, self._index.max_n)

    def propose(
        self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]
    ) -> DraftBlock:
        tokens = self._index.continuation(ctx.history, min(cap, self._block))
        if not tokens:
            return EMPTY_BLOCK
        return DraftBlock(tokens=tuple(tokens), q=None, source=self.name)

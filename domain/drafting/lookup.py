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


class _Prefix(Sequence[int]):
    """The first `n` tokens of a list, without copying (what the history was when a round began)."""

    def __init__(self, seq: Sequence[int], n: int) -> None:
        self._seq, self._n = seq, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
        if isinstance(i, slice):
            return self._seq[slice(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._seq[i % self._n]


class ShadowLookup:
    """n-gram lookup's rounds replayed on the tokens a request really committed.

    A lookup round at history length p drafts the continuation of the history's suffix and commits its
    matching prefix plus one token; the next round begins after them. Greedy output is the same whatever
    source runs, so on the committed tokens this is exactly what lookup would have done; under sampling it
    is what lookup's drafts would have matched. Host work only: an n-gram table lookup per round.
    """

    def __init__(self, block: int, min_n: int = 2, max_n: int = 4) -> None:
        self._block = block
        self._index = NgramIndex(min_n, max_n)
        self._cursor: int | None = None

    def advance(self, history: Sequence[int], start: int) -> list[tuple[int, int]]:
        """Every shadow round the history now decides: (tokens committed, tokens drafted) per round.

        Args:
            history: prompt and every committed token so far.
            start: where replay begins when this is the first call (the first round's history length).
        """
        if self._cursor is None:
            self._cursor = start
        out = []
        while self._cursor < len(history):
            p = self._cursor
            draft = self._index.continuation(_Prefix(history, p), self._block)
            known = len(history) - p  # tokens after p already committed
            matched = 0
            while matched < len(draft) and matched < known and draft[matched] == history[p + matched]:
                matched += 1
            if matched < len(draft) and matched >= known:
                break  # the round's outcome waits for tokens not committed yet
            if matched + 1 > known:
                break  # its bonus token is not committed yet
            out.append((matched + 1, len(draft)))
            self._cursor = p + matched + 1
        return out


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

    def shadow(self) -> ShadowLookup:
        """A replay of this source's rounds on tokens committed by any source (auto's free forecast)."""
        return ShadowLookup(self._block, self._index.min_n, self._index.max_n)

    def fork(self) -> LookupDraftSource:
        """A source with the same settings and its own index (one per batched request)."""
        return LookupDraftSource(self._block, self._index.min_n, self._index.max_n)

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        tokens = self._index.continuation(ctx.history, min(cap, self._block))
        if not tokens:
            return EMPTY_BLOCK
        return DraftBlock(tokens=tuple(tokens), q=None, source=self.name)

"""An oracle target whose next-token distribution is a pure function of the prefix."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import attrs

from mlx_dspark.domain.drafting.block import DraftBlock
from mlx_dspark.domain.ports import RollbackKind
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.distribution import argmax, distribution, sample_index
from mlx_dspark.domain.verification.greedy import longest_accepted_prefix
from mlx_dspark.domain.verification.outcome import Acceptance
from mlx_dspark.domain.verification.sampled import speculative_accept


def oracle_logits(prefix: Sequence[int], vocab: int, context: int, sharpness: float = 3.0) -> list[float]:
    """Deterministic logits from the last `context` tokens (and the prefix length parity)."""
    key = bytes(str(tuple(prefix[-context:])), "ascii")
    seed = zlib.crc32(key)
    out = []
    for i in range(vocab):
        seed = (seed * 1103515245 + 12345 + i) & 0x7FFFFFFF
        out.append(sharpness * (seed / 0x7FFFFFFF))
    return out


@attrs.frozen
class OracleState:
    """A saved cache of the oracle: its rows; a SNAPSHOT oracle loads only at the full length."""

    rows: tuple[int, ...]
    min_length: int

    @property
    def length(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return 8 * len(self.rows)


class OracleTarget:
    """A target model with an exact, inspectable cache of committed rows.

    Attributes:
        rows: tokens whose rows are in the cache, in order.
        trims: how many rows each commit rolled back (for assertions).
        calls: (drafts, uniforms, ahead) of every verify, in order.
        blocks: every verified row list [anchor, drafts...], in order.
        captures: the `capture` flag of every reset.
    """

    def __init__(
        self,
        vocab: int = 16,
        context: int = 2,
        rollback: RollbackKind = RollbackKind.TRIM,
        logits_fn: Any = None,
    ) -> None:
        self.vocab_size = vocab
        self.rollback_kind = rollback
        self._logits_fn = logits_fn or (lambda prefix: oracle_logits(prefix, vocab, context))
        self.rows: list[int] = []
        self._pending: list[int] = []
        self._feature_rows: list[tuple[int, int]] = []
        self.trims: list[int] = []
        self.blocks: list[tuple[int, ...]] = []
        self.calls: list[tuple[int, tuple[float, ...], float | None]] = []
        self.captures: list[bool] = []
        self.saves = 0

    # The pure function that defines this target.
    def logits(self, prefix: Sequence[int]) -> list[float]:
        return list(self._logits_fn(prefix))

    def greedy_next(self, prefix: Sequence[int]) -> int:
        return argmax(self.logits(prefix))

    def greedy_continuation(self, prefix: Sequence[int], n: int) -> list[int]:
        seq = list(prefix)
        for _ in range(n):
            seq.append(self.greedy_next(seq))
        return seq[len(prefix) :]

    @property
    def cached_tokens(self) -> int:
        return len(self.rows)

    @property
    def cached_ids(self) -> tuple[int, ...]:
        return tuple(self.rows)

    def reset(self, keep: int = 0, *, capture: bool = True) -> int:
        self.captures.append(capture)
        del self.rows[keep:]
        self._pending = []
        self._feature_rows = [(i, t) for i, t in enumerate(self.rows)]
        return len(self.rows)

    def _pick(self, prefix: Sequence[int], sampling: SamplingParams, u: float) -> int:
        return sample_index(distribution(self.logits(prefix), sampling), u)

    def charge(self, width: int) -> None:
        """Called before every forward of `width` rows over the cached ones (timed fakes charge for it)."""

    def prefill(self, tokens: Sequence[int], sampling: SamplingParams, uniform: float) -> int:
        self.charge(len(tokens))
        start = len(self.rows)
        self.rows.extend(tokens)
        self._feature_rows.extend((start + i, t) for i, t in enumerate(tokens))
        return self._pick(self.rows, sampling, uniform)

    def extend(self, tokens: Sequence[int]) -> None:
        start = len(self.rows)
        self.rows.extend(tokens)
        self._feature_rows.extend((start + i, t) for i, t in enumerate(tokens))

    @property
    def state_tag(self) -> str:
        return "oracle"

    def save_state(self) -> OracleState:
        self.saves += 1
        trimmable = self.rollback_kind is RollbackKind.TRIM
        return OracleState(rows=tuple(self.rows), min_length=0 if trimmable else len(self.rows))

    def load_state(self, state: OracleState, keep: int) -> int:
        self._pending = []
        if not state.min_length <= keep <= state.length:
            self.reset(0)
            return 0
        self.rows = list(state.rows[:keep])
        self._feature_rows = [(i, t) for i, t in enumerate(self.rows)]
        return keep

    def verify(
        self,
        anchor: int,
        block: DraftBlock,
        sampling: SamplingParams,
        uniforms: Sequence[float],
        *,
        ahead: float | None = None,
    ) -> Acceptance:
        self.calls.append((len(block), tuple(uniforms), ahead))
        rows = [anchor, *block.tokens]
        self.charge(len(rows))
        self.blocks.append(tuple(rows))
        self._pending = rows
        base = list(self.rows)
        logits = [self.logits([*base, *rows[: i + 1]]) for i in range(len(rows))]
        if sampling.greedy:
            return longest_accepted_prefix(block.tokens, [argmax(row) for row in logits])
        p_rows = [distribution(row, sampling) for row in logits]
        return speculative_accept(block.tokens, p_rows, block.q, uniforms)

    def commit(self, keep_rows: int) -> None:
        start = len(self.rows)
        kept = self._pending[:keep_rows]
        self.trims.append(len(self._pending) - len(kept))
        self.rows.extend(kept)
        self._feature_rows.extend((start + i, t) for i, t in enumerate(kept))
        self._pending = []

    def take_features(self) -> list[tuple[int, int]]:
        rows, self._feature_rows = self._feature_rows, []
        return rows

"""Scripted draft sources: always right, always wrong, right on a pattern, random, or sampled from a q."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.domain.verification.distribution import sample_index
from tests.fakes.oracle import OracleTarget


class _BlockSource:
    """A draft source of up to `block` drafts per round (named by `name`; reads features if `uses_features`)."""

    name = "block"
    uses_features = False

    def __init__(self, block: int) -> None:
        self._block = block

    @property
    def max_block(self) -> int:
        return self._block

    def begin(self, prompt: Sequence[int]) -> None:
        pass


class ScriptedDraftSource(_BlockSource):
    """Proposes the oracle's greedy continuation, corrupted where `right(round, slot)` is False."""

    uses_features = True

    def __init__(
        self,
        oracle: OracleTarget,
        right: Callable[[int, int], bool] = lambda r, i: True,
        block: int = 4,
        name: str = "scripted",
    ) -> None:
        super().__init__(block)
        self._oracle = oracle
        self._right = right
        self.name = name
        self.round = 0
        self.features_seen: list[tuple[int, int]] = []
        self.calls: list[int] = []

    def begin(self, prompt: Sequence[int]) -> None:
        self.round = 0
        self.features_seen = []

    def propose(
        self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]
    ) -> DraftBlock:
        if ctx.features:
            self.features_seen.extend(ctx.features)
        self.calls.append(cap)
        seq = list(ctx.history)
        out: list[int] = []
        for slot in range(cap):
            tok = self._oracle.greedy_next(seq)
            if not self._right(self.round, slot):
                tok = (tok + 1) % self._oracle.vocab_size
            out.append(tok)
            seq.append(tok)
        self.round += 1
        return DraftBlock(tokens=tuple(out), source=self.name)


class RandomDraftSource(_BlockSource):
    """Uniformly random proposals (deterministic q = one-hot)."""

    name = "random"

    def __init__(self, vocab: int, block: int = 4, seed: int = 0) -> None:
        super().__init__(block)
        self._vocab = vocab
        self._rng = random.Random(seed)

    def propose(
        self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]
    ) -> DraftBlock:
        return DraftBlock(tokens=tuple(self._rng.randrange(self._vocab) for _ in range(cap)), source=self.name)


class SampledDraftSource(_BlockSource):
    """Samples each draft from a fixed proposal q(prefix) and reports q (a stochastic drafter)."""

    name = "sampled"

    def __init__(self, q_fn: Callable[[Sequence[int]], list[float]], block: int = 3) -> None:
        super().__init__(block)
        self._q_fn = q_fn

    def propose(
        self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]
    ) -> DraftBlock:
        seq = list(ctx.history)
        toks, rows = [], []
        for i in range(cap):
            q = self._q_fn(seq)
            tok = sample_index(q, uniforms[i])
            toks.append(tok)
            rows.append(q)
            seq.append(tok)
        return DraftBlock(tokens=tuple(toks), q=rows, source=self.name)

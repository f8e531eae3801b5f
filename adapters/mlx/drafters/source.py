"""What DFlash and DSpark draft sources share: the verified-context cache fed from target features,
the block layout, and turning per-slot logits into proposals (argmax, or sampled with their q).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Self

import mlx.core as mx

from mlx_dspark.adapters.mlx.acceptance import sample_index, truncated_probs
from mlx_dspark.adapters.mlx.drafters.backbone import ContextCache, DrafterBackbone
from mlx_dspark.domain.drafting.block import DraftContext
from mlx_dspark.domain.tokens import SamplingParams

PROPOSALS = ("sample", "argmax")


class BackboneDraftSource:
    """Owns a drafter's `ContextCache` and keeps it in step with the rows the target committed."""

    def __init__(self, drafter: DrafterBackbone, *, proposal: str = "sample") -> None:
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
        self.drafter = drafter
        self.proposal = proposal
        self.cache = ContextCache(drafter)
        # Where this drafter's layers sit in the target's features (which may hold other drafters' too).
        self._columns: Callable[[Sequence[int]], mx.array | None] = lambda _ids: None

    def bind_features(self, columns: Callable[[Sequence[int]], mx.array | None]) -> None:
        """Read this drafter's layers through `columns(layer_ids)` (None = the features are exactly them)."""
        self._columns = columns

    @property
    def uses_features(self) -> bool:
        return True

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.drafter.config.target_layer_ids

    def begin(self, prompt: Sequence[int]) -> None:
        self.cache.reset()

    def fork(self) -> Self:
        """The same drafter (weights and feature columns shared) with its own context cache: one per batched
        request."""
        twin = copy.copy(self)
        twin.cache = ContextCache(self.drafter)
        return twin

    def ingest(self, ctx: DraftContext) -> None:
        """Append the target features of rows committed since the last call (they end at the anchor)."""
        features = ctx.features
        if features is None:
            return
        n = int(features.shape[-2])
        if n:
            cols = self._columns(self.target_layer_ids)
            own = features if cols is None else mx.take(features, cols, axis=-1)
            self.cache.append(own, ctx.position - n)

    def round_size(self, ctx: DraftContext, cap: int) -> int:
        """Ingest the new context rows and return how many drafts this round makes (0: only the cache moved)."""
        self.ingest(ctx)
        n = max(0, min(cap, self.max_block))
        if n == 0:
            mx.async_eval(self.cache.state())
        return n

    @property
    def max_block(self) -> int:
        raise NotImplementedError

    def block_ids(self, anchor: int) -> mx.array:
        cfg = self.drafter.config
        return mx.array([[anchor] + [cfg.mask_token_id] * (cfg.block_size - 1)], dtype=mx.int32)

    def sampled(self, sampling: SamplingParams) -> bool:
        """Whether proposals are drawn from q (else argmax with a one-hot q, also lossless)."""
        return not sampling.greedy and self.proposal == "sample"


def pick(logits: mx.array, sampling: SamplingParams, uniforms: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """Proposals from logits [V] or [n, V]: argmax (q None) when `uniforms` is None, else inverse-CDF draws
    from q = the target's own truncation of these logits (adapters/mlx/acceptance.py), returned with q.

    Any q is lossless as long as the draft really is drawn from it; the target's temperature and
    truncation only maximize acceptance.
    """
    if uniforms is None:
        return mx.argmax(logits, axis=-1).astype(mx.int32), None
    q = truncated_probs(logits, sampling)
    if q.ndim == 1:
        return sample_index(q, uniforms), q
    return mx.stack([sample_index(q[i], uniforms[i]) for i in range(q.shape[0])]), q

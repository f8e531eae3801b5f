"""What DFlash and DSpark draft sources share: the verified-context cache fed from target features,
the block layout, and turning per-slot logits into proposals (argmax, or sampled with their q).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Self, cast

import mlx.core as mx

from mlx_dspark.adapters.mlx import row_products
from mlx_dspark.adapters.mlx.acceptance import sample_index, truncated_probs
from mlx_dspark.adapters.mlx.drafters.backbone import ContextCache, DrafterBackbone
from mlx_dspark.adapters.mlx.readback import DeviceTokens
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.ports import DraftSource
from mlx_dspark.domain.tokens import SamplingParams

PROPOSALS = ("sample", "argmax")
ARGMAX = SamplingParams()  # greedy drafts: the argmax of each slot


class BackboneDraftSource:
    """Owns a drafter's `ContextCache` and keeps it in step with the rows the target committed."""

    def __init__(self, drafter: DrafterBackbone, *, proposal: str = "sample") -> None:
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
        self.drafter = drafter
        row_products.install(drafter)  # its blocks' projections, as the target's verify (CUDA)
        self.proposal = proposal
        self._graphs: dict[tuple[int, ...], Any] = {}  # compiled block forwards, shared by every fork
        self.cache = ContextCache(drafter, self._graphs)
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
        twin.cache = ContextCache(self.drafter, self._graphs)
        return twin

    def ingest(self, ctx: DraftContext) -> None:
        """Append the target features of rows committed since the last call (they end at the anchor)."""
        if ctx.features is not None and int(ctx.features.shape[-2]):
            self.cache.append(*self._context_rows(ctx))

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

    @property
    def first_slot(self) -> int:
        """The block slot of the first draft (the slots before it only carry the anchor)."""
        raise NotImplementedError

    def greedy_slots(self, h: mx.array, anchors: mx.array) -> tuple[mx.array, mx.array | None]:
        """Argmax drafts [B, n] (target ids) from the draft slots' hidden states `h` [B, n, H] of blocks after
        `anchors` [B], and their confidences [B, n] when this source truncates on them (else None)."""
        raise NotImplementedError

    def propose_rows(self, rows: Sequence[tuple[DraftSource, DraftContext, int]]) -> list[DraftBlock]:
        """Greedy drafts of several requests at once: each row is (a `fork` of this source, its context, its cap).

        One batched drafter forward serves every row (the context rows' fusion and K/V too), so each weight is
        read once per tick instead of once per request. Its rounding may differ from a row's own `propose`,
        which changes which drafts a greedy verify accepts, never its output; a sampled row must draft alone
        (its q is part of its seeded output).
        """
        forks: list[BackboneDraftSource] = []
        for fork, _, _ in rows:
            if not isinstance(fork, BackboneDraftSource) or fork.drafter is not self.drafter:
                raise ValueError("propose_rows takes forks of this source")
            forks.append(fork)
        chunks = [fork._context_rows(ctx) for fork, (_, ctx, _) in zip(forks, rows, strict=True)]
        ContextCache.append_rows([fork.cache for fork in forks], chunks)
        sizes = [max(0, min(cap, self.max_block)) for _, _, cap in rows]
        blocks = [DraftBlock(source=self.name) for _ in rows]
        live = [j for j, n in enumerate(sizes) if n]
        if not live:
            mx.async_eval(*(a for fork in forks for a in fork.cache.state()))
            return blocks
        widest = max(sizes)
        ids = mx.concatenate([self.block_ids(rows[j][1].anchor) for j in live], axis=0)
        h = ContextCache.forward_rows(
            [forks[j].cache for j in live], self.drafter.embed_block(ids), [rows[j][1].position for j in live]
        )
        anchors = mx.array([rows[j][1].anchor for j in live], dtype=mx.int32)
        tokens, confidences = self.greedy_slots(h[:, self.first_slot : self.first_slot + widest], anchors)
        # Each row's own slice is queued too: its verify may read it on another thread, which has no stream.
        own = [tokens[b, : sizes[j]] for b, j in enumerate(live)]
        states = [a for fork in forks for a in fork.cache.state()]
        mx.async_eval(*own, *([] if confidences is None else [confidences]), *states)
        kept = confidences.tolist() if confidences is not None else None
        for b, j in enumerate(live):
            block = DraftBlock(pending=DeviceTokens(own[b]), source=self.name)
            if kept is not None:
                block = forks[j].truncate_on_confidence(block, cast(list[float], kept[b])[: sizes[j]])
            blocks[j] = block
        return blocks

    def truncate_on_confidence(self, block: DraftBlock, confidences: list[float]) -> DraftBlock:
        """A source that truncates on confidence cuts `block` here (the others have none to cut on)."""
        return block

    def _context_rows(self, ctx: DraftContext) -> tuple[mx.array, int]:
        """This drafter's columns of the features in `ctx` and the position of their first row."""
        features = ctx.features
        if features is None:
            return mx.zeros((0, 0)), ctx.position
        cols = self._columns(self.target_layer_ids)
        own = features if cols is None else mx.take(features, cols, axis=-1)
        return own, ctx.position - int(features.shape[-2])

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

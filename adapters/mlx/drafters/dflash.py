"""z-lab DFlash (drafters.md §2): block [anchor, MASK×(bs−1)] embedded with the target's embedding, the
target's LM head, slots 1..bs−1 are drafts (slot k predicts anchor+k).

`DFlashDrafter` is the trainable module (pure forward); `DFlashDraftSource` is the inference DraftSource.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx
from mlx import nn

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.drafters.backbone import DrafterBackbone, Positions
from mlx_dspark.adapters.mlx.drafters.checkpoint import check_fits_target, load_strict, prepare
from mlx_dspark.adapters.mlx.drafters.config import DFlashConfig
from mlx_dspark.adapters.mlx.drafters.source import BackboneDraftSource, pick
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.tokens import SamplingParams

ArrayFn = Callable[[mx.array], mx.array]


def target_embedding(target_model: nn.Module, scale: float | None) -> ArrayFn:
    """The target's token embedding; an explicit `scale` from the drafter config replaces the family's."""
    if scale is None:
        return lambda ids: model_parts.embed(target_model, ids)
    decoder_embed = model_parts._decoder(target_model).embed_tokens
    return lambda ids: decoder_embed(ids) * scale


def target_head(target_model: nn.Module, multiplier: float | None, cap: float | None) -> ArrayFn:
    """The target's LM head; the drafter config's output multiplier / softcap replace the family's when set."""
    if multiplier is None and cap is None:
        return lambda h: model_parts.lm_head(target_model, h)

    def head(h: mx.array) -> mx.array:
        out = model_parts.head_projection(target_model, h)
        if multiplier is not None:
            out = out * multiplier
        return model_parts.softcap(out, cap)

    return head


class DFlashDrafter(DrafterBackbone):
    """The DFlash drafter: the shared backbone bound to the target's embedding and head (frozen, not params).

    Args:
        config: the parsed checkpoint config.
        embed_fn: token ids → input embeddings (the target's).
        head_fn: final-normed hidden → logits (the target's head).
    """

    def __init__(self, config: DFlashConfig, *, embed_fn: ArrayFn, head_fn: ArrayFn) -> None:
        super().__init__(config.backbone)
        self.dflash_config = config
        self.embed_fn = embed_fn
        self.head_fn = head_fn

    def embed_block(self, ids: mx.array) -> mx.array:
        return self.embed_fn(ids).astype(self.dtype)

    def logits(self, h: mx.array) -> mx.array:
        return self.head_fn(h)

    def __call__(
        self,
        block_ids: mx.array,
        context_features: mx.array | None,
        *,
        positions: Positions,
        context_positions: Positions = 0,
        masks: Any = None,
    ) -> mx.array:
        """Pure forward (training and reference): logits for every block slot.

        Args:
            block_ids: [B, L] block tokens (anchor then masks; several blocks may be concatenated).
            context_features: [B, S, m·H_t] concatenated target features of the context rows, or None.
            positions: absolute positions of the block rows (start offset, [L] or [B, L] ids).
            context_positions: positions of the context rows (start offset or ids).
            masks: see `DrafterBackbone.hidden` (a training mask hides other blocks and context ≥ anchor).

        Returns:
            [B, L, V] logits; slot k of a block predicts the token at anchor + k (slot 0 is unused).
        """
        context = None
        if context_features is not None:
            context = self.context_kv(self.fuse(context_features), context_positions)
        h = self.hidden(self.embed_block(block_ids), positions, context=context, masks=masks)
        return self.logits(h)

    @classmethod
    def from_weights(
        cls,
        config: DFlashConfig,
        weights: Mapping[str, mx.array],
        target_model: nn.Module,
        *,
        bits: int | None = 0,
        dtype: mx.Dtype | None = None,
        where: str = "DFlash drafter",
    ) -> DFlashDrafter:
        """Build, check against the target, load strictly, then cast/quantize.

        Raises:
            IncompatibleDrafter: the drafter does not fit `target_model`.
            ModelUnavailable: missing/unexpected tensors or wrong shapes.
        """
        check_fits_target(config.backbone, target_model, uses_target_vocab=True, where=where)
        drafter = cls(
            config,
            embed_fn=target_embedding(target_model, config.input_embedding_scale),
            head_fn=target_head(target_model, config.output_multiplier, config.final_logit_softcapping),
        )
        load_strict(drafter, weights, where=where)
        prepare(drafter, bits=bits, dtype=dtype)
        drafter.freeze()
        return drafter


class DFlashDraftSource(BackboneDraftSource):
    """DraftSource over a `DFlashDrafter`: one draft forward per round, one host sync (the tokens)."""

    drafter: DFlashDrafter

    @property
    def name(self) -> str:
        return "dflash"

    @property
    def max_block(self) -> int:
        return self.drafter.config.block_size - 1

    def propose(
        self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]
    ) -> DraftBlock:
        """Up to `cap` drafts after ctx.anchor (slots 1..cap of the full block, which stays bidirectional)."""
        self.ingest(ctx)
        n = max(0, min(cap, self.max_block))
        if n == 0:
            mx.eval(self.cache.state())
            return DraftBlock(source=self.name)
        h = self.cache.forward(self.drafter.embed_block(self.block_ids(ctx.anchor)), ctx.position)
        logits = self.drafter.logits(h[0, 1 : 1 + n])
        u = mx.array(list(uniforms[:n]), dtype=mx.float32) if self.sampled(sampling) else None
        tokens, q = pick(logits, sampling, u)
        mx.eval(tokens, *([] if q is None else [q]), *self.cache.state())
        return DraftBlock(tokens=tuple(tokens.tolist()), q=q, source=self.name)

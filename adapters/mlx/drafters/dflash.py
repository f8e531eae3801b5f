"""z-lab DFlash (drafters.md §2): block [anchor, MASK×(bs−1)] embedded with the target's embedding, the
target's LM head, slots 1..bs−1 are drafts (slot k predicts anchor+k).

`DFlashDrafter` is the trainable module (pure forward); `DFlashDraftSource` is the inference DraftSource.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
from mlx import nn

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.drafters import heads
from mlx_dspark.adapters.mlx.drafters.backbone import DrafterBackbone, Positions
from mlx_dspark.adapters.mlx.drafters.checkpoint import check_fits_target
from mlx_dspark.adapters.mlx.drafters.config import DFlashConfig
from mlx_dspark.adapters.mlx.drafters.source import ARGMAX, BackboneDraftSource, pick
from mlx_dspark.adapters.mlx.readback import DeviceTokens
from mlx_dspark.domain.drafting.block import DraftBlock, DraftContext
from mlx_dspark.domain.tokens import SamplingParams


class DFlashDrafter(DrafterBackbone, heads.DraftVocabulary):
    """The DFlash drafter: the shared backbone bound to the target's embedding and head (frozen, not params).

    With a `d2t` table the drafter carries its own `lm_head`: the target head's rows of a reduced draft
    vocabulary (the full 49,152-row head costs more than the drafter's layers on a CPU); its logits are over
    draft ids, mapped back with `to_target_ids` / `to_target_probs`.

    Args:
        config: the parsed checkpoint config.
        embed_fn: token ids → input embeddings (the target's).
        head_fn: final-normed hidden → logits (the target's head).
        vocab_size: the target vocabulary (with `d2t`).
        d2t: offsets mapping draft id d to target id d + d2t[d], or None for the target's full head.
    """

    def __init__(
        self,
        config: DFlashConfig,
        *,
        embed_fn: heads.ArrayFn,
        head_fn: heads.ArrayFn,
        vocab_size: int | None = None,
        d2t: mx.array | None = None,
    ) -> None:
        super().__init__(config.backbone)
        self.dflash_config = config
        self.embed_fn = embed_fn
        self.head_fn = head_fn
        self.vocab_size = vocab_size
        if d2t is not None:
            self.lm_head = nn.Linear(config.backbone.hidden_size, int(d2t.shape[0]), bias=False)
        self.map_draft_vocabulary(d2t)

    def embed_block(self, ids: mx.array) -> mx.array:
        return self.embed_fn(ids).astype(self.dtype)

    def logits(self, h: mx.array) -> mx.array:
        """Logits over the draft vocabulary (the target's, or the reduced one with a d2t table)."""
        if "lm_head" not in self:
            return self.head_fn(h)
        cfg = self.dflash_config
        return heads.own_head_logits(self.lm_head, h, cfg.output_multiplier, cfg.final_logit_softcapping)

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
        return self.logits(self.block_hidden(block_ids, context_features, positions, context_positions, masks))

    @classmethod
    def assemble(
        cls, config: DFlashConfig, weights: Mapping[str, mx.array], target_model: nn.Module, *, where: str
    ) -> tuple[DFlashDrafter, Mapping[str, mx.array]]:
        check_fits_target(config.backbone, target_model, uses_target_vocab=True, where=where)
        vocab = model_parts.vocab_size(target_model)
        d2t = heads.checked_d2t(weights, config.draft_vocab_size, vocab, where=where)
        drafter = cls(
            config,
            embed_fn=heads.target_embedding(target_model, config.input_embedding_scale),
            head_fn=heads.target_head(target_model, config.output_multiplier, config.final_logit_softcapping),
            vocab_size=vocab,
            d2t=d2t,
        )
        weights = {k: v for k, v in weights.items() if k != "d2t"}
        if d2t is not None and "lm_head.weight" not in weights:
            # This project's reduced heads ship no rows: they are the target head's rows of the d2t ids.
            weights["lm_head.weight"] = model_parts.head_rows(target_model, heads.mapped_ids(d2t))
        return drafter, weights


class DFlashDraftSource(BackboneDraftSource):
    """DraftSource over a `DFlashDrafter`: one draft forward per round, queued on the device
    (the target reads the tokens back with its verdict)."""

    drafter: DFlashDrafter

    @property
    def name(self) -> str:
        return "dflash"

    @property
    def max_block(self) -> int:
        return self.drafter.config.block_size - 1

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
        """Up to `cap` drafts after ctx.anchor (slots 1..cap of the full block, which stays bidirectional)."""
        n = self.round_size(ctx, cap)
        if n == 0:
            return DraftBlock(source=self.name)
        h = self.cache.block_hidden(self.block_ids(ctx.anchor), ctx.position)
        logits = self.drafter.logits(h[0, 1 : 1 + n])
        u = mx.array(list(uniforms[:n]), dtype=mx.float32) if self.sampled(sampling) else None
        tokens, q = pick(logits, sampling, u)
        tokens = self.drafter.to_target_ids(tokens)
        q = None if q is None else self.drafter.to_target_probs(q)
        # Queued, not read: the verify reads the tokens back with its verdict.
        mx.async_eval(tokens, *([] if q is None else [q]), *self.cache.state())
        return DraftBlock(pending=DeviceTokens(tokens), q=q, source=self.name)

    @property
    def first_slot(self) -> int:
        return 1

    def greedy_slots(self, h: mx.array, anchors: mx.array) -> tuple[mx.array, mx.array | None]:
        tokens, _ = pick(self.drafter.logits(h), ARGMAX, None)
        return self.drafter.to_target_ids(tokens), None

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
from mlx_dspark.domain.errors import IncompatibleDrafter
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
        embed_fn: ArrayFn,
        head_fn: ArrayFn,
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
        self._draft_to_target = None if d2t is None else (mx.arange(d2t.shape[0]) + d2t).astype(mx.int32)

    def embed_block(self, ids: mx.array) -> mx.array:
        return self.embed_fn(ids).astype(self.dtype)

    def logits(self, h: mx.array) -> mx.array:
        """Logits over the draft vocabulary (the target's, or the reduced one with a d2t table)."""
        if "lm_head" not in self:
            return self.head_fn(h)
        out = self.lm_head(h)
        cfg = self.dflash_config
        if cfg.output_multiplier is not None:
            out = out * cfg.output_multiplier
        return model_parts.softcap(out, cfg.final_logit_softcapping)

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        """Draft-vocabulary ids → target ids (identity for the full head)."""
        return draft_ids if self._draft_to_target is None else self._draft_to_target[draft_ids]

    def to_target_probs(self, q: mx.array) -> mx.array:
        """Draft-vocabulary distributions [..., V_d] → the same distributions over the target vocabulary."""
        if self._draft_to_target is None:
            return q
        assert self.vocab_size is not None
        idx = mx.broadcast_to(self._draft_to_target, q.shape)
        return mx.put_along_axis(mx.zeros((*q.shape[:-1], self.vocab_size), dtype=q.dtype), idx, q, axis=-1)

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
        vocab = model_parts.vocab_size(target_model)
        d2t = weights.get("d2t")
        if d2t is not None:
            d2t = d2t.astype(mx.int32)
            mapped = mx.arange(d2t.shape[0]) + d2t
            if int(mx.max(mapped).item()) >= vocab or int(mx.min(mapped).item()) < 0:
                raise IncompatibleDrafter(message=f"{where}: its d2t table maps outside the target vocabulary")
            if config.draft_vocab_size is not None and config.draft_vocab_size != d2t.shape[0]:
                raise IncompatibleDrafter(
                    message=f"{where}: d2t has {d2t.shape[0]} rows but draft_vocab_size is {config.draft_vocab_size}"
                )
        elif config.draft_vocab_size is not None and config.draft_vocab_size != vocab:
            raise IncompatibleDrafter(message=f"{where}: a draft vocabulary of {config.draft_vocab_size} needs d2t")
        drafter = cls(
            config,
            embed_fn=target_embedding(target_model, config.input_embedding_scale),
            head_fn=target_head(target_model, config.output_multiplier, config.final_logit_softcapping),
            vocab_size=vocab,
            d2t=d2t,
        )
        weights = {k: v for k, v in weights.items() if k != "d2t"}
        if d2t is not None and "lm_head.weight" not in weights:
            # This project's reduced heads ship no rows: they are the target head's rows of the d2t ids.
            weights["lm_head.weight"] = model_parts.head_rows(target_model, mx.arange(d2t.shape[0]) + d2t)
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

    def propose(self, ctx: DraftContext, cap: int, sampling: SamplingParams, uniforms: Sequence[float]) -> DraftBlock:
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
        tokens = self.drafter.to_target_ids(tokens)
        q = None if q is None else self.drafter.to_target_probs(q)
        mx.eval(tokens, *([] if q is None else [q]), *self.cache.state())
        return DraftBlock(tokens=tuple(tokens.tolist()), q=q, source=self.name)

"""What the DFlash and DSpark drafters share at the vocabulary ends: the target's embedding and LM head
bound as functions, a checkpoint's own head with its output multiplier / softcap, and the `d2t` table of a
reduced draft vocabulary (checked once, mapped back to target ids and distributions).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import mlx.core as mx
from mlx import nn

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.domain.errors import IncompatibleDrafter

ArrayFn = Callable[[mx.array], mx.array]


def target_embedding(target_model: nn.Module, scale: float | None) -> ArrayFn:
    """The target's token embedding; an explicit `scale` from the drafter config replaces the family's."""
    if scale is None:
        return lambda ids: model_parts.embed(target_model, ids)
    decoder_embed = model_parts.embedding(target_model)
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


def own_head_logits(lm_head: nn.Module, h: mx.array, multiplier: float | None, cap: float | None) -> mx.array:
    """A checkpoint's own `lm_head` with its output multiplier and final-logit softcap."""
    out = lm_head(h)
    if multiplier is not None:
        out = out * multiplier
    return model_parts.softcap(out, cap)


def mapped_ids(d2t: mx.array) -> mx.array:
    """The target id of every draft id: d + d2t[d]."""
    return (mx.arange(d2t.shape[0]) + d2t.astype(mx.int32)).astype(mx.int32)


def checked_d2t(
    weights: Mapping[str, mx.array], draft_vocab_size: int | None, vocab: int, *, where: str
) -> mx.array | None:
    """The checkpoint's `d2t` table (int32), or None for a full-vocabulary drafter.

    Raises:
        IncompatibleDrafter: the table maps outside the target vocabulary, or disagrees with draft_vocab_size.
    """
    d2t = weights.get("d2t")
    if d2t is None:
        if draft_vocab_size is not None and draft_vocab_size != vocab:
            raise IncompatibleDrafter(
                message=f"{where}: draft vocabulary of {draft_vocab_size} tokens needs a d2t table"
            )
        return None
    d2t = d2t.astype(mx.int32)
    mapped = mapped_ids(d2t)
    if int(mx.max(mapped).item()) >= vocab or int(mx.min(mapped).item()) < 0:
        raise IncompatibleDrafter(message=f"{where}: its d2t table maps outside the target vocabulary")
    if draft_vocab_size is not None and draft_vocab_size != d2t.shape[0]:
        raise IncompatibleDrafter(
            message=f"{where}: d2t has {d2t.shape[0]} rows but draft_vocab_size is {draft_vocab_size}"
        )
    return d2t


class DraftVocabulary:
    """Maps a drafter's outputs over a reduced draft vocabulary back to the target's (identity without d2t).

    A mixin of the drafter modules: call `map_draft_vocabulary` in `__init__`.
    """

    vocab_size: int | None
    _draft_to_target: mx.array | None

    def map_draft_vocabulary(self, d2t: mx.array | None) -> None:
        # Underscore: a lookup table, not a parameter (excluded from training and quantization).
        self._draft_to_target = None if d2t is None else mapped_ids(d2t)

    def to_target_ids(self, draft_ids: mx.array) -> mx.array:
        """Draft-vocabulary ids → target ids (identity for a full-vocabulary head)."""
        return draft_ids if self._draft_to_target is None else self._draft_to_target[draft_ids]

    def to_target_probs(self, q: mx.array) -> mx.array:
        """Draft-vocabulary distributions [..., V_d] → the same distributions over the target vocabulary."""
        if self._draft_to_target is None:
            return q
        assert self.vocab_size is not None
        idx = mx.broadcast_to(self._draft_to_target, q.shape)
        return mx.put_along_axis(mx.zeros((*q.shape[:-1], self.vocab_size), dtype=q.dtype), idx, q, axis=-1)

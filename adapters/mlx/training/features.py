"""Target-side compute for distillation: one frozen target forward that captures the selected layers'
outputs (and, for DSpark, the final hidden state), and the head rows of a reduced draft vocabulary.

The forward walks the decoder's own layers with a causal mask; right padding never leaks into earlier rows,
so one padded batch gives every sequence its exact features.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx import nn

from mlx_dspark.adapters.mlx import model_parts

EMBEDDING_OUTPUT = -1  # the hidden state entering decoder layer 0


def capture(
    model: nn.Module, ids: mx.array, layer_ids: Sequence[int], *, final: bool
) -> tuple[mx.array, mx.array | None]:
    """One causal forward of the frozen target over `ids` [B, S].

    Args:
        model: the mlx-lm target.
        ids: token ids [B, S] (right-padded).
        layer_ids: decoder layers whose outputs are captured, in order (−1 = the embedding output).
        final: also return the final-normed hidden state (target logits for DSpark's L1 loss).

    Returns:
        (features [B, S, m·H] float32, final hidden [B, S, H] or None), both without gradient.
    """
    decoder = model_parts._decoder(model)
    h = model_parts.embed(model, ids)
    wanted = set(layer_ids)
    found: dict[int, mx.array] = {}
    if EMBEDDING_OUTPUT in wanted:
        found[EMBEDDING_OUTPUT] = h
    stop = len(decoder.layers) if final else max(layer_ids) + 1
    for i, layer in enumerate(decoder.layers[:stop]):
        h = layer(h, "causal", None)
        if i in wanted:
            found[i] = h
    feats = mx.concatenate([found[i].astype(mx.float32) for i in layer_ids], axis=-1)
    last = model_parts.final_norm(model)(h) if final else None
    return mx.stop_gradient(feats), None if last is None else mx.stop_gradient(last)


def head_rows(model: nn.Module, token_ids: Sequence[int]) -> mx.array:
    """The target head's weight rows [len(token_ids), H] for `token_ids` (see `model_parts.head_rows`)."""
    return model_parts.head_rows(model, mx.array(list(token_ids), dtype=mx.int32))

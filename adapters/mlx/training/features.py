"""Target-side compute for distillation: one frozen target forward that captures the selected layers'
outputs (and, for DSpark, the final hidden state), and the head rows of a reduced draft vocabulary.

The forward is the decoder's own, read by the serving target's layer taps; it is causal, so right padding never
leaks into earlier rows and one padded batch gives every sequence its exact features.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx import nn

from mlx_dspark.adapters.mlx import model_parts
from mlx_dspark.adapters.mlx.target import EnoughLayers, disarm, record_layers

EMBEDDING_OUTPUT = -1  # the hidden state entering decoder layer 0


def capture(
    model: nn.Module, ids: mx.array, layer_ids: Sequence[int], *, final: bool
) -> tuple[mx.array, mx.array | None]:
    """One causal forward of the frozen target over `ids` [B, S].

    It is the decoder's own forward (its masks, sliding windows, per-layer inputs, shared KV, recurrent and conv
    scans), read by the same layer taps the serving target records with: a drafter trains on exactly the
    features it will be given. Without `final` the forward ends after the deepest captured layer.

    Args:
        model: the mlx-lm target.
        ids: token ids [B, S] (right-padded).
        layer_ids: decoder layers whose outputs are captured, in order (−1 = the embedding output).
        final: also return the final-normed hidden state (target logits for DSpark's L1 loss).

    Returns:
        (features [B, S, m·H] float32, final hidden [B, S, H] or None), both without gradient.
    """
    decoder = model_parts._decoder(model)
    layers = [layer for layer in decoder.layers if layer is not None]
    last = len(layers) - 1
    stop = None if final else max(0, *layer_ids)  # the final state needs the whole forward
    rec = record_layers(layers, [*layer_ids, *([last] if final else [])], stop_after=stop)
    out = None
    try:
        out = decoder(ids)  # with `final`: the final-normed hidden state, under whatever name the family has
    except EnoughLayers:
        pass
    finally:
        disarm(layers)
    found = rec.rows
    feats = mx.concatenate([found[i].astype(mx.float32) for i in layer_ids], axis=-1)
    hidden = None
    if final:
        hidden = out if isinstance(out, mx.array) else model_parts.final_norm(model)(found[last])
    return mx.stop_gradient(feats), None if hidden is None else mx.stop_gradient(hidden)


def head_rows(model: nn.Module, token_ids: Sequence[int]) -> mx.array:
    """The target head's weight rows [len(token_ids), H] for `token_ids` (see `model_parts.head_rows`)."""
    return model_parts.head_rows(model, mx.array(list(token_ids), dtype=mx.int32))
